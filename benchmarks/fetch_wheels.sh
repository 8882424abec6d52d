#!/usr/bin/env bash
# Fetch into .whl/ (git-ignored) the wheels trainer_throughput.py's modes need on the GPU machine, which has torch,
# triton, transformers, peft, accelerate, pandas, pyarrow, xxhash and fsspec but no Liger-Kernel, TRL, datasets or
# Unsloth, and no network. benchmarks/gpu_trainer.sh installs them there (--no-deps, into /tmp/site).
# Usage (here, with network):  bash benchmarks/fetch_wheels.sh
#   PY: the GPU machine's Python (default 3.12); DEST (default .whl); NO_UNSLOTH=1 leaves Unsloth out.
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
#   diffusion models and downloads, none of which this benchmark uses).
set -euo pipefail
PY=${PY:-3.12}
DEST=${DEST:-.whl}
TRL=${TRL:-"trl<=1.15.0"}
DATASETS=${DATASETS:-"datasets>=4.7,<5,!=4.4.*,!=4.5.0"}
PACKAGES=(liger-kernel "$TRL" "$DATASETS" "dill<0.4.2" "multiprocess<0.70.20")
if [ "${NO_UNSLOTH:-0}" != 1 ]; then
  PACKAGES+=(unsloth unsloth_zoo tyro docstring-parser typeguard msgspec nest-asyncio json5 structlog cut-cross-entropy)
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
