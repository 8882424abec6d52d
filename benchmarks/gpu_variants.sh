#!/usr/bin/env bash
# One device call for an A/B of fuser's options on one training-step job: each variant (and each other mode) in its
# own process, on the same machine, then one table of all. Results in $OUT/variants_<job>.tgz and the table on stdout.
# Usage (device tool, carry [".whl"]):
#   JOB=llama32-1b-full MODES=liger,compile VARIANTS="default|+rms_norm_linear|+rms_norm_linear gqa_fold" \
#     bash benchmarks/gpu_variants.sh
#   VARIANTS: "|"-separated; in each, a word starting with + adds that pattern to the default ones, one starting with -
#   takes it out (not both in one variant), any other word but "default" is a --fuser-option (NAME=VALUE, or a bare
#   name of experimental.causal_attention.gqa_fold as shorthand).
#   STEPS (6), WARMUP (3), TIMEOUT per process in s (240), EXTRA: more train_step.py flags for every process.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
JOB=${JOB:?JOB=<train_step.py job>}
R=/tmp/variants_$JOB
# a fresh folder: on a warm machine an earlier call's JSON would otherwise stand in for a process that timed out
rm -rf "$R"
mkdir -p "$OUT" "$R"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
# this tree's src/ first, whether or not the editable install took (a leftover fuser/ directory in the machine's copy
# would otherwise be imported as an empty namespace package)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
COMMON=(--job "$JOB" --steps "${STEPS:-6}" --warmup "${WARMUP:-3}")
# shellcheck disable=SC2206
EXTRA_ARGS=(${EXTRA:-})
LABELS=()
if [ -n "${MODES:-}" ]; then
  IFS=, read -ra OTHERS <<< "$MODES"
  for mode in "${OTHERS[@]}"; do
    timeout "${TIMEOUT:-240}" python3 benchmarks/train_step.py "${COMMON[@]}" "${EXTRA_ARGS[@]}" --mode "$mode" \
      --json "$R/$mode.json" > "$R/$mode.log" 2>&1 || echo "$mode: exit $?" | tee -a "$R/failed.txt"
    LABELS+=("$mode")
  done
fi
IFS='|' read -ra VARIANT_LIST <<< "${VARIANTS:-default}"
i=0
for variant in "${VARIANT_LIST[@]}"; do
  args=()
  patterns=""
  sign="+"
  for word in $variant; do
    case "$word" in
      default) ;;
      +*) patterns="${patterns:+$patterns,}$word" ;;
      -*) patterns="${patterns:+$patterns,}$word"; sign="-" ;;
      gqa_fold) args+=(--fuser-option experimental.causal_attention.gqa_fold=true) ;;
      *) args+=(--fuser-option "$word") ;;
    esac
  done
  if [ -n "$patterns" ]; then patterns=${patterns//+/}; args+=("--fuser-patterns=$sign${patterns//-/}"); fi
  name="fuser_$i"
  echo "$variant" > "$R/$name.label"
  timeout "${TIMEOUT:-240}" python3 benchmarks/train_step.py "${COMMON[@]}" "${EXTRA_ARGS[@]}" --mode fuser \
    "${args[@]}" --json "$R/$name.json" > "$R/$name.log" 2>&1 || echo "$name ($variant): exit $?" | tee -a "$R/failed.txt"
  LABELS+=("$name")
  i=$((i + 1))
done
python3 - "$R" "${LABELS[@]}" <<'EOF' | tee "$R/variants_$JOB.md"
import json, pathlib, sys
sys.path.insert(0, "benchmarks")
from train_step_report import fmt, one_mode, timed_gc_ms, timed_host_ms
r = pathlib.Path(sys.argv[1])
print("| run | tokens/s | step ms | host ms | GC ms | peak GiB | warm-up s | last loss | fused |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
first = None
for name in sys.argv[2:]:
    label = (r / f"{name}.label").read_text().strip() if (r / f"{name}.label").exists() else name
    path = r / f"{name}.json"
    if not path.exists():
        print(f"| {label} | no result (the process wrote none: timed out or crashed, see its log) | | | | | |")
        continue
    d = json.loads(path.read_text())
    d = one_mode(d)
    if d.get("error") or d.get("tokens_per_s") is None:  # e.g. out of memory: say so, with the peak it reached
        why = "out of memory" if "out of memory" in str(d.get("error", "")) else str(d.get("error", "no result"))[:80]
        print(f"| {d.get('mode', name)} {label if name.startswith('fuser') else ''} | {why} | | | |"
              f" {d.get('peak_gib') or float('nan'):.2f} | | | |")
        continue
    first = first or d
    counts = d.get("fuser_counts", "")
    host_ms, gc_ms = fmt(timed_host_ms(d), ".1f"), fmt(timed_gc_ms(d), ".1f")
    print(f"| {d['mode']} {label if name.startswith('fuser') else ''} | {d['tokens_per_s']:,.0f} | {d['step_ms']:.1f} |"
          f" {host_ms} | {gc_ms} | {d.get('peak_gib') or float('nan'):.2f} | {d['warmup_s']:.1f} |"
          f" {d['last_loss']:.4f} | {counts} |")
if first:
    print(f"\n{first['device']}; {first['versions']}; {first['date']}; steps {first['steps']}, warm-up {first['warmup']}")
EOF
tar czf "$OUT/variants_$JOB.tgz" -C /tmp "variants_$JOB"
