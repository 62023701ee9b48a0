"""DeepSeek-V4 weights in and out of HF directories, in one process: a directory as transformers' save_pretrained
writes it and one under the published checkpoint's names load into our layers as transformers' from_pretrained
loads them (logits, every tensor, the hash tables bit for bit); the release's FP8 (ue8m0 scales) and MXFP4 experts
dequantize as transformers' own Fp8Dequantize does, bit for bit; what `export hf` writes of our layers
(write_hf_dir, its last step) loads in transformers as deepseek_v4 with our logits."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from deepseek_ds.inference.export import write_hf_dir
from deepseek_ds.models.fp8 import BlockFP8, QuantizationError, quantization_of
from deepseek_ds.models.hf_io import WeightsMismatchError, hf_state_dict, load_hf_weights, to_hf_model
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config

pytestmark = pytest.mark.unit

E4M3_MAX, BLOCK = 448.0, [32, 32]


def _config(path=None):
    """tiny-v4 (12 experts: merged in numeric order, not by name, experts.10 after experts.9), or a directory's."""
    if path:
        return prepare_config(build_model_config(None, str(path)), "eager")
    return prepare_config(build_model_config("tiny-v4", None, {"n_routed_experts": 12}), "eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny V4 model of ours (hash tables drawn, not zero) as transformers' save_pretrained writes it."""
    config = _config()
    source = build_model(config, 1, seed=7)
    hf = v4.DeepseekV4ForCausalLM(config)
    hf.load_state_dict({k: v.detach().clone() for k, v in hf_state_dict(local_layers(source)).items()}, strict=False)
    out = tmp_path_factory.mktemp("v4") / "saved"
    hf.save_pretrained(out)
    return out


def _reference(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32, **kwargs).eval()


def _assert_loads_as_transformers(path, reference) -> None:
    """Our layers (initialised from another seed) loaded from `path` hold transformers' tensors, bit for bit, and
    compute its logits."""
    config = _config(path)
    ours = build_model(config, 1, seed=3).eval()
    load_hf_weights(local_layers(ours), str(path), config)
    expected = reference.state_dict()
    loaded = hf_state_dict(local_layers(ours))
    assert set(loaded) == {k for k in expected if not k.endswith("inv_freq")}
    for name, tensor in loaded.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    tables = [n for n in loaded if n.endswith("tid2eid")]
    assert tables and all(loaded[n].any() for n in tables)  # drawn tables, not transformers' zeros
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_a_save_pretrained_directory_loads_as_transformers_loads_it(saved):
    _assert_loads_as_transformers(saved, _reference(saved))


def _published(tensors: dict) -> dict:
    """save_pretrained's names as the published DeepSeek-V4 checkpoint has them (no `model.` prefix, `embed`,
    `hc_head_fn`; transformers' reverse mapping leaves these anchored names in memory form), plus an MTP module
    tensor (`mtp.0.*`), which transformers' model skips."""
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.").replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")
        out[name] = t
    out["mtp.0.attn_norm.weight"] = torch.ones(tensors["model.norm.weight"].shape)
    return out


