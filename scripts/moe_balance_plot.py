"""Train the tiny-v3 demo twice on 2 ranks, without and with DeepSeek-V3's auxiliary-loss-free bias update, and
plot the expert load imbalance (busiest expert's tokens over the mean, averaged over MoE layers) per step.

    .venv/bin/python scripts/moe_balance_plot.py [--steps 150] [--out docs/moe_balance.png]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"bias update off (gamma = 0)": "0", "bias update on (gamma = 0.001, the default)": "0.001"}


def train(out: str, gamma: str, steps: int) -> list[dict]:
    """One 2-rank run of the demo recipe (the balance loss off, to show the bias update alone)."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))}
    sets = [f"train.output_dir={out}", f"train.steps={steps}", "checkpoint.interval=0",
            f"moe.bias_update_speed={gamma}", "moe.seq_aux_alpha=0"]
    subprocess.run([os.path.join(bin_dir, "deepspeed"), "--num_gpus", "2", "train.py", "--config", "recipes/tiny-v3.yaml",
                    *[a for s in sets for a in ("--set", s)]], cwd=ROOT, env=env, check=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def imbalance(record: dict) -> float:
    ratios = [v for k, v in record.items() if k.startswith("moe/layer") and k.endswith("/load_ratio")]
    return sum(ratios) / len(ratios)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "moe_balance.png"))
    p.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", "moe_balance"))
    args = p.parse_args(argv)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, gamma in RUNS.items():
        records = train(os.path.join(args.runs_dir, f"gamma{gamma}"), gamma, args.steps)
        values = [imbalance(r) for r in records]
        tail = values[-20:]
        print(f"{label}: max/mean expert load over the last {len(tail)} steps {sum(tail) / len(tail):.3f}")
        ax.plot([r["step"] for r in records], values, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert (mean over MoE layers)")
    ax.set_title("tiny-v3 on 2 ranks: auxiliary-loss-free load balancing")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.legend()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    fig.savefig(args.out, dpi=120, bbox_inches="tight")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
