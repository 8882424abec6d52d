#!/usr/bin/env bash
# One device call for one training-step job (issue 6): every mode in its own process with fresh compile caches,
# fuser's run also profiled, then one table. Results (no traces) in $OUT/<job>.tgz.
# Usage (device tool, carry [".whl"]):  JOB=llama3-8b-lora bash benchmarks/gpu_job.sh
#   MODES (default "eager,liger,compile"; fuser always runs last, profiled), STEPS (10), WARMUP (3), TIMEOUT per
#   mode in s (240), EXTRA: more train_step.py flags for every mode (e.g. "--layers 8"), TAG: a suffix for the
#   result folder and archive, so one call can run a job twice (e.g. MODES= TAG=cublas
#   EXTRA="--fuser-option experimental.upcast_linear.triton=false"),
#   MEMORY=1: every mode also writes what is live at the peak of one more step (memory_<job>_<mode>.md)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
JOB=${JOB:?JOB=<train_step.py job>}
NAME=$JOB${TAG:+_$TAG}
R=/tmp/res_$NAME
mkdir -p "$OUT" "$R"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
# this tree's src/ first, whether or not the editable install took (a leftover fuser/ directory in the machine's copy
# would otherwise be imported as an empty namespace package)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
COMMON=(--job "$JOB" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" --timeout "${TIMEOUT:-240}")
# shellcheck disable=SC2206
EXTRA_ARGS=(${EXTRA:-})
if [ "${MEMORY:-0}" = 1 ]; then EXTRA_ARGS+=(--memory-at-peak "$R"); fi
FILES=()
if [ -n "${MODES-eager,liger,compile}" ]; then
  python3 benchmarks/train_step.py "${COMMON[@]}" "${EXTRA_ARGS[@]}" --all-modes --modes "${MODES:-eager,liger,compile}" \
    --json "$R/others.json" --out "$R/others.md" > "$R/others.log" 2>&1
  FILES+=("$R/others.json")
fi
python3 benchmarks/train_step.py "${COMMON[@]}" "${EXTRA_ARGS[@]}" --all-modes --modes fuser --profile "$R" \
  --json "$R/fuser.json" --out "$R/fuser.md" > "$R/fuser.log" 2>&1
FILES+=("$R/fuser.json")
python3 benchmarks/train_step.py --job "$JOB" --combine "${FILES[@]}" --out "$R/train_step_${JOB}.md" \
  --json "$R/train_${JOB}.json" > /dev/null 2>&1
cat "$R/train_step_${JOB}.md" 2>/dev/null | tail -15
grep -A 12 "op family" "$R"/profile_*.md 2>/dev/null | head -14
tar czf "$OUT/$NAME.tgz" --exclude='*.trace.json.gz' -C /tmp "res_$NAME"
