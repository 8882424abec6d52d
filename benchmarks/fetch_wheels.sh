#!/usr/bin/env bash
# Fetch into .whl/ (git-ignored) the wheels trainer_throughput.py's modes need on the GPU machine, which has torch,
# triton, transformers, peft, accelerate, pandas, pyarrow, xxhash and fsspec but no Liger-Kernel, TRL, datasets,
# Unsloth or DeepSpeed, and no network. benchmarks/gpu_trainer.sh installs them there (--no-deps, into /tmp/site).
# Usage (here, with network and torch):  bash benchmarks/fetch_wheels.sh
#   PY: the GPU machine's Python (default 3.12); DEST (default .whl); NO_UNSLOTH=1 leaves Unsloth out;
#   NO_DEEPSPEED=1 leaves DeepSpeed out.
#
# What and why:
# - liger-kernel: the liger mode (pure Python; needs only torch and triton);
# - trl, datasets and datasets' dill and multiprocess: the sft trainer and Unsloth (TRL needs datasets; the image
#   has datasets' other dependencies). Versions within Unsloth's bounds (trl <= 1.15.0, datasets < 5), so one set
#   serves every mode;
# - unsloth, unsloth_zoo and the small ones they import (tyro and its docstring-parser and typeguard, msgspec,
#   nest-asyncio, json5, structlog, cut-cross-entropy). unsloth's wheel also carries its "studio" web app (tens of
#   MB, used only by its command line): it is cut out, or the wheels would not fit the device's 64 MiB carry.
#   Left out: bitsandbytes (over 40 MB; Unsloth needs it only for 4- and 8-bit loading and runs without it),
#   xformers (built per torch version; Unsloth falls back to sdpa), torchao, diffusers, hf_transfer (quantisation,
#   diffusion models and downloads, none of which this benchmark uses);
# - deepspeed (--deepspeed), published only as source: built here into a pure-Python wheel with DS_BUILD_OPS=0, so
#   that it compiles no op ahead and builds each on first use there (its CPU Adam with g++ and ninja, which the
#   machine has); the accelerator and torch it records at build time matter only to ops built ahead, of which it
#   has none. Its dependencies the machine lacks: hjson, and pydantic with pydantic-core (the build of the same
#   version), annotated-types and typing-inspection; typing-extensions too, for pydantic's lower bound on it, which
#   the machine's copy may not meet (einops, msgpack, ninja, psutil, py-cpuinfo, numpy, packaging and tqdm are there).
set -euo pipefail
PY=${PY:-3.12}
DEST=${DEST:-.whl}
TRL=${TRL:-"trl<=1.15.0"}
DATASETS=${DATASETS:-"datasets>=4.7,<5,!=4.4.*,!=4.5.0"}
DEEPSPEED=${DEEPSPEED:-"deepspeed==0.19.8"}
PYDANTIC=${PYDANTIC:-"pydantic==2.13.4"}
PYDANTIC_CORE=${PYDANTIC_CORE:-"pydantic-core==2.46.4"}  # the exact version $PYDANTIC requires
PACKAGES=(liger-kernel "$TRL" "$DATASETS" "dill<0.4.2" "multiprocess<0.70.20")
if [ "${NO_UNSLOTH:-0}" != 1 ]; then
  PACKAGES+=(unsloth unsloth_zoo tyro docstring-parser typeguard msgspec nest-asyncio json5 structlog cut-cross-entropy)
fi
if [ "${NO_DEEPSPEED:-0}" != 1 ]; then
  PACKAGES+=(hjson==3.1.0 "$PYDANTIC" "$PYDANTIC_CORE" annotated-types==0.7.0 typing-inspection==0.4.2
    typing-extensions==4.16.0)
fi
mkdir -p "$DEST"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  PLATFORMS+=(--platform "$p")
done
for package in "${PACKAGES[@]}"; do
  # (a pip config's missing local index pages only warn)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" "${PLATFORMS[@]}" -d "$DEST" \
    "$package" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
done
if [ "${NO_DEEPSPEED:-0}" != 1 ]; then
  # (setup.py imports torch to see what it could build: no build isolation, so the torch installed here serves)
  DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$DEST" "$DEEPSPEED" 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
fi
# unsloth without studio/: the wheel's files and RECORD rows under it go (pip installs what RECORD's rest names)
for wheel in "$DEST"/unsloth-*.whl; do
  [ -e "$wheel" ] || continue
  python3 - "$wheel" <<'EOF'
import os, sys, zipfile

path = sys.argv[1]
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename.startswith("studio/"):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(row for row in data.splitlines(True) if not row.startswith(b"studio/"))
        if item.filename.endswith(".dist-info/top_level.txt"):
            data = b"".join(row for row in data.splitlines(True) if row.strip() != b"studio")
        dst.writestr(item, data)
os.replace(tmp, path)
EOF
done
ls -lS "$DEST"/*.whl | awk '{printf "%6.2f MiB  %s\n", $5 / 1048576, $NF}'
du -cb "$DEST"/*.whl | awk 'END {printf "total %.1f MiB\n", $1 / 1048576}'
