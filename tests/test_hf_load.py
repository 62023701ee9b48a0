"""Loading HF directories as DeepSeek publishes them: FP8 weights in 128 x 128 (here also 16 x 16) blocks with
their `weight_scale_inv`, a strict tensor <-> parameter mapping, and the released config.json files unedited.

The FP8 directories are written here from a transformers model: its 2-D decoder weights (the router aside, as in
the release) quantized block by block with their own loop, shapes chosen so that edge blocks are partial. The
reference is transformers' loss of a copy dequantized by the loop below, independently of deepseek_ds.models.fp8.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import checkpoint_sets, cli, losses, train, training_loss

FIXTURES = Path(__file__).parent / "fixtures"
# tiny-v3 with 2 layers (one dense, one MoE) and sizes that are not multiples of 16: every FP8 weight has partial
# edge blocks.
SHAPE = dict(num_hidden_layers=2, hidden_size=120, intermediate_size=100, moe_intermediate_size=40, q_lora_rank=56,
             kv_lora_rank=24)
E4M3_MAX = 448.0


def _quantized_names(tensors: dict) -> list[str]:
    """The tensors DeepSeek-V3's release stores in FP8: 2-D decoder-layer weights except the router's."""
    return sorted(n for n, t in tensors.items() if n.startswith("model.layers.") and t.dim() == 2
                  and not n.endswith("mlp.gate.weight"))


def _blocks(shape, block):
    rows, cols = block
    for bi, i in enumerate(range(0, shape[0], rows)):
        for bj, j in enumerate(range(0, shape[1], cols)):
            yield bi, bj, slice(i, i + rows), slice(j, j + cols)


def quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
    for bi, bj, r, c in _blocks(w.shape, block):
        scale = w[r, c].abs().max().clamp(min=1e-12) / E4M3_MAX
        q[r, c] = (w[r, c] / scale).to(torch.float8_e4m3fn)
        scale_inv[bi, bj] = scale
    return q, scale_inv


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    w = torch.empty(q.shape)
    for bi, bj, r, c in _blocks(q.shape, block):
        w[r, c] = q[r, c].float() * scale_inv[bi, bj]
    return w


def _save_dir(out: Path, tensors: dict, config: dict, shards: dict[str, str] | None = None) -> Path:
    """config.json plus the tensors: one model.safetensors, or the files `shards` assigns them with an index."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    if shards is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    for fname in set(shards.values()):
        save_file({k: v for k, v in tensors.items() if shards[k] == fname}, str(out / fname), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return out


def write_fp8_dirs(root: Path, block: list[int], seed: int = 0, preset: str = "tiny-v3") -> dict[str, Path]:
    """{'fp8': the release layout (scales in a shard of their own), 'dequantized': the reference copy,
    'cast': the FP8 values cast without their scales (what loading did before)}; DeepSeek-V3.2's (preset tiny-v32)
    quantizes its indexers' projections too."""
    from transformers import AutoModelForCausalLM

    from deepseek_ds.models.presets import build_model_config

    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(build_model_config(preset, overrides=SHAPE))
    ref.save_pretrained(root / "plain")
    config = json.loads((root / "plain" / "config.json").read_text())
    plain = load_file(str(root / "plain" / "model.safetensors"))
    fp8, dequantized, cast = dict(plain), dict(plain), dict(plain)
    for name in _quantized_names(plain):
        q, s = quantize(plain[name], block)
        fp8[name], fp8[name + "_scale_inv"] = q, s
        dequantized[name], cast[name] = dequantize(q, s, block), q.float()
    shards = {k: "model-scales.safetensors" if k.endswith("_scale_inv") else "model-weights.safetensors" for k in fp8}
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": block}
    return {"fp8": _save_dir(root / "fp8", fp8, {**config, "quantization_config": quant}, shards),
            "dequantized": _save_dir(root / "dequantized", dequantized, config),
            "cast": _save_dir(root / "cast", cast, config)}


def _ours(hf_dir, stages: int = 1):
    """(our model config, every pipeline layer) loaded from hf_dir stage by stage, and the bytes each stage read."""
    from deepseek_ds.models.hf_io import load_hf_weights
    from deepseek_ds.models.pipeline import layer_specs, partition, prepare_config
    from deepseek_ds.models.presets import build_model_config

    mcfg = prepare_config(build_model_config(path=str(hf_dir)))
    specs, parts = layer_specs(mcfg, seed=None), partition(mcfg, stages)
    layers, reads = [], []
    for stage in range(stages):
        stage_layers = [s.build() for s in specs[parts[stage]:parts[stage + 1]]]
        reads.append(load_hf_weights(stage_layers, str(hf_dir), mcfg))
        layers += stage_layers
    return mcfg, layers, reads


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


def _hf_loss(hf_dir, ids) -> float:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=ids, labels=ids).loss.item()


