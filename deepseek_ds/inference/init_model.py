"""`deepseek-ds models init`: a preset's randomly initialised model as an HF directory, with a tokenizer, for runs that
need a model.path with nothing pretrained behind it (LoRA, a tokenizer other than the preset's, a smoke test of a
pipeline that reads HF directories).

The weights are those training from the preset starts from (models/pipeline.py build_model: every layer from its own
seed, train.seed's default unless --seed), for the preset's shape with the tokenizer's vocabulary: training from
`model.path: DIR` starts where `model.preset: NAME` with `model.overrides.vocab_size` would. The directory is what
`export hf` writes (export.write_hf_dir): config.json with the tokenizer's BOS and EOS, the safetensors, the MTP
modules in the published layout, the tokenizer with its chat template, the KV cache on."""

from __future__ import annotations

import os

import psutil

from ..config.schema import TrainSection
from ..data.tokenizer import import_tokenizer, vocab_size_of
from ..models.hf_io import to_hf_model
from ..models.pipeline import build_model, layer_costs, local_layers, prepare_config
from ..models.presets import build_model_config
from ..utils.errors import UserError
from ..utils.fmt import human_bytes
from .export import write_hf_dir

DEFAULT_SEED = TrainSection.seed  # what a run from the preset uses unless its YAML sets train.seed


def init_model(preset: str, tokenizer: str, out: str, seed: int = DEFAULT_SEED, dtype: str = "fp32",
               force: bool = False) -> str:
    """Write the preset's seeded initial model with `tokenizer` (a local directory, or `deepseek`) to `out`; returns
    `out`. The vocabulary is the tokenizer's, whatever the preset says (its ids must all have an embedding row)."""
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise UserError(f"--out {out} exists and is not empty: choose another directory, or pass --force to write "
                        "the model into it (replacing its config, weights and tokenizer files)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} is a file: choose a directory")
    tok = import_tokenizer(tokenizer, "--tokenizer")
    # Only the vocabulary follows the tokenizer here: the special-token ids reach config.json through
    # write_hf_dir, as for every export (the preset's are its architecture's, not this tokenizer's).
    config = prepare_config(build_model_config(preset, overrides={"vocab_size": vocab_size_of(tok)}))
    _check_memory(preset, config, dtype)
    layers = local_layers(build_model(config, 1, seed))
    model = to_hf_model(layers, config)
    if force and os.path.isdir(out):
        _remove_weights(out)
    # config.json keeps the preset's pad_token_id (generation_config.json gets the tokenizer's): as the embedding's
    # padding_idx the tokenizer's (DeepSeek's is its EOS) would freeze a row that a run from the preset trains.
    return write_hf_dir(model, layers, config, tok, out, dtype, config_pad=False)


def _check_memory(preset: str, config, dtype: str) -> None:
    """The whole model is built in fp32 in this process (and a bf16 copy written from it): refuse a preset that cannot
    fit before minutes of allocation end in the OOM killer (deepseek-v3: 671B parameters)."""
    params = sum(c.params for c in layer_costs(config))  # meta device: no memory
    need = params * (4 + (2 if dtype == "bf16" else 0))
    available = psutil.virtual_memory().available
    if need > available:
        raise UserError(f"--preset {preset} has {params:,} parameters: models init builds them in memory, "
                        f"{human_bytes(need)}, but this host has {human_bytes(available)} available; choose a smaller "
                        "preset (`deepseek-ds models list`), or start from the published weights")


def _remove_weights(out: str) -> None:
    """An earlier model's safetensors files and index: save_pretrained writes its own, and a shard it does not
    overwrite would stay listed nowhere yet be read by a loader that globs, or mislead a reader."""
    for name in os.listdir(out):
        if name.startswith("model") and (name.endswith(".safetensors") or name.endswith(".safetensors.index.json")):
            os.remove(os.path.join(out, name))
