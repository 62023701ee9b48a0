#!/usr/bin/env bash
# The one-command GPU check: bf16/fp16 vs fp32 losses of tiny-v3, MFU and peak memory of a ~1B dense and a small
# V2-Lite-shaped MoE (seq 2048, bf16, ZeRO-1) with each option on and off, the sdpa backend MLA's 192/128 head sizes
# get, and NCCL's all-reduce bus bandwidth when more than one GPU is visible. About 8 minutes on one H200; writes
# docs/bench/gpu.md (commit it). `--smoke` runs the same code path tiny on a CPU (CI does); options:
# `bash scripts/gpu_check.sh --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
exec python -m deepseek_ds.bench.gpu_check "$@"
