"""`deepseek-ds eval` of a checkpoint on a preference dataset: the pair metrics training logs at eval.interval
(eval_loss, eval_rewards_chosen/rejected, eval_reward_margin, eval_reward_accuracy; models/preference_loss.py), for
the split's first eval.batches global batches of pairs, in this process with the whole model.

The reference is the run's: preference.reference's directory, or the starting weights (model.path's, else the
preset's seeded initialisation: the same weights training started from); none for SimPO. A LoRA checkpoint's
reference is its base (model.path)."""

from __future__ import annotations

import torch

from ..config import RunConfig
from ..data import micro_batch
from ..data.sft import PreferenceDataset
from ..models.hf_io import has_weights, load_hf_weights
from ..models.pipeline import build_model, local_layers, split_micro_batch
from ..models.preference_loss import METRICS, chosen_nll, metric_sums, normalised, preference_terms, sequence_logps
from ..training.evaluation import eval_sample_count


def _logps(model, dataset: PreferenceDataset, n: int, micro: int, device) -> torch.Tensor:
    """[2, n] summed log-probabilities (chosen row, rejected row) and [2, n] trained-token counts, as [4, n]."""
    out = []
    model.eval()
    with torch.no_grad():
        for a in range(0, n, micro):
            inputs, labels = split_micro_batch(micro_batch(dataset, list(range(a, min(a + micro, n)))))
            inputs = tuple(t.to(device) for t in inputs) if isinstance(inputs, tuple) else inputs.to(device)
            logps, counts = sequence_logps(model(inputs), labels.to(device))
            out.append(torch.cat([logps.double().reshape(2, -1), counts.double().reshape(2, -1)]))
    return torch.cat(out, dim=1).cpu()


def reference_model(cfg: RunConfig, mcfg, device):
    """The run's reference as a SequentialLM (None for SimPO)."""
    if cfg.preference.loss == "simpo":
        return None
    model = build_model(mcfg, 1, cfg.train.seed)
    source = cfg.preference.reference or (cfg.model.path if cfg.model.path and has_weights(cfg.model.path) else None)
    if source:
        load_hf_weights(local_layers(model), source, mcfg)
    return model.to(device)


def preference_eval(model, cfg: RunConfig, mcfg, data: str, split: str, device) -> dict:
    dataset = PreferenceDataset(data, cfg.data.seq_len, split, truncation=cfg.data.truncation)
    n = eval_sample_count(len(dataset), cfg.eval.batches, cfg.train.global_batch_size)
    p, micro = cfg.preference, cfg.train.micro_batch_size
    policy = _logps(model, dataset, n, micro, device)
    counts, logps = policy[2:].reshape(-1), policy[:2].reshape(-1)
    reference = reference_model(cfg, mcfg, device)
    ref = None if reference is None else normalised(_logps(reference, dataset, n, micro, device)[:2].reshape(-1),
                                                    counts, p.loss)
    terms = preference_terms(normalised(logps, counts, p.loss), ref, p.loss, p.beta, p.label_smoothing, p.simpo_gamma,
                             p.rpo_alpha, chosen_nll(logps, counts))
    record = {f"eval_{k}": v / n for k, v in zip(METRICS, metric_sums(*terms).tolist())}
    return {**record, "eval_pairs": n, "preference_loss": p.loss,
            "reference": None if reference is None else p.reference or "starting weights"}
