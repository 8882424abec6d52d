#!/usr/bin/env bash
# One device call of benchmarks/trainer_throughput.py: install the wheels benchmarks/fetch_wheels.sh put in .whl/
# (Liger-Kernel, TRL, datasets, Unsloth, DeepSpeed and what each needs), then run it with the arguments given; the
# table, every number and the log go to $OUT/$NAME.md, .json and .log. One call holds 10 minutes: give a large
# model's modes in groups (--modes) and join their JSON files with --combine afterwards. Under --deepspeed the script
# first builds DeepSpeed's CPU Adam op (g++ and ninja; a failed build says why in the .log), and this says which tools
# the machine has.
# Usage (device tool, carry [".whl"]):
#   NAME=llama3-8b_lora_fixed_a bash benchmarks/gpu_trainer.sh --model llama3-8b --modes none,torch_compile
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
NAME=${NAME:-trainer_throughput}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
# this tree's src/ first, whether or not the editable install took (a leftover fuser/ directory in the machine's copy
# would otherwise be imported as an empty namespace package)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ " $* " == *" --deepspeed "* ]]; then
  echo "deepspeed: compilers and ninja here: $(command -v g++ c++ ninja nvcc | tr '\n' ' ')"
fi
python3 benchmarks/trainer_throughput.py "$@" --out "$OUT/$NAME.md" --json "$OUT/$NAME.json" > "$OUT/$NAME.log" 2>&1
rc=$?
cat "$OUT/$NAME.md" 2>/dev/null || tail -20 "$OUT/$NAME.log"
echo "trainer_throughput.py rc=$rc"
