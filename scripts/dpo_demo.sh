#!/usr/bin/env bash
# Preference training (DPO) that shows it works: scripts/sft_demo.sh fine-tunes tiny-v3 on the word-reversal task,
# shortened so the model is decent but imperfect; its checkpoint is exported (fp32) as the DPO start and reference;
# `synth-task --kind reverse-pairs` writes pairs for the same words ("reverse kqzt": chosen "tzqk", rejected the
# reversal with one letter wrong), the SFT task's held-out words kept out of training; DPO trains on 2 ranks.
# Scores, before (the SFT model) and after DPO, on the held-out words:
#   preference accuracy: the share of held-out pairs whose chosen answer has the higher log-probability under the
#     model (eval with preference.loss=simpo, reference-free; chosen and rejected have the same length);
#   DPO reward accuracy: TRL's, beta * (policy - reference) log-ratio of chosen > rejected's; at step 0 the policy
#     is the reference and every reward is 0 (a tie on every pair), so the table shows the validation split's
#     eval_reward_accuracy at the first eval.interval and at the end, and the held-out pairs' at the end;
#   exact match: eval --task of greedy answers.
# The DPO run adds RPO's NLL term (preference.rpo_alpha 1): DPO alone lowers both answers' likelihood and the greedy
# answers get worse (measured: exact match 0.62 -> 0.445 at lr 3e-4), with it they get better.
# Deterministic (every step seeded). Environment: DPO_DIR (runs/dpo-demo) holds everything; DPO_SFT_STEPS (300) SFT
# steps; DPO_N (4000) training pairs; DPO_STEPS (300) DPO steps; DPO_INTERVAL (100) eval.interval of the DPO run;
# SFT_N, SFT_HELDOUT as in sft_demo.sh; DPO_SFT_ARGS extra arguments of the SFT run (word-split, e.g. --master_port
# N); DPO_SFT_REPORT the SFT run's report (none by default); DPO_REPORT (docs/bench/dpo-demo.md) the report written at
# the end. Arguments go to the DPO run.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
dir=${DPO_DIR:-runs/dpo-demo}
sft_steps=${DPO_SFT_STEPS:-300}
n=${DPO_N:-4000}
steps=${DPO_STEPS:-300}
interval=${DPO_INTERVAL:-100}
heldout=${SFT_HELDOUT:-200}
report=${DPO_REPORT:-docs/bench/dpo-demo.md}
ranks=2
if python -c "import torch,sys; sys.exit(0 if torch.cuda.device_count() == 1 else 1)"; then ranks=1; fi
start=$SECONDS
rm -rf "$dir"
mkdir -p "$dir"
# shellcheck disable=SC2086  # DPO_SFT_ARGS is a list of words
SFT_REPORT=${DPO_SFT_REPORT:-} SFT_DIR=$dir/sft SFT_STEPS=$sft_steps SFT_HELDOUT=$heldout bash scripts/sft_demo.sh \
  --set "checkpoint.interval=$sft_steps" --set "eval.interval=$sft_steps" ${DPO_SFT_ARGS:-}
sft_s=$((SECONDS - start))
# fp32: the DPO start and its reference are exactly the SFT model.
deepseek-ds export hf "$dir/sft/train/checkpoints" --out "$dir/sft-hf" --dtype fp32
# The same seed and --heldout as the SFT task: the same held-out words, and training pairs for SFT training words.
deepseek-ds data synth-task --out "$dir/pairs" --n "$n" --heldout "$heldout" --seed 0 --kind reverse-pairs
tok=$dir/sft/task/tokenizer
deepseek-ds data prepare --format preference --input "$dir/pairs/train.jsonl" --tokenizer "$tok" \
  --out "$dir/pref-data" --valid-fraction 0.02 --no-progress
# The held-out pairs as a dataset of their own, all in its train split (eval --split train scores them).
deepseek-ds data prepare --format preference --input "$dir/pairs/heldout.jsonl" --tokenizer "$tok" \
  --out "$dir/heldout-pairs" --valid-fraction 0 --no-progress
all_pairs=(--data "$dir/heldout-pairs" --split train --set "eval.batches=$heldout" --set data.seq_len=32)
deepseek-ds eval --task "$dir/sft/task/heldout.jsonl" --model "$dir/sft-hf" --out "$dir/before-task.json" \
  --predictions "$dir/before-preds.jsonl" --max-new-tokens 8
deepseek-ds eval --checkpoint "$dir/sft/train/checkpoints" "${all_pairs[@]}" --set preference.loss=simpo \
  --out "$dir/before-pairs.json"
