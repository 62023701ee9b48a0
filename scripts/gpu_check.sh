#!/usr/bin/env bash
# The one-command GPU check: bf16/fp16 vs fp32 losses of tiny-v3, the sdpa backend MLA's 192/128 head sizes get,
# MFU and peak memory of a ~1B dense and a small V2-Lite-shaped MoE (seq 2048, bf16, ZeRO-1) with each option on and
# off, and NCCL's all-reduce bus bandwidth when more than one GPU is visible. At most ~8 minutes on one H200
# (--deadline-s); writes docs/bench/gpu.md (commit it). `--smoke` runs the same code path tiny on a CPU (CI does);
# options: `bash scripts/gpu_check.sh --help`.
#
# Python: this checkout's .venv (scripts/setup.sh) where there is one. Without it, a python3 that already imports
# what the check needs is used as it is: a lent GPU machine has no network, so setup.sh (a fresh .venv filled from
# PyPI) cannot run there; scripts/gpu_wheels.sh collects the missing wheels beforehand (README, "GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
if [[ ! -x .venv/bin/python ]] && err=$(python3 -c "import torch, deepspeed, transformers, pydantic" 2>&1); then
  py=$(python3 -c "import sys; print(sys.executable)")
  export PATH="$(dirname "$py"):$PATH"  # its ninja for DeepSpeed's JIT builds
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # the package from this tree, not installed
else
  if [[ ! -x .venv/bin/python ]]; then
    echo "gpu_check.sh: python3 lacks what the check needs; setting up .venv (needs network):" >&2
    tail -3 <<<"${err:-}" >&2
  fi
  . scripts/setup.sh
  py=python
fi
# A copied tree has no .git: gpu_wheels.sh records the commit the report should name.
if [[ -z ${DEEPSEEK_DS_COMMIT:-} && -f .whl/COMMIT ]]; then
  export DEEPSEEK_DS_COMMIT="$(cat .whl/COMMIT)"
fi
exec "$py" -m deepseek_ds.bench.gpu_check "$@"
