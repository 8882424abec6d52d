#!/usr/bin/env bash
# One device call after a host-code change (2026-12-02): host µs per op, Gemma-3-4B LoRA (6 layers) and
# Llama-3-8B LoRA through fuser alone (profiled), the NCCL distributed test, and the GPU tests of the kernels whose
# host code changed. Results under $OUT; the last lines are a short summary.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/prof
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -1
# this tree's src/ first, whether or not the editable install took (a leftover fuser/ directory in the machine's copy
# would otherwise be imported as an empty namespace package)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
date -u
(cd benchmarks && timeout 80 python3 host_overhead.py --out "$OUT/host_overhead.md" > /dev/null 2>&1)
timeout 150 python3 benchmarks/train_step.py --job gemma3-4b-lora --all-modes --modes fuser --layers 6 --steps 6 \
  --warmup 2 --timeout 140 --profile /tmp/prof --out "$OUT/gemma6.md" --json "$OUT/gemma6.json" > "$OUT/gemma6.log" 2>&1
cp /tmp/prof/profile_gemma3-4b-lora_fuser.md "$OUT/" 2>/dev/null
date -u
MODES= JOB=llama3-8b-lora STEPS=6 TIMEOUT=190 timeout 200 bash benchmarks/gpu_job.sh > "$OUT/llama.log" 2>&1
date -u
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/integrations/test_distributed.py \
  > "$OUT/fsdp_gpu.txt" 2>&1
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_upcast_linear.py \
  tests/kernels/test_lora_sum.py tests/kernels/test_rms_norm.py tests/kernels/test_rope.py > "$OUT/gpu_kernels.txt" 2>&1
date -u
cat "$OUT/host_overhead.md"
grep -A3 "^| mode" "$OUT/gemma6.md"; grep "wall time" /tmp/prof/profile_gemma3-4b-lora_fuser.md
grep -A3 "^| mode" /tmp/res_llama3-8b-lora/train_step_llama3-8b-lora.md; grep "wall time" /tmp/res_llama3-8b-lora/profile_*.md
grep -v "^\[rank" "$OUT/fsdp_gpu.txt" | grep -E "^E  |passed|failed" | head -12
tail -2 "$OUT/gpu_kernels.txt"