dpo_start=$SECONDS
# Pairs are not packed (a pair travels as two sequences); conversations are at most 22 tokens.
deepseek-ds train --config recipes/sft-tiny-v3.yaml --num_gpus "$ranks" --set "model.path=$dir/sft-hf" \
  --set "data.path=$dir/pref-data" --set data.packing=false --set data.seq_len=32 --set train.objective=dpo \
  --set preference.loss=sigmoid --set preference.beta=0.1 --set preference.reference=null \
  --set preference.rpo_alpha=1.0 --set train.lr=1e-3 --set train.min_lr=1e-4 --set train.warmup_steps=10 \
  --set "train.steps=$steps" \
  --set "eval.interval=$interval" --set "eval.task=$dir/sft/task/heldout.jsonl" \
  --set "checkpoint.interval=$steps" --set "train.output_dir=$dir/dpo" "$@"
dpo_s=$((SECONDS - dpo_start))
deepseek-ds eval --task "$dir/sft/task/heldout.jsonl" --checkpoint "$dir/dpo/checkpoints" --out "$dir/after-task.json" \
  --predictions "$dir/after-preds.jsonl" --max-new-tokens 8
deepseek-ds eval --checkpoint "$dir/dpo/checkpoints" "${all_pairs[@]}" --set preference.loss=simpo \
  --out "$dir/after-pairs.json"
deepseek-ds eval --checkpoint "$dir/dpo/checkpoints" "${all_pairs[@]}" --out "$dir/after-dpo-rewards.json"
python - "$dir" "$report" "$sft_s" "$dpo_s" $((SECONDS - start)) "$ranks" "$*" <<'PY'
import json, os, sys
d, report, sft_s, dpo_s, total_s, ranks, args = sys.argv[1:]
j = {name: json.load(open(f"{d}/{name}.json"))
     for name in ("before-task", "after-task", "before-pairs", "after-pairs", "after-dpo-rewards")}
metrics = [json.loads(line) for line in open(f"{d}/dpo/metrics.jsonl")]
sft_steps = [json.loads(line) for line in open(f"{d}/sft/train/metrics.jsonl")][-1]["step"]
evals = [m for m in metrics if "eval_reward_accuracy" in m]
first, last = evals[0], evals[-1]
rows = [("held-out preference accuracy (chosen more likely)", j["before-pairs"]["eval_reward_accuracy"],
         j["after-pairs"]["eval_reward_accuracy"]),
        (f"validation DPO reward accuracy (step {first['step']} -> {last['step']})", first["eval_reward_accuracy"],
         last["eval_reward_accuracy"]),
        ("held-out DPO reward accuracy", None, j["after-dpo-rewards"]["eval_reward_accuracy"]),
        ("held-out exact match", j["before-task"]["exact_match"], j["after-task"]["exact_match"])]
table = ["| measure | SFT model | after DPO |", "|---|---|---|"]
table += [f"| {name} | {'ties (every reward 0)' if a is None else f'{a:.3f}'} | {b:.3f} |" for name, a, b in rows]
table += [f"| steps (SFT, DPO) | {sft_steps} | {metrics[-1]['step']} |", f"| seconds (SFT demo, DPO training) | "
          f"{sft_s} | {dpo_s} |", f"| DPO loss (step 1 -> last) | {metrics[0]['loss']:.4f} | {metrics[-1]['loss']:.4f} |"]
print("\n".join(table))
print(f"{j['after-pairs']['eval_pairs']} held-out pairs, {j['after-task']['n']} held-out words; {total_s} s in all")
env = " ".join(f"{k}={os.environ[k]}" for k in ("DPO_SFT_STEPS", "DPO_N", "DPO_STEPS", "SFT_N", "SFT_HELDOUT")
               if k in os.environ)
command = " ".join(filter(None, [env, "bash scripts/dpo_demo.sh", args]))
from deepseek_ds.bench.report import write_process_report
write_process_report(report, "DPO demo (scripts/dpo_demo.sh)", f"`{command}`", ranks=int(ranks), command=command, blocks=[
    "\n".join(table), f"{j['after-pairs']['eval_pairs']} held-out pairs, {j['after-task']['n']} held-out words; "
    f"{total_s} s in all. Preference accuracy: the share of held-out pairs whose chosen answer the model finds more "
    "likely (reference-free). DPO reward accuracy: beta * log(policy / reference) of chosen > rejected's, the "
    "reference being the SFT model (at step 0 every reward is 0: a tie on every pair)."])
print(f"wrote {report}")
PY
