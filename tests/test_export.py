"""Exports from the checkpoints of the runs tests/test_checkpoint.py resumes (ZeRO-1, ZeRO-3, PP=2; conftest.py):
the HF directory gives the loss the training run logged for the next step; TorchScript and ONNX reproduce PyTorch's
logits on new shapes for an MoE (tiny-v3) and a dense (tiny-dense) model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import cli, fresh_ckpt_dir, training_loss


def _run(kind: str, request, dest: Path) -> tuple:
    """(step directory, next step, training loss logged at that next step) of conftest.py's run `kind`; only the
    runs a selected test needs are launched. The step is a copy in `dest`: an export keeps its universal conversion
    beside the step, which the session's other users of the run must not find there."""
    run = request.getfixturevalue(kind)
    tag, step = (run["step4"], 5) if kind == "zero3" else (run["step2"], 3)
    return fresh_ckpt_dir(tag, dest / "ckpt") / tag.name, step, run["losses"][step]


@pytest.mark.launch
@pytest.mark.parametrize("kind", ["zero1", "zero3", "pipeline"])
def test_export_hf_reproduces_the_training_loss(kind, request, tmp_path, data_dir):
    from transformers import AutoModelForCausalLM

    tag, step, logged = _run(kind, request, tmp_path)
    out = tmp_path / "hf"
    assert cli(["export", "hf", str(tag), "--out", str(out), "--dtype", "fp32", "--max-shard-size", "2MB",
                "--work-dir", str(tmp_path)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # sharded
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in index  # per-expert on-disk layout
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert abs(training_loss(model, data_dir, step) - logged) < 1e-5
    _check_kv_cache(out, model)


def _check_kv_cache(out: Path, model) -> None:
    """Training turns the KV cache off; an export turns it back on, and generating with it gives the same ids."""
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text())["use_cache"] is True, name
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=6, do_sample=False)  # use_cache from the exported config
        recomputed = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, recomputed)


@pytest.mark.launch
@pytest.mark.parametrize("kind", ["zero1", "pipeline"])
def test_export_hf_reads_zero0_model_files(kind, request, tmp_path, data_dir):
    """ZeRO-0 has no optimizer shards: the weights come from the model-states file, or the per-layer files of a
    pipeline. A ZeRO-1 fp32 checkpoint holds the same files with the same values; relabelled as ZeRO-0 it
    exercises that reader without another launch."""
    from transformers import AutoModelForCausalLM

    from deepseek_ds.checkpoint import META

    tag, step, logged = _run(kind, request, tmp_path)
    copy = tag  # _run's own copy: ours to relabel
    meta = json.loads((copy / META).read_text())
    meta["layout"]["zero_stage"] = 0
    (copy / META).write_text(json.dumps(meta))
    for optim in copy.glob("*optim_states.pt"):
        optim.unlink()  # proves they are not read
    assert cli(["export", "hf", str(copy), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert abs(training_loss(model, data_dir, step) - logged) < 1e-5


@pytest.mark.launch
def test_export_hf_bf16_keeps_router_in_fp32_and_ships_the_tokenizer(request, tmp_path, data_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepseek_ds.data import load_tokenizer

    tag, step, logged = _run("zero1", request, tmp_path)
    out = tmp_path / "hf"
    assert cli(["export", "hf", str(tag.parent), "--out", str(out), "--work-dir", str(tmp_path)]) == 0  # bf16 default
    # Every exported file readable by all, the weights as much as their siblings (save_pretrained leaves 0600).
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {p.name: "0o644" for p in out.iterdir()}
    text = "def resume(self, step):\n    return step + 1\n"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == load_tokenizer(data_dir)(text)["input_ids"]
    # The weights: the fp32 export's, each rounded to bf16 once (round to nearest even, torch's cast), the routers'
    # weight and correction bias kept in fp32 as they are (transformers keeps them so: routing is sensitive).
    assert cli(["export", "hf", str(tag.parent), "--out", str(tmp_path / "fp32"), "--dtype", "fp32"]) == 0
    bf16, fp32 = _safetensors(out), _safetensors(tmp_path / "fp32")
    assert set(bf16) == set(fp32) and all(t.dtype == torch.float32 for t in fp32.values())
    kept = {name for name, t in bf16.items() if t.dtype == torch.float32}
    assert kept == {n for n in fp32 if n.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))} != set()
    for name, t in bf16.items():
        assert torch.equal(t, fp32[name] if name in kept else fp32[name].to(torch.bfloat16)), name
    # The loss, against the fp32 run's logged one at step 3 (7.5856): rounding the weights alone moves it +2.4e-4 (the
    # bf16 export read in fp32), computing in bf16 too +3.6e-4, measured. Rounding w to bf16 moves it by at most
    # 2^-9 sum|w dL/dw| = 0.025 to first order (3.5e-5 rms for independent rounding errors; routing and second-order
    # terms add the rest). 1e-3 leaves room for another CPU's bf16 kernels; the weights are checked exactly above.
    d_bf16 = training_loss(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval(), data_dir, step) - logged
    d_rounded = training_loss(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), data_dir, step) - logged
    print(f"bf16 export: loss {logged:.6f} logged, {d_bf16:+.6f} in bf16, {d_rounded:+.6f} fp32 of the rounded weights")
    assert abs(d_rounded) < 1e-3 and abs(d_bf16) < 1e-3


def _safetensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files (one file or shards), as stored."""
    from safetensors.torch import load_file

    return {name: t for path in sorted(directory.glob("*.safetensors")) for name, t in load_file(path).items()}


@pytest.mark.launch
def test_torchscript_of_an_moe_checkpoint(request, tmp_path, data_dir):
    """From a training checkpoint (routing traced with the batched_mm experts), against its HF export."""
    from transformers import AutoModelForCausalLM

    tag, _, _ = _run("zero1", request, tmp_path)
    assert cli(["export", "hf", str(tag), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    _check_traced_exports(str(tag), reference, tmp_path, ["torchscript"])


@pytest.mark.unit
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
        assert cli(["export", fmt, source, "--out", str(out), "--work-dir", str(tmp_path)]) == 0
        if fmt == "torchscript":
            with torch.no_grad():
                got = torch.jit.load(str(out))(ids).numpy()
        else:
            session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
            got = session.run(None, {"input_ids": ids.numpy()})[0]
        assert np.abs(got - want).max() < 1e-4, fmt
