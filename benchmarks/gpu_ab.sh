#!/usr/bin/env bash
# One device call for an A/B of two versions of fuser's code on one training-step job: the working tree (B) against
# another tree (A, e.g. main before a change), their runs interleaved (A B A B …) so that a change of the host's or
# the GPU's speed during the call falls on both sides; then one table of every run and each side's median.
# The device's host speed varied by up to 1.7x within minutes on 2026-12-03 (benchmarks/results/
# host_bound_gemma3_qwen25_h200_2026-12-03.md), so a single run per side cannot show a change of a few percent.
# Usage (device tool; A is a directory that travels with the tree, e.g. made by
#   `git archive <ref> src benchmarks | tar -x -C .ab/<ref>`; carry [".whl"] where Liger-Kernel is wanted):
#   A=.ab/main JOB=gemma3-4b-lora RUNS=2 STEPS=8 WARMUP=2 TIMEOUT=170 bash benchmarks/gpu_ab.sh
#   RUNS: runs per side (2); EXTRA: more train_step.py flags for every run; MODE: train_step.py's mode (fuser).
# Each side imports its own tree's fuser: fuser is uninstalled for the call (an editable install would shadow
# PYTHONPATH), and train_step.py then puts its own tree first on sys.path, in its child processes too.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
JOB=${JOB:?JOB=<train_step.py job>}
A=$(cd "${A:?A=<directory of the other tree, with src/fuser/ and benchmarks/>}" && pwd)
B=$PWD
R=/tmp/ab_$JOB
mkdir -p "$OUT" "$R"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip uninstall -q -y fuser 2>/dev/null
for side in A B; do
  root=$A; [ "$side" = B ] && root=$B
  (cd "$root" && python3 - <<'EOF'
import pathlib, sys
sys.path[:0] = [str(pathlib.Path.cwd() / "src"), str(pathlib.Path.cwd())]
import fuser
print("imports", fuser.__file__)
EOF
  ) | sed "s/^/$side: /"
done
# shellcheck disable=SC2206
EXTRA_ARGS=(${EXTRA:-})
LABELS=()
for i in $(seq 1 "${RUNS:-2}"); do
  for side in A B; do
    root=$A; [ "$side" = B ] && root=$B
    name="${side}_$i"
    (cd "$root" && timeout "${TIMEOUT:-240}" python3 benchmarks/train_step.py --job "$JOB" --mode "${MODE:-fuser}" \
      --steps "${STEPS:-8}" --warmup "${WARMUP:-2}" "${EXTRA_ARGS[@]}" --json "$R/$name.json") > "$R/$name.log" 2>&1 \
      || echo "$name: exit $?" | tee -a "$R/failed.txt"
    LABELS+=("$name")
  done
done
python3 - "$R" "${LABELS[@]}" <<'EOF' | tee "$R/ab_$JOB.md"
import json, pathlib, statistics, sys
sys.path.insert(0, "benchmarks")
from train_step_report import fmt, one_mode, timed_host_ms
r = pathlib.Path(sys.argv[1])
print("| run | tokens/s | step ms | host ms | peak GiB | warm-up s | last loss | steps (ms) | fuser imported from |")
print("|---|---:|---:|---:|---:|---:|---:|---|---|")
sides, first = {"A": [], "B": []}, None
for name in sys.argv[2:]:
    path = r / f"{name}.json"
    if not path.exists():
        print(f"| {name} | no result | | | | | | | |")
        continue
    d = json.loads(path.read_text())
    d = one_mode(d)
    first = first or d
    host_ms = fmt(timed_host_ms(d), ".1f")
    steps = " ".join(f"{1e3 * s:.0f}" for s in d["step_s"])
    sides[name[0]].append(d["tokens_per_s"])
    print(f"| {name} | {d['tokens_per_s']:,.0f} | {d['step_ms']:.1f} | {host_ms} | {d.get('peak_gib') or float('nan'):.2f} |"
          f" {d['warmup_s']:.1f} | {d['last_loss']:.4f} | {steps} | {d.get('fuser_source')} |")
if sides["A"] and sides["B"]:
    a, b = statistics.median(sides["A"]), statistics.median(sides["B"])
    print(f"\nmedian tokens/s: A {a:,.0f}, B {b:,.0f}, B ÷ A {b / a:.3f}")
if first:
    print(f"\n{first['device']}; {first['versions']}; {first['date']}; steps {first['steps']}, warm-up {first['warmup']}")
EOF
tar czf "$OUT/ab_$JOB.tgz" -C /tmp "ab_$JOB"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
