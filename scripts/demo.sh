#!/usr/bin/env bash
# The main job: set up, then train the tiny DeepSeek-V3 on 2 ranks with the DeepSpeed launcher
# (CPU here, the first two GPUs where present). Extra arguments go to the run (e.g. --set train.steps=50).
# `deepseek-ds train` validates the run first, then runs `deepspeed --num_gpus N --module deepseek_ds.training.main`
# under it (passing signals on: Ctrl-C saves the current step).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
ranks=2
if python -c "import torch,sys; sys.exit(0 if torch.cuda.device_count() == 1 else 1)"; then ranks=1; fi
exec deepseek-ds train --config recipes/tiny-v3.yaml --num_gpus "$ranks" "$@"
