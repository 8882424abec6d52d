#!/usr/bin/env bash
# One device call: install what the GPU machine lacks, run the GPU tests, run the benchmarks.
# Usage (device tool, carry [".whl"]):  bash benchmarks/gpu_run.sh
#   BENCHES="rms_norm rope" runs a subset of the benchmarks, GPU_TESTS="tests/kernels/test_rope.py" a subset of the
#   GPU tests (GPU_TESTS=none: no tests)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
# this tree's src/ first, whether or not the editable install took (a leftover fuser/ directory in the machine's copy
# would otherwise be imported as an empty namespace package)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "date: $(date -u +%F)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>/dev/null || echo "liger-kernel: not installed"
} | tee "$OUT/versions.txt"
if [ "${GPU_TESTS:-tests}" != none ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
fi
for bench in ${BENCHES:-rms_norm gated_activation rope mlp_block}; do
  python3 "benchmarks/bench_${bench}.py" --out "$OUT/bench_${bench}.md" 2>&1 | tee "$OUT/bench_${bench}.log" | tail -30
done
