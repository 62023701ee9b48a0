#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (CUDA build where a GPU is present, the CPU build elsewhere), this toolkit
# with its test extras, and DeepSpeed's JIT ops compiled once into a pinned cache (.cache/torch_extensions).
# Source it (`. scripts/setup.sh`) to get the environment in the current shell.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
if [[ ! -x .venv/bin/python ]]; then
  "${PYTHON:-python3}" -m venv .venv
fi
export PATH="$root/.venv/bin:$PATH"   # one python, one ninja (the venv's) for every JIT build
export TORCH_EXTENSIONS_DIR="$root/.cache/torch_extensions"
stamp=.venv/.deepseek-ds-installed
want=$(cat setup.py | sha1sum | cut -c1-40)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  # torch first and pinned: here pip takes the CPU wheel on disk; on a GPU machine PyPI's default is the CUDA build.
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
# Compile the ops DeepSpeed JIT-builds on first use, so the first launch is not slowed by ~1 minute of C++.
python - <<'PY'
import deepseek_ds  # noqa: F401  (tells DeepSpeed the accelerator before it guesses and warns)
import torch
from deepspeed.accelerator import get_accelerator
names = ["FusedAdamBuilder"]
# CPUAdam (ZeRO-Offload's optimizer) and the shared-memory collectives serve CPU machines' runs and tests; on a GPU
# machine only an offload run needs CPUAdam, which JIT-builds then instead of slowing every set-up.
if not torch.cuda.is_available():
    names += ["CPUAdamBuilder", "ShareMemCommBuilder"]
for name in names:
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible():
        builder.load(verbose=False)
PY
