"""Per-step metrics: the JSON-lines file, throughput and FLOPs estimates, and the loss-curve plot."""

from __future__ import annotations

import json
import math
import os

from ..models.pipeline import layer_costs


def flops_per_token(model_config, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active (non-embedding) parameters plus the attention score and value
    matmuls (causal: half the square), the usual PaLM/Megatron accounting."""
    active = sum(c.active_params for c in layer_costs(model_config))
    if hasattr(model_config, "qk_nope_head_dim"):
        qk = model_config.qk_nope_head_dim + model_config.qk_rope_head_dim
        v = model_config.v_head_dim
    else:
        qk = v = model_config.hidden_size // model_config.num_attention_heads
    attn = 6 * model_config.num_hidden_layers * model_config.num_attention_heads * seq_len * (qk + v) / 2
    return 6 * active + attn


class MetricsWriter:
    """Appends one JSON object per optimizer step; keeps the values for the final summary and plot."""

    def __init__(self, path: str, append: bool):
        self.path = path
        self.records: list[dict] = []
        if append and os.path.exists(path):
            with open(path) as f:
                self.records = [json.loads(line) for line in f if line.strip()]
        self._file = open(path, "a" if append else "w")

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        self.records.append(record)

    def close(self) -> None:
        self._file.close()


def plot_loss(records: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, [r["loss"] for r in records], lw=1.2, label="train loss")
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", lw=1.2, label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
