"""Router replay for RL on MoE models (R3: "Rollout Routing Replay"): the experts each token was routed to while its
completion was sampled are recorded, and the training forward of that completion routes it to the same experts.
The gate weights of the replayed experts come from the training forward's own router scores, so the router still
learns. Written here because neither transformers nor DeepSpeed records or replays routing; it serves transformers'
DeepSeek-V2/V3/V3.2 routers (softmax or sigmoid affinity) and, under expert parallelism, DeepSpeed AutoEP's router
that replaced them (the sampling model is transformers' either way: expert ids are the same global ones)."""

from __future__ import annotations

import re

import torch
from deepspeed.moe.ep_count import count_tokens_per_expert
from deepspeed.moe.ep_router import TokenChoiceTopKRouter
from torch import nn

from ..utils.private_api import in_backward
from .moe import HF_ROUTERS, moe_blocks


def _layer_routers(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its router, in transformers' model (`model.layers.<i>.mlp`) and in our pipeline layers
    (`layers.<i + 1>.layer.mlp`: the embedding is spec 0)."""
    out = {}
    for name, (_, router) in moe_blocks(model).items():
        match = re.search(r"(\d+)\.(layer\.)?mlp$", name)
        out[int(match.group(1)) - (1 if match.group(2) else 0)] = router
    return out


class RoutingRecorder:
    """Hooks on the routers of the model that samples (transformers' CausalLM): each forward's chosen experts per
    layer, kept until take()."""

    def __init__(self, model: nn.Module):
        self._calls: dict[int, list[torch.Tensor]] = {i: [] for i in _layer_routers(model)}
        self._hooks = [router.register_forward_hook(self._keep(i)) for i, router in _layer_routers(model).items()]

    def _keep(self, layer: int):
        def hook(router, args, output):
            b, t = args[0].shape[:2]
            self._calls[layer].append(output[2].detach().view(b, t, -1).cpu())
        return hook

    def take(self, prompts: list[list[int]], completions: list[list[int]]) -> list[dict[int, torch.Tensor]]:
        """Per row of the last generate() call (its prompts left-padded to a common width): layer -> the experts
        [tokens, k] of the row's prompt and completion tokens but the last (whose routing no sampling step computed);
        then forget them."""
        width = max(map(len, prompts))
        whole = {layer: torch.cat(calls, dim=1) for layer, calls in self._calls.items()}
        for calls in self._calls.values():
            calls.clear()
        return [{layer: e[r, width - len(p):width + len(c) - 1] for layer, e in whole.items()}
                for r, (p, c) in enumerate(zip(prompts, completions))]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class RouterReplay:
    """Hooks on this rank's routers of the training model: while `replaying(rows, width)` is set, each router's chosen
    experts are the recorded ones at the rows' recorded positions (the others keep their own), with the gate weights
    the router's formula gives them; it counts the token decisions that differ from what the router chose."""

    def __init__(self, model: nn.Module, score_func: str, norm_topk_prob: bool, scaling: float, device):
        self.score_func, self.norm, self.scaling = score_func, norm_topk_prob, scaling
        self._rows: list[dict[int, torch.Tensor]] | None = None
        self._width = 0
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)  # (changed, replayed) token decisions
        for layer, router in _layer_routers(model).items():
            if not isinstance(router, (*HF_ROUTERS, TokenChoiceTopKRouter)):
                raise TypeError(f"router replay serves transformers' and AutoEP's routers, not {type(router).__name__}")
            router.register_forward_hook(self._replay(layer))

    def replaying(self, rows: list[dict[int, torch.Tensor]] | None, width: int = 0) -> None:
        """The next forwards' rows (RoutingRecorder.take's, in the micro-batch's order, each from column 0 of rows
        `width` wide); None: route freely."""
        self._rows, self._width = rows, width

    def _replay(self, layer: int):
        def hook(router, args, output):
            if self._rows is None or not router.training or layer not in self._rows[0]:
                return None  # free routing, evaluation, or a layer sampling had not (an MTP module)
            autoep = isinstance(router, TokenChoiceTopKRouter)
            # AutoEP's router returns only the chosen experts' scores: its logits again (one small matmul).
            logits, chosen = (router.gate(args[0]), output[1]) if autoep else (output[0], output[2])
            k = chosen.shape[-1]
            chosen = chosen.view(len(self._rows), self._width, k)
            recorded, known = chosen.clone(), torch.zeros(chosen.shape[:2], dtype=torch.bool, device=chosen.device)
            for r, row in enumerate(self._rows):
                n = row[layer].shape[0]
                recorded[r, :n] = row[layer].to(chosen.device)
                known[r, :n] = True
            differ = (recorded.sort(-1).values != chosen.sort(-1).values).any(-1) & known
            if not in_backward():  # activation checkpointing's re-run forward counts once
                self.sums += torch.stack([differ.sum(), known.sum()]).double()
            indices = recorded.view(-1, k)
            if autoep:  # its own formula (TokenChoiceTopKRouter.forward) on the recorded experts
                weights = self._weights(logits, indices, router.score_func, router.route_norm) * router.route_scale
                return weights, indices, count_tokens_per_expert(indices, router.num_experts)
            return logits, self._weights(logits, indices, self.score_func, self.norm) * self.scaling, indices
        return hook

    @staticmethod
    def _weights(logits: torch.Tensor, indices: torch.Tensor, score_func: str, norm: bool) -> torch.Tensor:
        """The gate weights of the experts `indices` under the router's score function, normalised if it does."""
        scores = torch.sigmoid(logits.float()) if score_func == "sigmoid" else logits.softmax(-1, dtype=torch.float32)
        weights = scores.gather(1, indices)
        return weights / (weights.sum(-1, keepdim=True) + 1e-20) if norm else weights

    def take(self) -> torch.Tensor:
        """(changed, replayed) token decisions of the step on this rank, then zero."""
        out = self.sums.clone()
        self.sums.zero_()
        return out