def _tensor_bytes(hf_dir: Path) -> int:
    total = 0
    for f in hf_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(st.get_tensor(k).nbytes for k in st.keys())
    return total


@pytest.mark.unit
@pytest.mark.parametrize("block,preset", [([16, 32], "tiny-v3"), ([128, 128], "tiny-v3"), ([16, 32], "tiny-v32")])
def test_fp8_weights_load_dequantized_and_export_without_quantization(block, preset, tmp_path):
    """Our loss on a batch equals transformers' on the independently dequantized copy and not the scale-less cast;
    each of 2 pipeline stages reads only its share (FP8 values and scales); the config holds no quantization_config
    and what we write from the loaded model loads in transformers with our logits."""
    from transformers import AutoModelForCausalLM

    from deepseek_ds.models.hf_io import to_hf_model

    dirs = write_fp8_dirs(tmp_path, block, preset=preset)
    mcfg, layers, reads = _ours(dirs["fp8"], stages=2)
    assert mcfg.model_type == {"tiny-v3": "deepseek_v3", "tiny-v32": "deepseek_v32"}[preset]
    ids = torch.randint(0, mcfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = ids
        for layer in layers:  # the pipeline in one process (no tied layers in this model)
            logits = layer.eval()(logits)
    ours, want, cast = _lm_loss(logits, ids), _hf_loss(dirs["dequantized"], ids), _hf_loss(dirs["cast"], ids)
    assert abs(ours - want) <= 1e-5 * want
    assert abs(cast - want) > 1e-5 * want
    assert sum(reads) == _tensor_bytes(dirs["fp8"]) and max(reads) < 0.8 * sum(reads)

    assert "quantization_config" not in mcfg.to_dict()
    to_hf_model(layers, mcfg).save_pretrained(tmp_path / "export")
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids).logits, logits, atol=1e-5)


@pytest.mark.launch
def test_training_starts_from_the_dequantized_weights_and_exports_them(tmp_path, data_dir):
    """deepseek-ds training on 2 pipeline stages, each dequantizing its own layers of an FP8 directory: the first
    logged loss is transformers' loss of the dequantized copy on that batch; `export hf` of the step-1 checkpoint has
    no quantization_config, loads in transformers and gives the loss logged at step 2."""
    from transformers import AutoModelForCausalLM

    dirs = write_fp8_dirs(tmp_path, [128, 128])
    out = tmp_path / "run"
    logged = losses(train(2, str(out), checkpoint_sets(data_dir, 2, 1, f"model.path={dirs['fp8']}", "model.preset=null",
                                                       "parallel.pipeline_stages=2"), "ds_configs/zero1_pp.json"))
    dequantized = AutoModelForCausalLM.from_pretrained(dirs["dequantized"]).eval()
    assert abs(training_loss(dequantized, data_dir, 1) - logged[1]) < 1e-5
    export = tmp_path / "hf"
    assert cli(["export", "hf", str(out / "checkpoints" / "step00000001"), "--out", str(export), "--dtype", "fp32",
                "--work-dir", str(tmp_path)]) == 0
    assert "quantization_config" not in json.loads((export / "config.json").read_text())
    exported = AutoModelForCausalLM.from_pretrained(export).eval()
    assert abs(training_loss(exported, data_dir, 2) - logged[2]) < 1e-5


