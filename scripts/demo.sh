#!/usr/bin/env bash
# The main job: set up, then train the tiny DeepSeek-V3 on 2 ranks with the DeepSpeed launcher
# (CPU here, the first two GPUs where present). Extra arguments go to train.py (e.g. --set train.steps=50).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
ranks=2
if python -c "import torch,sys; sys.exit(0 if torch.cuda.device_count() == 1 else 1)"; then ranks=1; fi
deepseek-ds validate --config recipes/tiny-v3.yaml --num_gpus "$ranks" "$@"
exec deepspeed --num_gpus "$ranks" train.py --config recipes/tiny-v3.yaml "$@"
