#!/usr/bin/env bash
# The main job: set up, then train the tiny DeepSeek-V3 on 2 ranks with the DeepSpeed launcher
# (CPU here, the first two GPUs where present). Extra arguments go to the run (e.g. --set train.steps=50).
# DEMO_REPORT=PATH: train from scratch, then write the run's report there (docs/bench/demo.md).
# `deepseek-ds train` validates the run first, then runs `deepspeed --num_gpus N --module deepseek_ds.training.main`
# under it (passing signals on: Ctrl-C saves the current step).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
ranks=2
if python -c "import torch,sys; sys.exit(0 if torch.cuda.device_count() == 1 else 1)"; then ranks=1; fi
report=${DEMO_REPORT:-}
if [[ -z $report ]]; then
  exec deepseek-ds train --config recipes/tiny-v3.yaml --num_gpus "$ranks" "$@"
fi
# DEMO_REPORT=docs/bench/demo.md: a run from scratch (its own directory: runs/tiny-v3 keeps its checkpoints), then
# its report, which the README quotes.
dir=runs/tiny-v3-report
rm -rf "$dir"
start=$SECONDS
deepseek-ds train --config recipes/tiny-v3.yaml --num_gpus "$ranks" --set "train.output_dir=$dir" "$@"
python -m deepseek_ds.bench.run_report "$dir" --seconds $((SECONDS - start)) --ranks "$ranks" --out "$report" \
  --title "The main job (scripts/demo.sh)" --command "DEMO_REPORT=$report bash scripts/demo.sh${*:+ $*}" \
  --what "tiny-v3 (recipes/tiny-v3.yaml) trained from its seeded initialisation on the built-in corpus, ZeRO-1 on \
$ranks ranks. The time is the whole \`deepseek-ds train\` command's: validation, launch, training and the saves."