def _edited(src: Path, dest: Path, tensors=None, config=None) -> Path:
    """A copy of the single-file directory src with its tensors and/or config.json replaced by the edits' results."""
    shutil.copytree(src, dest)
    if tensors is not None:
        save_file(tensors(load_file(str(src / "model.safetensors"))), str(dest / "model.safetensors"))
    if config is not None:
        (dest / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    return dest


def _load(hf_dir: Path, stage: int | None = None) -> list[int]:
    """Load hf_dir into all layers of its model, or into the layers of one of 2 pipeline stages; their layer_idx."""
    from deepseek_ds.models.hf_io import load_hf_weights
    from deepseek_ds.models.pipeline import layer_specs, partition, prepare_config
    from deepseek_ds.models.presets import build_model_config

    mcfg = prepare_config(build_model_config(path=str(hf_dir)))
    specs = layer_specs(mcfg, seed=None)
    if stage is not None:
        parts = partition(mcfg, 2)
        specs = specs[parts[stage]:parts[stage + 1]]
    layers = [s.build() for s in specs]
    load_hf_weights(layers, str(hf_dir), mcfg)
    return [layer.layer_idx for layer in layers if hasattr(layer, "layer_idx")]


def _refused(hf_dir: Path, match: str, stage: int | None = None) -> None:
    from deepseek_ds.utils.errors import UserError

    with pytest.raises(UserError, match=match):
        _load(hf_dir, stage)


@pytest.mark.unit
def test_every_tensor_maps_to_a_parameter_and_back(tmp_path):
    from transformers import AutoModelForCausalLM

    from deepseek_ds.models.presets import build_model_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_model_config("tiny-v3", overrides=SHAPE)).save_pretrained(tmp_path / "ok")
    ok = tmp_path / "ok"
    assert _load(ok) == [0, 1]  # loads as saved

    def drop(name):
        return lambda t: {k: v for k, v in t.items() if k != name}

    def add(name):
        return lambda t: {**t, name: torch.zeros(3)}

    # A tensor the model has no parameter for, in a layer this rank holds: named with its file.
    extra = _edited(ok, tmp_path / "extra", add("model.layers.1.mlp.extra_proj.weight"))
    _refused(extra, r"map to no parameter.*1: model\.layers\.1\.mlp\.extra_proj\.weight \(model\.safetensors\)")
    # In another stage's layer it is that stage's business; outside every layer it is refused on every rank.
    assert _load(extra, stage=0) == [0]
    _refused(extra, r"model\.layers\.1\.mlp\.extra_proj\.weight", stage=1)
    stranger = _edited(ok, tmp_path / "stranger", add("model.vision_tower.proj.weight"))
    for stage in (0, 1):
        _refused(stranger, r"model\.vision_tower\.proj\.weight", stage)
    # A parameter (here one expert's projection) with no tensor: named.
    missing = _edited(ok, tmp_path / "missing", drop("model.layers.1.mlp.experts.3.up_proj.weight"))
    _refused(missing, r"no tensor in model\.safetensors, 1: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight")
    # FP8 scales without a quantization_config; an FP8 weight without its scale.
    scaled = _edited(ok, tmp_path / "scaled", lambda t: {**t, "model.layers.0.mlp.up_proj.weight_scale_inv":
                                                         torch.ones(7, 8)})
    _refused(scaled, r"weight_scale_inv.*config\.json has no quantization_config")
    quant = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    unscaled = _edited(ok, tmp_path / "unscaled",
                       lambda t: {**t, "model.layers.0.mlp.up_proj.weight":
                                  t["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)},
                       lambda c: {**c, "quantization_config": quant})
    _refused(unscaled, r"up_proj\.weight is stored as torch\.float8_e4m3fn without its .*weight_scale_inv")


@pytest.mark.unit
def test_unused_mtp_module_is_the_one_documented_skip(tmp_path):
    """A published MTP module (model.layers.{num_hidden_layers}.*, with eh_proj) beyond the model's
    num_nextn_predict_layers is not loaded, as in transformers; a stray decoder layer without eh_proj is refused."""
    from transformers import AutoModelForCausalLM

    from deepseek_ds.models.presets import build_model_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_model_config("tiny-v3", overrides=SHAPE)).save_pretrained(tmp_path / "ok")
    n = SHAPE["num_hidden_layers"]
    mtp = _edited(tmp_path / "ok", tmp_path / "mtp", lambda t: {**t, f"model.layers.{n}.eh_proj.weight": torch.zeros(2),
                                                                  f"model.layers.{n}.enorm.weight": torch.zeros(2)})
    assert _load(mtp) == [0, 1]
    stray = _edited(tmp_path / "ok", tmp_path / "stray", lambda t: {**t, f"model.layers.{n}.enorm.weight": torch.zeros(2)})
    _refused(stray, rf"model\.layers\.{n}\.enorm\.weight")


@pytest.mark.unit
def test_other_quantization_methods_are_refused(tmp_path):
    from deepseek_ds.models.presets import build_model_config
    from deepseek_ds.utils.errors import UserError

    published = json.loads((FIXTURES / "deepseek-v3-config.json").read_text())
    for quant, match in [({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method is 'bitsandbytes'"),
                         ({**published["quantization_config"], "fmt": "e5m2"}, r"fmt is 'e5m2'"),
                         ({**published["quantization_config"], "activation_scheme": "static"}, r"'static'"),
                         ({**published["quantization_config"], "weight_block_size": [128]}, r"weight_block_size")]:
        d = tmp_path / match.strip("r'\\").replace(" ", "_")[:20]
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**published, "quantization_config": quant}))
        with pytest.raises(UserError, match=match):
            build_model_config(path=str(d))


