#!/usr/bin/env bash
# Multi-token prediction that shows it trains (recipes/tiny-v3-mtp.yaml): tiny-v3 with one MTP module on the last of
# 2 pipeline stages, on the built-in corpus, 2 ranks; then the main and MTP losses, first -> last, the validation
# loss and tokens/s, printed and written as a report.
# Environment: MTP_DIR (runs/mtp-demo) the run's output directory; MTP_REPORT (docs/bench/mtp-demo.md; empty: none).
# Arguments go to the training run (e.g. --set train.steps=50).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
dir=${MTP_DIR:-runs/mtp-demo}
report=${MTP_REPORT-docs/bench/mtp-demo.md}
start=$SECONDS
rm -rf "$dir"
deepseek-ds train --config recipes/tiny-v3-mtp.yaml --num_gpus 2 --set "train.output_dir=$dir" "$@"
python -m deepseek_ds.bench.run_report "$dir" --seconds $((SECONDS - start)) --ranks 2 --out "$report" \
  --title "MTP demo (scripts/mtp_demo.sh)" --command "bash scripts/mtp_demo.sh${*:+ $*}" \
  --what "tiny-v3 with one MTP module (weight 0.3) on the last of 2 pipeline stages, trained on the built-in corpus \
(recipes/tiny-v3-mtp.yaml). loss = main loss + 0.3 x MTP loss."
