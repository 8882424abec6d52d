#!/usr/bin/env bash
# One device call for issue 16's convergence table: each preset × lr as its own convergence.py run, with the preset's
# runs (fp32 reference, eager bf16, Inductor bf16, fuser bf16; an autocast preset, *-amp, the same under bf16
# autocast), reports in $OUT. Usage (device tool): CASES="llama3-8b:lora:1e-5 ..." bash
# benchmarks/gpu_convergence.sh   (a case is preset:method:lr[:layers]; LIMIT: seconds per case, default 200)
#   CASES="llama3-8b-amp:lora:1e-5 llama3-8b-amp:lora:2e-4 qwen3-8b-amp:lora:2e-4:2" LIMIT=150 bash ...   # autocast
set -uo pipefail
shopt -s nullglob
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
# this tree's src/ first, whether or not the editable install took (a leftover fuser/ directory in the machine's copy
# would otherwise be imported as an empty namespace package)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
for case in ${CASES:?}; do
  IFS=: read -r preset method lr layers <<< "$case"
  name="convergence_${preset}_${method}_lr${lr}"
  timeout "${LIMIT:-200}" python3 benchmarks/convergence.py --preset "$preset" --methods "$method" --lr "$lr" \
    ${layers:+--layers "$layers"} --out "$OUT/$name.md" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$case rc=$?"; grep -E "^\| \`|PASS|FAIL" "$OUT/$name.md" 2>/dev/null | head -6 | cut -c1-150
done
# the device call brings back at most 8 files: past that, the reports stay and the rest goes into one archive
cd "$OUT" && files=(convergence_*) && if [ ${#files[@]} -gt 8 ]; then
  tar -czf convergence_runs.tgz --remove-files -- convergence_*.json convergence_*.log convergence_*.png
fi