@pytest.mark.unit
@pytest.mark.parametrize("fixture, preset", [("deepseek-v3-config.json", "deepseek-v3"),
                                             ("deepseek-v2-lite-config.json", "deepseek-v2-lite")])
def test_published_config_files_load_unedited(fixture, preset, tmp_path):
    """The released config.json (auto_map, rope_scaling type yarn, V3's quantization_config) gives our preset of that
    model, and, shrunk with model.overrides, a model that runs on yarn rotary tables."""
    from deepseek_ds.models.pipeline import SequentialLM, build_model, prepare_config
    from deepseek_ds.models.presets import PRESETS, build_model_config

    shutil.copy(FIXTURES / fixture, tmp_path / "config.json")
    published = json.loads((tmp_path / "config.json").read_text())
    assert "auto_map" in published and published["rope_scaling"]["type"] == "yarn"
    cfg = build_model_config(path=str(tmp_path))
    want = build_model_config(preset)
    assert type(cfg) is type(want) and "quantization_config" not in cfg.to_dict()
    for field in PRESETS[preset].fields:
        got, expected = getattr(cfg, field), getattr(want, field)
        if field == "rope_parameters":
            got, expected = ({k: float(v) for k, v in d.items() if k not in ("rope_type", "type")}
                             for d in (got, expected))
        assert got == expected, field
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 40
    small = prepare_config(build_model_config(path=str(tmp_path), overrides=dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, vocab_size=256,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
        **({"q_lora_rank": 24} if cfg.q_lora_rank else {}))))
    model = build_model(small, 1, seed=0)
    assert isinstance(model, SequentialLM)
    with torch.no_grad():
        assert torch.isfinite(model.eval()(torch.randint(0, 256, (1, 9)))).all()


@pytest.mark.unit
def test_published_r1_distill_qwen_config_loads_unedited(tmp_path):
    """DeepSeek-R1-Distill-Qwen-1.5B's released config.json (model_type qwen2, rope_theta at the top level,
    sliding_window 4096 with use_sliding_window false) gives our preset of it, and, shrunk with model.overrides, a
    model with transformers' Qwen2 layers (q/k/v biases) that runs."""
    from deepseek_ds.models.pipeline import build_model, prepare_config
    from deepseek_ds.models.presets import PRESETS, build_model_config

    shutil.copy(FIXTURES / "deepseek-r1-distill-qwen-1.5b-config.json", tmp_path / "config.json")
    cfg = build_model_config(path=str(tmp_path))
    want = build_model_config("deepseek-r1-distill-qwen-1.5b")
    assert type(cfg) is type(want) and cfg.model_type == "qwen2"
    for field in PRESETS["deepseek-r1-distill-qwen-1.5b"].fields:
        got, expected = getattr(cfg, field), getattr(want, field)
        if field == "rope_parameters":
            got, expected = got["rope_theta"], expected["rope_theta"]
        assert got == expected, field
    assert cfg.rope_parameters["rope_theta"] == 10000 and set(cfg.layer_types) == {"full_attention"}
    small = prepare_config(build_model_config(path=str(tmp_path), overrides=dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256)))
    model = build_model(small, 1, seed=0)
    assert {n.rsplit(".", 2)[-2] for n, _ in model.named_parameters() if n.endswith(".bias")} == \
        {"q_proj", "k_proj", "v_proj"}
    with torch.no_grad():
        assert torch.isfinite(model.eval()(torch.randint(0, 256, (1, 9)))).all()
