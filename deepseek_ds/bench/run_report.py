"""The report of a demo's training run, from the run's own metrics.jsonl: its losses first -> last, the last
validation loss, tokens/s and wall time, and the losses at step 1 and at every evaluation; printed, and written with
the environment (report.write_process_report) when --out is given. scripts/demo.sh and scripts/mtp_demo.sh call it.

    python -m deepseek_ds.bench.run_report RUN_DIR --seconds S --ranks N --title T --what W --command C [--out PATH]
"""

from __future__ import annotations

import argparse
import os

from ..training.metrics import read_metrics


def summary_lines(metrics: list[dict], seconds: int, ranks: int) -> list[str]:
    first, last = metrics[0], metrics[-1]
    if "mtp_loss" in last:
        losses = (f"main loss {first['lm_loss']:.2f} -> {last['lm_loss']:.2f}, MTP loss {first['mtp_loss']:.2f} -> "
                  f"{last['mtp_loss']:.2f} over {last['step']} steps")
    else:
        losses = f"loss {first['loss']:.2f} -> {last['loss']:.2f} over {last['step']} steps"
    evals = [m for m in metrics if m.get("eval_loss") is not None]
    speed = [m["tokens_per_sec"] for m in metrics[1:]] or [first["tokens_per_sec"]]  # step 1 is warm-up
    return [losses,
            f"validation loss {evals[-1]['eval_loss']:.2f} (step {evals[-1]['step']})" if evals else "no validation",
            f"{sum(speed) / len(speed):,.0f} tokens/s ({ranks} ranks), {seconds} s in all"]


def loss_table(metrics: list[dict]) -> str:
    """Step 1 and every evaluated step; the main and MTP parts beside the loss when the run has MTP."""
    mtp = "mtp_loss" in metrics[-1]
    keys = ["loss"] + (["lm_loss", "mtp_loss"] if mtp else [])
    head = ["step", "loss"] + (["main loss", "MTP loss"] if mtp else []) + ["validation loss"]
    rows = ["| " + " | ".join(head) + " |", "|" + "--:|" * len(head)]
    for m in metrics:
        if m["step"] == 1 or m.get("eval_loss") is not None:
            cells = [str(m["step"])] + [f"{m[k]:.3f}" for k in keys]
            cells.append("" if m.get("eval_loss") is None else f"{m['eval_loss']:.3f}")
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepseek_ds.bench.run_report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the run's train.output_dir (its metrics.jsonl)")
    p.add_argument("--seconds", type=int, required=True, help="the run's wall time, start-up included")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--title", required=True)
    p.add_argument("--what", required=True, help="what ran, the report's first paragraph")
    p.add_argument("--command", required=True, help="the command that ran, as the report names it")
    p.add_argument("--out", default="", help="the report's path (none when empty)")
    args = p.parse_args(argv)
    metrics = read_metrics(os.path.join(args.run_dir, "metrics.jsonl"))
    lines = summary_lines(metrics, args.seconds, args.ranks)
    print("\n".join(lines))
    if args.out:
        from .report import write_process_report  # torch and DeepSpeed: only for the report
        write_process_report(args.out, args.title, args.what, ["\n".join(lines), loss_table(metrics)],
                             ranks=args.ranks, command=args.command)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
