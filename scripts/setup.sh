#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (CUDA build where a GPU is present, the CPU build elsewhere), this toolkit
# with its test extras at the versions of the matching lock (requirements/cpu.txt or cuda.txt, as pip constraints;
# re-installed when setup.py or that lock changes), and DeepSpeed's JIT ops compiled once into a pinned cache
# (.cache/torch_extensions).
# Source it (`. scripts/setup.sh`) to get the environment in the current shell.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
if [[ ! -x .venv/bin/python ]]; then
  "${PYTHON:-python3}" -m venv .venv
fi
export PATH="$root/.venv/bin:$PATH"   # one python, one ninja (the venv's) for every JIT build
export TORCH_EXTENSIONS_DIR="$root/.cache/torch_extensions"
# CPU or CUDA, decided once, for torch and for the lock of every other version (requirements/, `bash scripts/lock.sh`
# regenerates it): the build of a torch already in .venv (never swapped behind the user's back), else DS_ACCELERATOR
# when it says cpu or cuda (the Dockerfile's ARG: an image is built without a GPU), else whether an NVIDIA GPU answers.
if torch_version=$(python -c "from importlib.metadata import version; print(version('torch'))" 2>/dev/null); then
  variant=cuda
  [[ $torch_version != *+cpu ]] || variant=cpu
  why="the torch in .venv is $torch_version"
elif [[ ${DS_ACCELERATOR:-} == cpu || ${DS_ACCELERATOR:-} == cuda ]]; then
  variant=$DS_ACCELERATOR why="DS_ACCELERATOR=$DS_ACCELERATOR"
elif nvidia-smi -L >/dev/null 2>&1; then
  variant=cuda why="nvidia-smi sees a GPU"
else
  variant=cpu why="no GPU (nvidia-smi)"
fi
lock=requirements/$variant.txt
stamp=.venv/.deepseek-ds-installed
want=$(cat setup.py "$lock" | sha1sum | cut -c1-40)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "setup.sh: installing with the $variant lock, $lock ($why)" >&2
  # torch first, so that a missing build fails with its own hint; its version and build come from the lock.
  if ! python -m pip install -q -c "$lock" torch; then
    [[ $variant != cpu ]] || echo "setup.sh: error: pip found no $(grep '^torch==' "$lock"): PyPI does not serve" \
      "the CPU build; give pip a folder or page that has it (PIP_FIND_LINKS), or take PyPI's CUDA build with" \
      "DS_ACCELERATOR=cuda (in a fresh .venv)." >&2
    exit 1
  fi
  python -m pip install -q -c "$lock" -e ".[test]"
  echo "$want" > "$stamp"
fi
# Compile the ops DeepSpeed JIT-builds on first use, so the first launch is not slowed by ~1 minute of C++. Skipped
# when this set-up (this checkout, this install) already did it in the calling environment: a demo sourcing it
# again under test.sh or another demo would spend ~7 s importing DeepSpeed for nothing.
done_here="$root:$want"
if [[ ${DEEPSEEK_DS_SET_UP:-} == "$done_here" && -d $TORCH_EXTENSIONS_DIR ]]; then
  return 0 2>/dev/null || exit 0
fi
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
export DEEPSEEK_DS_SET_UP=$done_here
