"""Exports from the checkpoints of tests/test_checkpoint.py's runs (ZeRO-1, ZeRO-3, PP=2): the HF directory gives the
loss the training run logged for the next step; TorchScript and ONNX reproduce PyTorch's logits on new shapes for
an MoE (tiny-v3) and a dense (tiny-dense) model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from test_checkpoint import GLOBAL_BATCH, _cli, pipeline_run, zero1_run, zero3_run


def _training_loss(model, data_dir: str, step: int, seq_len: int = 128, global_batch: int = GLOBAL_BATCH,
                   micro_batch: int = 8) -> float:
    """The token-weighted (main-model) loss of the global batch that training step `step` used (training's
    TokenWeightedLoss), for a run of the given shape."""
    from deepseek_ds.data import GlobalBatchSampler, PackedDataset, micro_batches

    dataset = PackedDataset(data_dir, seq_len)
    sampler = GlobalBatchSampler(len(dataset), global_batch, micro_batch, 0, 1, 1234,
                                 consumed_samples=(step - 1) * global_batch)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for input_ids, labels in next(micro_batches(dataset, sampler)):
            logits = model(input_ids=input_ids).logits
            total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
            tokens += int((labels != -100).sum())
    return total / tokens


def _run(kind: str, tmp_path_factory, data_dir) -> tuple:
    """(step directory, next step, training loss logged at that next step)."""
    if kind == "zero1":
        run = zero1_run(tmp_path_factory, data_dir)
        return run["step2"], 3, run["losses"][3]
    if kind == "zero3":
        run = zero3_run(tmp_path_factory, data_dir)
        return run["step4"], 5, run["losses"][5]
    run = pipeline_run(tmp_path_factory, data_dir)
    return run["step2"], 3, run["losses"][3]


@pytest.mark.parametrize("kind", ["zero1", "zero3", "pipeline"])
def test_export_hf_reproduces_the_training_loss(kind, tmp_path_factory, tmp_path, data_dir):
    from transformers import AutoModelForCausalLM

    tag, step, logged = _run(kind, tmp_path_factory, data_dir)
    out = tmp_path / "hf"
    assert _cli(["export", "hf", str(tag), "--out", str(out), "--dtype", "fp32", "--max-shard-size", "2MB",
                 "--work-dir", str(tmp_path)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # sharded
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in index  # per-expert on-disk layout
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert abs(_training_loss(model, data_dir, step) - logged) < 1e-5


@pytest.mark.parametrize("kind", ["zero1", "pipeline"])
def test_export_hf_reads_zero0_model_files(kind, tmp_path_factory, tmp_path, data_dir):
    """ZeRO-0 has no optimizer shards: the weights come from the model-states file, or the per-layer files of a
    pipeline. A ZeRO-1 fp32 checkpoint holds the same files with the same values; relabelled as ZeRO-0 it
    exercises that reader without another launch."""
    from transformers import AutoModelForCausalLM

    from deepseek_ds.checkpoint import META

    tag, step, logged = _run(kind, tmp_path_factory, data_dir)
    copy = shutil.copytree(tag, tmp_path / "ckpt" / tag.name)
    meta = json.loads((copy / META).read_text())
    meta["layout"]["zero_stage"] = 0
    (copy / META).write_text(json.dumps(meta))
    for optim in copy.glob("*optim_states.pt"):
        optim.unlink()  # proves they are not read
    assert _cli(["export", "hf", str(copy), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert abs(_training_loss(model, data_dir, step) - logged) < 1e-5


def test_export_hf_bf16_keeps_router_in_fp32_and_ships_the_tokenizer(tmp_path_factory, tmp_path, data_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepseek_ds.data import load_tokenizer

    tag, step, logged = _run("zero1", tmp_path_factory, data_dir)
    out = tmp_path / "hf"
    assert _cli(["export", "hf", str(tag.parent), "--out", str(out), "--work-dir", str(tmp_path)]) == 0  # bf16 default
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["model.embed_tokens.weight"] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "F32"
    text = "def resume(self, step):\n    return step + 1\n"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == load_tokenizer(data_dir)(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert abs(_training_loss(model, data_dir, step) - logged) < 0.05


def test_torchscript_of_an_moe_checkpoint(tmp_path_factory, tmp_path, data_dir):
    """From a training checkpoint (routing traced with the batched_mm experts), against its HF export."""
    from transformers import AutoModelForCausalLM

    tag, _, _ = _run("zero1", tmp_path_factory, data_dir)
    assert _cli(["export", "hf", str(tag), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    _check_traced_exports(str(tag), reference, tmp_path, ["torchscript"])


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-dense"])
def test_torchscript_and_onnx(preset, tmp_path):
    model = _random_hf_model(preset, tmp_path / "hf")
    _check_traced_exports(str(tmp_path / "hf"), model, tmp_path, ["torchscript", "onnx"])


def _random_hf_model(preset: str, out):
    """A 2-layer model of the preset's architecture (tiny-v3: one dense, one MoE layer) saved as an HF directory.
    Routers get large weights and a non-zero correction bias so that no token sits on a near-tie between two
    experts, where rounding differences between runtimes would legitimately pick another expert."""
    from transformers import AutoModelForCausalLM

    from deepseek_ds.models.presets import build_model_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_model_config(preset, overrides={"num_hidden_layers": 2})).eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("mlp.gate.weight"):
                t.normal_(0, 1.0)
            elif name.endswith("e_score_correction_bias"):
                t.normal_(0, 0.1)
    model.save_pretrained(out)
    return model


def _check_traced_exports(source: str, reference, tmp_path, formats: list[str]) -> None:
    """Export through the CLI (which checks itself), then compare with `reference` ourselves on a fresh shape."""
    import onnxruntime

    ids = torch.randint(0, reference.config.vocab_size, (4, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=ids).logits.numpy()
    for fmt in formats:
        out = tmp_path / f"model.{'pt' if fmt == 'torchscript' else 'onnx'}"
        assert _cli(["export", fmt, source, "--out", str(out), "--work-dir", str(tmp_path)]) == 0
        if fmt == "torchscript":
            with torch.no_grad():
                got = torch.jit.load(str(out))(ids).numpy()
        else:
            session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
            got = session.run(None, {"input_ids": ids.numpy()})[0]
        assert np.abs(got - want).max() < 1e-4, fmt