def test_the_published_names_load_as_transformers_loads_them(saved, tmp_path):
    published = _published(load_file(saved / "model.safetensors"))
    assert "layers.1.attn.wq_a.weight" in published and "layers.1.ffn.experts.11.w3.weight" in published
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    save_file(published, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _assert_loads_as_transformers(tmp_path, _reference(tmp_path))
    # One for one still: a tensor that maps to no parameter is refused.
    published["layers.1.attn.wq_c.weight"] = published["layers.1.attn.wq_a.weight"].clone()
    save_file(published, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = _config(tmp_path)
    with pytest.raises(WeightsMismatchError, match="wq_c"):
        load_hf_weights(local_layers(build_model(config, 1, seed=3)), str(tmp_path), config)


# ------------------------------------------------------------------------------------------ the released FP8 / MXFP4
def _ue8m0(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Power-of-two multipliers (rounded up, as DeepSeek's ue8m0 quantizer does), as float8_e8m0fnu."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / top))).to(torch.float8_e8m0fnu)


def quantize_fp8(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = block
    blocks = w.reshape(w.shape[0] // r, r, w.shape[1] // c, c)
    scale = _ue8m0(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)
    q = (blocks / scale.float()[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
    return q, scale


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 as V4's routed experts are stored: e2m1 codes, two per int8 byte (low nibble first), a ue8m0
    multiplier per 32 values of a row."""
    blocks = w.reshape(w.shape[0], -1, 32)
    scale = _ue8m0(blocks.abs().amax(-1), 6.0)
    x = (blocks / scale.float()[..., None]).reshape(w.shape)
    code = (x.abs()[..., None] - E2M1).abs().argmin(-1) | ((x < 0).long() << 3)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale


@pytest.mark.parametrize("kind", ["fp8", "mxfp4", "mxfp4-as-float4"])
@pytest.mark.parametrize("scales", ["e8m0", "uint8", "float"])
def test_released_layouts_dequantize_as_transformers(kind, scales):
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 0.02
    q, scale = quantize_fp8(w) if kind == "fp8" else quantize_mxfp4(w)
    if kind == "mxfp4-as-float4":  # the same bytes under torch's packed FP4 dtype
        q = q.view(torch.float4_e2m1fn_x2)
    if scales == "uint8":  # the exponent bytes as some checkpoints store them
        scale = scale.view(torch.uint8)
    elif scales == "float":
        scale = scale.float()
    fmt = {"quant_method": "fp8", "weight_block_size": BLOCK, "scale_fmt": "float" if scales == "float" else "ue8m0",
           "expert_dtype": "fp8" if kind == "fp8" else "fp4"}
    for dtype in (torch.float32, torch.bfloat16):
        ours = quantization_of({"quantization_config": fmt}, "config.json").dequantize("w", q, scale, dtype)
        theirs = Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=dtype)
        assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)
    assert (ours.float() - w).abs().max() < 0.25 * w.abs().max()  # a quantization of w, not noise


def test_unknown_release_formats_are_refused():
    for key, value in (("scale_fmt", "e5m2"), ("expert_dtype", "int4")):
        with pytest.raises(QuantizationError, match=key):
            quantization_of({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                     key: value}}, "config.json")
    with pytest.raises(QuantizationError, match="uint8"):
        BlockFP8((32, 32)).dequantize("w", *quantize_fp8(torch.randn(32, 32))[:1],
                                      torch.ones(1, 1, dtype=torch.uint8), torch.float32)


def test_a_released_v4_directory_dequantizes_as_transformers(saved, tmp_path):
    """The published layout: FP8 decoder weights with ue8m0 `.scale`s, MXFP4 routed experts, bf16/fp32 the rest.
    The reference is transformers' from_pretrained of the same directory with FineGrainedFP8Config(dequantize=True)."""
    quantized = {}
    for name, t in _published(load_file(saved / "model.safetensors")).items():
        fits = t.dim() == 2 and t.shape[0] % 32 == 0 and t.shape[1] % 32 == 0
        if name.startswith("layers.") and name.endswith(".weight") and fits and ".gate." not in name:
            q, s = quantize_mxfp4(t) if ".experts." in name else quantize_fp8(t)
            quantized[name], quantized[name.removesuffix(".weight") + ".scale"] = q, s
        else:
            quantized[name] = t
    assert {t.dtype for t in quantized.values()} >= {torch.int8, torch.float8_e4m3fn, torch.float8_e8m0fnu}
    fmt = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK, "scale_fmt": "ue8m0",
           "expert_dtype": "fp4", "activation_scheme": "dynamic"}
    config = dict(json.loads((saved / "config.json").read_text()), quantization_config=fmt)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(quantized, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = _reference(tmp_path, quantization_config=FineGrainedFP8Config(dequantize=True))
    assert not torch.equal(reference.model.layers[1].self_attn.q_a_proj.weight,
                           load_file(saved / "model.safetensors")["model.layers.1.attn.wq_a.weight"])  # dequantized
    _assert_loads_as_transformers(tmp_path, reference)


def test_export_writes_what_transformers_loads(saved, tmp_path, deepseek_tokenizer_dir):
    """write_hf_dir (the end of `export hf`) of our layers: transformers loads it as deepseek_v4 with our logits, its
    tensors named and shaped as save_pretrained writes them, the hash tables bit for bit."""
    config = _config(saved)
    ours = build_model(config, 1, seed=3).eval()
    load_hf_weights(local_layers(ours), str(saved), config)
    model = to_hf_model(local_layers(ours), config)
    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)
    write_hf_dir(model, local_layers(ours), config, tok, str(tmp_path), dtype="fp32")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "deepseek_v4"
    written, expected = load_file(tmp_path / "model.safetensors"), load_file(saved / "model.safetensors")
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in expected.items()}
    for name in (n for n in written if n.endswith("tid2eid")):
        assert written[name].dtype == expected[name].dtype and torch.equal(written[name], expected[name])
    exported = _reference(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, ours(ids), rtol=0, atol=1e-6)
