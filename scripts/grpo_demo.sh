#!/usr/bin/env bash
# Reinforcement learning (GRPO) that shows it works: scripts/sft_demo.sh fine-tunes tiny-v3 on the word-reversal task,
# shortened so the model is decent but imperfect; its checkpoint is exported (fp32) as the GRPO start; the task's
# training words become prompts with their reversal as the answer (the SFT task's held-out words kept out), and GRPO
# trains on 2 ranks with the exact_match reward, 8 sampled completions per prompt. Scores, before (the SFT model) and
# after GRPO: held-out exact match of greedy answers (eval --task), and the validation prompts' mean reward of greedy
# completions (eval_reward) at the first eval.interval and at the end.
# Deterministic (every step and every rollout seeded). Environment: GRPO_DIR (runs/grpo-demo) holds everything;
# GRPO_SFT_STEPS (300) SFT steps; GRPO_STEPS (100) GRPO steps; GRPO_INTERVAL (20) eval.interval of the GRPO run;
# SFT_N, SFT_HELDOUT as in sft_demo.sh; GRPO_REPORT (docs/bench/grpo-demo.md) the report written at the end.
# Arguments go to the GRPO run.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
dir=${GRPO_DIR:-runs/grpo-demo}
sft_steps=${GRPO_SFT_STEPS:-300}
steps=${GRPO_STEPS:-100}
interval=${GRPO_INTERVAL:-20}
heldout=${SFT_HELDOUT:-200}
report=${GRPO_REPORT:-docs/bench/grpo-demo.md}
ranks=2
if python -c "import torch,sys; sys.exit(0 if torch.cuda.device_count() == 1 else 1)"; then ranks=1; fi
start=$SECONDS
rm -rf "$dir"
mkdir -p "$dir"
SFT_REPORT= SFT_DIR=$dir/sft SFT_STEPS=$sft_steps SFT_HELDOUT=$heldout bash scripts/sft_demo.sh \
  --set "checkpoint.interval=$sft_steps" --set "eval.interval=$sft_steps"
sft_s=$((SECONDS - start))
deepseek-ds export hf "$dir/sft/train/checkpoints" --out "$dir/sft-hf" --dtype fp32
# The SFT task's training conversations as prompts with answers.
python - "$dir/sft/task/train.jsonl" "$dir/prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[1]) as src, open(sys.argv[2], "w") as out:
    for line in src:
        item = json.loads(line)
        out.write(json.dumps({"prompt": item["prompt"], "answer": item["response"]}) + "\n")
PY
tok=$dir/sft/task/tokenizer
deepseek-ds data prepare --format prompts --input "$dir/prompts.jsonl" --tokenizer "$tok" --out "$dir/prompt-data" \
  --valid-fraction 0.05 --no-progress
deepseek-ds eval --task "$dir/sft/task/heldout.jsonl" --model "$dir/sft-hf" --out "$dir/before-task.json" \
  --predictions "$dir/before-preds.jsonl" --max-new-tokens 8
grpo_start=$SECONDS
deepseek-ds train --config recipes/sft-tiny-v3.yaml --num_gpus "$ranks" --set "model.path=$dir/sft-hf" \
  --set "data.path=$dir/prompt-data" --set data.packing=false --set data.seq_len=32 --set train.objective=grpo \
  --set grpo.num_generations=8 --set grpo.max_completion_length=8 --set grpo.temperature=1.0 \
  --set "grpo.reward=[exact_match]" --set train.global_batch_size=64 --set train.micro_batch_size=16 \
  --set train.lr=3e-5 --set train.min_lr=3e-6 --set train.warmup_steps=5 --set "train.steps=$steps" \
  --set "eval.interval=$interval" --set eval.batches=12 --set "eval.task=$dir/sft/task/heldout.jsonl" \
  --set "checkpoint.interval=$steps" --set "train.output_dir=$dir/grpo" "$@"
grpo_s=$((SECONDS - grpo_start))
deepseek-ds eval --task "$dir/sft/task/heldout.jsonl" --checkpoint "$dir/grpo/checkpoints" --out "$dir/after-task.json" \
  --predictions "$dir/after-preds.jsonl" --max-new-tokens 8
python - "$dir" "$report" "$sft_s" "$grpo_s" $((SECONDS - start)) "$ranks" "$*" <<'PY'
import json, os, sys
d, report, sft_s, grpo_s, total_s, ranks, args = sys.argv[1:]
before, after = (json.load(open(f"{d}/{name}.json")) for name in ("before-task", "after-task"))
metrics = [json.loads(line) for line in open(f"{d}/grpo/metrics.jsonl")]
sft_steps = [json.loads(line) for line in open(f"{d}/sft/train/metrics.jsonl")][-1]["step"]
evals = [m for m in metrics if "eval_reward" in m]
window = max(1, len(metrics) // 5)  # one step's 64 completions are noisy: means over a fifth of the run
first, last = evals[0], evals[-1]
table = ["| measure | SFT model | after GRPO |", "|---|---|---|",
         f"| held-out exact match (greedy) | {before['exact_match']:.3f} | {after['exact_match']:.3f} |",
         f"| validation reward, greedy (step {first['step']} -> {last['step']}) | {first['eval_reward']:.3f} | "
         f"{last['eval_reward']:.3f} |",
         f"| sampled completions' reward (mean of the first / last {window} steps) | "
         f"{sum(m['reward'] for m in metrics[:window]) / window:.3f} | "
         f"{sum(m['reward'] for m in metrics[-window:]) / window:.3f} |",
         f"| steps (SFT, GRPO) | {sft_steps} | {metrics[-1]['step']} |",
         f"| seconds (SFT demo, GRPO training) | {sft_s} | {grpo_s} |"]
print("\n".join(table))
# Where a GRPO step's time goes (each phase's seconds, the mean over the ranks and the steps).
phases = {name: sum(m[f"time_{name}"] for m in metrics) / len(metrics) for name in ("generation", "reference", "update")}
step_s = sum(m["step_time"] for m in metrics) / len(metrics)
split = ["| phase of a GRPO step | seconds (mean over steps) | share of the step |", "|---|---|---|",
         *(f"| {name} | {s:.3f} | {s / step_s:.0%} |" for name, s in phases.items()),
         f"| the whole step (metrics, all-reduces included) | {step_s:.3f} | 100% |"]
print("\n".join(split))
note = (f"{after['n']} held-out words; {total_s} s in all. Each GRPO step samples 8 completions of each of 8 prompts "
        "(temperature 1) and rewards the exact answer (exact_match); the validation reward is that of greedy "
        f"completions of {first['eval_prompts']} validation prompts.")
print(note)
env = " ".join(f"{k}={os.environ[k]}" for k in ("GRPO_SFT_STEPS", "GRPO_STEPS", "SFT_N", "SFT_HELDOUT")
               if k in os.environ)
command = " ".join(filter(None, [env, "bash scripts/grpo_demo.sh", args]))
from deepseek_ds.bench.report import write_process_report
write_process_report(report, "GRPO demo (scripts/grpo_demo.sh)", f"`{command}`", ranks=int(ranks), command=command,
                     blocks=["\n".join(table), note, "\n".join(split)])
print(f"wrote {report}")
PY
