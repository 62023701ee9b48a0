"""Checkpoint tensor names that are not transformers' in-memory ones (DeepSeek-V4's: `layers.0.attn.wq_a.weight`,
`embed.weight`, `head.weight`, `hc_head_fn`, per-expert `ffn.experts.E.w1.weight`, FP8 scales under `.scale`; what
its save_pretrained writes is a mix of these and in-memory names), resolved one tensor at a time with transformers'
own conversion mapping, the one from_pretrained applies: its renamings, its expert-merging converters and its
base-model prefix rule, and the FP8 quantizer's scale renamings. Nothing here is a rename table of ours.
"""

from __future__ import annotations

import re
from copy import deepcopy

import torch
from transformers import FineGrainedFP8Config
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    apply_renamings,
    dot_natural_key,
    rename_source_key,
)
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from ..utils.private_api import keys_ignored_on_load


class CheckpointNames:
    """The tensors of one directory under transformers' names: `weight_map` (file of each tensor, FP8 scales under
    `<weight>_scale_inv`), `sources(name)` (the tensors that make up in-memory tensor `name`, in the order
    transformers merges them), `assemble` (transformers' converter applied to them), `in_memory(tensor)` and
    `on_disk(tensor)` (the name in the file)."""

    def __init__(self, causal_lm: type, config, weight_map: dict[str, str], quantized: bool):
        with torch.device("meta"):  # the model's names, shapes and mapping, no memory
            model = causal_lm(config)
        transforms = get_model_conversion_mapping(model, add_legacy=False)
        # The FP8 quantizer's own renamings of scales (`X.scale` -> `X.weight_scale_inv`), applied before the model's
        # (its converter that pairs each weight with its scale is hf_io's SCALE_SUFFIX pairing).
        quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(dequantize=True)) if quantized else None
        scale_renames = [t for t in quantizer.update_weight_conversions([], model)
                         if isinstance(t, WeightRenaming)] if quantizer else []
        self._on_disk = {apply_renamings(name, scale_renames): name for name in weight_map}
        self.weight_map = {name: weight_map[disk] for name, disk in self._on_disk.items()}
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta_state = model.state_dict()
        self._ignored = [re.compile(r) for r in keys_ignored_on_load(model)]
        self._in_memory: dict[str, str] = {}
        self._sources: dict[str, list[tuple[str, str | None]]] = {}
        self._converter: dict[str, WeightConverter] = {}
        # transformers' loader takes the tensors in this (natural) order, so merged experts stack by expert index.
        for name in sorted(self.weight_map, key=dot_natural_key):
            target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta_state)
            self._in_memory[name] = target
            self._sources.setdefault(target, []).append((name, pattern))
            if pattern is not None:
                self._converter[target] = by_pattern[pattern]

    def in_memory(self, name: str) -> str:
        return self._in_memory.get(name, name)

    def on_disk(self, name: str) -> str:
        return self._on_disk.get(name, name)

    def ignored(self, name: str) -> bool:
        """A tensor transformers' model skips on load (DeepSeek-V4's MTP module, `mtp.*`)."""
        return any(r.search(self.in_memory(name)) for r in self._ignored)

    def sources(self, name: str) -> list[str]:
        """The tensors in-memory tensor `name` is made of; [name] when none maps to it (reported missing)."""
        return [disk for disk, _ in self._sources.get(name, [])] or [name]

    def assemble(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """In-memory tensor `name` from its sources' tensors (in `sources` order), through transformers' converter
        (e.g. MergeModulelist + Concatenate of per-expert w1 / w3 into gate_up_proj)."""
        if name not in self._converter:
            return parts[0]
        converter = deepcopy(self._converter[name])
        for (disk, pattern), tensor in zip(self._sources[name], parts, strict=True):
            converter.add_tensor(name, disk, pattern, tensor)
        (fused,) = converter.convert(name).values()
        return fused
