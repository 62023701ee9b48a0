#!/usr/bin/env bash
# LoRA that shows it works (recipes/lora-tiny-v3.yaml), from a pretrained base as users fine-tune: pretrain tiny-v3
# on a related task (synth-task --kind copy: the chat format and attending to a word's letters, not reversal), export
# it as the HF base, then on the reversal task of scripts/sft_demo.sh score the base, LoRA-train it and score it, and
# fully fine-tune the same base for the same steps, side by side. Every run is scripts/sft_demo.sh with its SFT_*
# variables; the words drawn depend on the seed only, so the copy task's training words are the reversal task's and
# no run trains on a held-out word.
# Environment: LORA_DIR (runs/lora-demo) holds everything; LORA_BASE_STEPS (300) pretraining steps; SFT_STEPS (the
# LoRA recipe's) steps of the LoRA and the full run; LORA_FULL (1; 0 skips the full run); SFT_N, SFT_HELDOUT as in
# sft_demo.sh; LORA_REPORT (docs/bench/lora-demo.md; empty: none) the report written at the end. Arguments go to
# every training run (e.g. --set eval.interval=100).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
dir=${LORA_DIR:-runs/lora-demo}
base_steps=${LORA_BASE_STEPS:-300}
report=${LORA_REPORT-docs/bench/lora-demo.md}
steps=${SFT_STEPS:-$(python -c "import yaml; print(yaml.safe_load(open('recipes/lora-tiny-v3.yaml'))['train']['steps'])")}
start=$SECONDS
rm -rf "$dir"
mkdir -p "$dir"
# One checkpoint per run, at its last step: the one scored and exported.
SFT_REPORT= SFT_DIR=$dir/base SFT_KIND=copy SFT_STEPS=$base_steps bash scripts/sft_demo.sh \
  --set "checkpoint.interval=$base_steps" --set "eval.interval=$base_steps" "$@"
# fp32: the base LoRA and the full run start from is exactly the pretrained model.
deepseek-ds export hf "$dir/base/train/checkpoints" --out "$dir/base-hf" --dtype fp32
SFT_REPORT= SFT_DIR=$dir/lora SFT_START=$dir/base-hf SFT_STEPS=$steps SFT_RECIPE=recipes/lora-tiny-v3.yaml \
  bash scripts/sft_demo.sh --set "checkpoint.interval=$steps" "$@"
if [[ ${LORA_FULL:-1} == 1 ]]; then
  SFT_REPORT= SFT_DIR=$dir/full SFT_START=$dir/base-hf SFT_STEPS=$steps bash scripts/sft_demo.sh \
    --set "checkpoint.interval=$steps" "$@"
fi
python - "$dir" $((SECONDS - start)) "$report" "$*" <<'PY'
import json, os, sys
root, seconds, report, args = sys.argv[1:]
runs = [r for r in ("lora", "full") if os.path.isdir(f"{root}/{r}/train")]
def score(run, name):
    return json.load(open(f"{root}/{run}/{name}.json"))["exact_match"]
def checkpoint_mb(run):
    top = f"{root}/{run}/train/checkpoints"
    step = open(f"{top}/latest").read().strip()
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(f"{top}/{step}") for f in fs) / 1e6
def metrics(run):
    return [json.loads(line) for line in open(f"{root}/{run}/train/metrics.jsonl")]
def tokens_per_sec(run):
    rows = metrics(run)[1:]  # step 1 is warm-up
    return sum(r["tokens_per_sec"] for r in rows) / max(len(rows), 1)
lines = [f"base (copy task): held-out copy exact match {score('base', 'after'):.3f}, reversal "
         f"{score('lora', 'before'):.3f}"]
lines += [f"{run:4s} on reversal: exact match {score(run, 'before'):.3f} -> {score(run, 'after'):.3f}, "
          f"checkpoint {checkpoint_mb(run):.1f} MB, {tokens_per_sec(run):,.0f} tokens/s" for run in runs]
lines.append(f"{seconds} s in all")
print("\n".join(lines))
if report:
    import torch
    from deepseek_ds.bench.report import write_process_report
    table = ["| run | step | training loss | held-out exact match |", "|---|--:|--:|--:|"]
    table += [f"| {run} | {m['step']} | {m['loss']:.3f} | {m['task_exact_match']:.3f} |"
              for run in runs for m in metrics(run) if "task_exact_match" in m]
    write_process_report(report, "LoRA demo (scripts/lora_demo.sh)", (
        f"`bash scripts/lora_demo.sh {args}`: tiny-v3 pretrained on the copy task (the base), exported, then LoRA "
        "(recipes/lora-tiny-v3.yaml) and full fine-tuning (recipes/sft-tiny-v3.yaml) from it on the reversal task, "
        "2 ranks each, scored on the held-out words (greedy answers)."), ["\n".join(lines), "\n".join(table)],
        ranks=1 if torch.cuda.device_count() == 1 else 2, command=f"bash scripts/lora_demo.sh {args}".strip())
    print(f"wrote {report}")
PY
