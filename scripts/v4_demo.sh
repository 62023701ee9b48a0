#!/usr/bin/env bash
# DeepSeek-V4 that shows it trains (recipes/tiny-v4.yaml): tiny-v4 (sliding-window, CSA and HCA attention, 2
# hyper-connection streams, a hash-routed MoE layer) on the built-in corpus, ZeRO-1 on 2 ranks; then the loss first ->
# last, the validation loss and tokens/s, printed and written as a report.
# Environment: V4_DIR (runs/v4-demo) the run's output directory; V4_REPORT (docs/bench/v4-demo.md; empty: none).
# Arguments go to the training run (e.g. --set train.steps=50).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
dir=${V4_DIR:-runs/v4-demo}
report=${V4_REPORT-docs/bench/v4-demo.md}
start=$SECONDS
rm -rf "$dir"
deepseek-ds train --config recipes/tiny-v4.yaml --num_gpus 2 --set "train.output_dir=$dir" "$@"
if [[ -n $report ]]; then
  python -m deepseek_ds.bench.run_report "$dir" --seconds $((SECONDS - start)) --ranks 2 --out "$report" \
    --title "DeepSeek-V4 demo (scripts/v4_demo.sh)" --command "bash scripts/v4_demo.sh${*:+ $*}" \
    --what "tiny-v4 (recipes/tiny-v4.yaml: sliding-window, CSA and HCA attention, 2 hyper-connection streams, one \
hash-routed and three top-k MoE layers) trained from its seeded initialisation on the built-in corpus, ZeRO-1 on 2 ranks."
fi
