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
python - "$dir" $((SECONDS - start)) "$report" "$*" <<'PY'
import json, sys
d, seconds, report, args = sys.argv[1:]
metrics = [json.loads(line) for line in open(f"{d}/metrics.jsonl")]
first, last = metrics[0], metrics[-1]
evals = [m for m in metrics if m.get("eval_loss") is not None]
speed = [m["tokens_per_sec"] for m in metrics[1:]] or [first["tokens_per_sec"]]  # step 1 is warm-up
lines = [f"main loss {first['lm_loss']:.2f} -> {last['lm_loss']:.2f}, MTP loss {first['mtp_loss']:.2f} -> "
         f"{last['mtp_loss']:.2f} over {last['step']} steps",
         f"validation loss {evals[-1]['eval_loss']:.2f} (step {evals[-1]['step']})" if evals else "no validation",
         f"{sum(speed) / len(speed):,.0f} tokens/s (2 ranks), {seconds} s in all"]
print("\n".join(lines))
if report:
    from deepseek_ds.bench.report import write_process_report
    table = ["| step | loss | main loss | MTP loss | validation loss |", "|--:|--:|--:|--:|--:|"]
    table += [f"| {m['step']} | {m['loss']:.3f} | {m['lm_loss']:.3f} | {m['mtp_loss']:.3f} | "
              f"{'' if m.get('eval_loss') is None else format(m['eval_loss'], '.3f')} |"
              for m in metrics if m["step"] == 1 or m.get("eval_loss") is not None]
    write_process_report(report, "MTP demo (scripts/mtp_demo.sh)", (
        "tiny-v3 with one MTP module (weight 0.3) on the last of 2 pipeline stages, trained on the built-in corpus "
        "(recipes/tiny-v3-mtp.yaml). loss = main loss + 0.3 x MTP loss."), ["\n".join(lines), "\n".join(table)],
        ranks=2, command=f"bash scripts/mtp_demo.sh {args}".strip())
    print(f"wrote {report}")
PY
