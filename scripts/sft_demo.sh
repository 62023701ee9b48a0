#!/usr/bin/env bash
# Fine-tuning that shows it works (recipes/sft-tiny-v3.yaml): generate a synthetic instruction task (reverse a
# word's letters), tokenize it as DeepSeek-V3 chat data, save the starting HF model, score it on the held-out words,
# fine-tune it on 2 ranks, score the result. Deterministic: every step is seeded.
# Sizes (environment): SFT_N training items (20000), SFT_HELDOUT (200), SFT_STEPS (the recipe's); SFT_DIR (runs/
# sft-demo) holds everything; SFT_REPORT (docs/bench/sft-demo.md; empty: none) the report written at the end;
# arguments go to the training run (e.g. --set train.lr=1e-3).
# scripts/lora_demo.sh reuses it through SFT_KIND (synth-task --kind, reverse), SFT_RECIPE (recipes/sft-tiny-v3.yaml)
# and SFT_START (an HF directory to start from instead of the random initialisation).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
dir=${SFT_DIR:-runs/sft-demo}
n=${SFT_N:-20000}
heldout=${SFT_HELDOUT:-200}
kind=${SFT_KIND:-reverse}
recipe=${SFT_RECIPE:-recipes/sft-tiny-v3.yaml}
start_hf=${SFT_START:-$dir/start-hf}
report=${SFT_REPORT-docs/bench/sft-demo.md}
steps=(); [[ -n ${SFT_STEPS:-} ]] && steps=(--set "train.steps=$SFT_STEPS")
ranks=2
if python -c "import torch,sys; sys.exit(0 if torch.cuda.device_count() == 1 else 1)"; then ranks=1; fi
start=$SECONDS
rm -rf "$dir"
deepseek-ds data synth-task --out "$dir/task" --n "$n" --heldout "$heldout" --seed 0 --kind "$kind"
deepseek-ds data prepare --format chat --input "$dir/task/train.jsonl" --tokenizer "$dir/task/tokenizer" \
  --out "$dir/data" --valid-fraction 0.02 --no-progress
# The start: tiny-v3 at its seeded initialisation, with the task tokenizer's vocabulary, as an HF directory.
[[ -n ${SFT_START:-} ]] || python - "$dir" <<'PY'
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from deepseek_ds.data.tokenizer import vocab_size_of
from deepseek_ds.models.presets import build_model_config
out = sys.argv[1]
tok = AutoTokenizer.from_pretrained(f"{out}/task/tokenizer")
torch.manual_seed(0)
config = build_model_config("tiny-v3", overrides={"vocab_size": vocab_size_of(tok), "bos_token_id": tok.bos_token_id,
                                                  "eos_token_id": tok.eos_token_id})
AutoModelForCausalLM.from_config(config).save_pretrained(f"{out}/start-hf")
tok.save_pretrained(f"{out}/start-hf")
PY
deepseek-ds eval --task "$dir/task/heldout.jsonl" --model "$start_hf" --out "$dir/before.json" \
  --predictions "$dir/before-preds.jsonl" --max-new-tokens 8
deepseek-ds train --config "$recipe" --num_gpus "$ranks" --set "model.path=$start_hf" \
  --set "data.path=$dir/data" --set "eval.task=$dir/task/heldout.jsonl" --set "train.output_dir=$dir/train" \
  "${steps[@]}" "$@"
deepseek-ds eval --task "$dir/task/heldout.jsonl" --checkpoint "$dir/train/checkpoints" --out "$dir/after.json" \
  --predictions "$dir/after-preds.jsonl" --max-new-tokens 8
python - "$dir" $((SECONDS - start)) "$report" "$ranks" "$*" <<'PY'
import json, sys
d, seconds, report, ranks, args = sys.argv[1:]
before, after = (json.load(open(f"{d}/{name}.json")) for name in ("before", "after"))
# BLEU is left out: 4-gram BLEU of one-word answers is 0 whatever they are.
line = (f"held-out exact match: before {before['exact_match']:.3f}, after {after['exact_match']:.3f} "
        f"({after['n']} items); {seconds} s in all")
print(line)
if report:
    from deepseek_ds.bench.report import write_process_report
    metrics = [json.loads(x) for x in open(f"{d}/train/metrics.jsonl")]
    evals = [m for m in metrics if "task_exact_match" in m]
    table = ["| step | training loss | validation loss | held-out exact match |", "|--:|--:|--:|--:|",
             f"| 0 (the start) | | | {before['exact_match']:.3f} |"]
    table += [f"| {m['step']} | {m['loss']:.3f} | {m.get('eval_loss', float('nan')):.3f} | "
              f"{m['task_exact_match']:.3f} |" for m in evals]
    write_process_report(report, "SFT demo (scripts/sft_demo.sh)", (
        f"`bash scripts/sft_demo.sh {args}`: tiny-v3 from its seeded initialisation fine-tuned on the synthetic "
        f"reversal task on 2 ranks, scored on {after['n']} held-out words (greedy answers). Training loss "
        f"{metrics[0]['loss']:.2f} (step 1) -> {metrics[-1]['loss']:.2f} (step {metrics[-1]['step']})."),
        ["\n".join(table), line], ranks=int(ranks), command=f"bash scripts/sft_demo.sh {args}".strip())
    print(f"wrote {report}")
PY
