"""Muon (DeepSpeed's `"optimizer": {"type": "Muon"}`, ds_configs/zero*_muon.json): the rule of models/muon.py on the
models, its refusals, and training through the real launcher: tiny-v3 (MoE) gives the same losses and gradient
norms on 1 rank and on 2 ranks under every layout Muon serves (ZeRO 1-3, PP, EP), with and without gradient
clipping, and tiny-dense follows a single-process torch.optim.Muon + AdamW reference (tests/reference_muon.py, the
gradients clipped before either optimizer) with Newton-Schulz in fp32; `plan` predicts the bytes each rank's engine
holds."""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest
import torch

from deepseek_ds.config import ConfigError, filled_sections, load_and_validate, load_ds_config, load_run_config
from deepseek_ds.models.muon import RULE, deepspeed_muon_config, muon_split, ns_in_fp32, per_head, tag_muon
from deepseek_ds.models.pipeline import build_model, prepare_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.plan.estimate import element_bytes, estimate, layout_of, zero_settings
from deepseek_ds.plan.params import SpecParams, rank_params
from deepseek_ds.plan.states import state_bytes
from deepseek_ds.utils.private_optimizer import MuonBlocks, muon_update_in_blocks
from helpers import _rank_server, read_metrics, train_layouts
from reference_muon import fp32_newton_schulz, muon_reference_run

STEPS = 4
MUON_LR = 0.02  # ds_configs/zero*_muon.json's muon_lr
# test_equivalence's settings (seed 7 and Adam's eps 1e-5 keep tiny-v3's routing clear of near ties), no clipping
# unless CLIP: below every step's gradient norm here (checked), so each step is clipped, by a different factor.
SETS = [f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=64",
        "train.warmup_steps=0", "checkpoint.interval=0", "train.eps=1e-5", "train.seed=7", "train.grad_clip=0"]
CLIP_NORM = 1.0
CLIP = [f"train.grad_clip={CLIP_NORM}"]
DENSE = ["model.preset=tiny-dense"]
V4 = ["model.preset=tiny-v4", "model.attn_implementation=eager"]
EP = ["parallel.expert_parallel=2"]
PP = ["parallel.pipeline_stages=2"]
RESHARDS = [("zero1", "zero2"), ("zero3", "zero3")]  # (ZeRO stage saved by 1 rank, ZeRO stage resumed on 2 ranks)
LAYOUTS = [
    # (id, ranks, deepspeed config, extra overrides): the layouts of one rank count train in one launch.
    ("v3-1rank", 1, "ds_configs/zero1_muon.json", []),
    ("v3-1rank-clip", 1, "ds_configs/zero1_muon.json", CLIP),
    ("v3-zero2", 2, "ds_configs/zero2_muon.json", []),
    ("v3-zero3", 2, "ds_configs/zero3_muon.json", []),
    ("v3-pp2-zero1", 2, "ds_configs/zero1_pp_muon.json", PP),
    ("v3-ep2-zero1", 2, "ds_configs/zero1_muon.json", EP),
    ("v3-zero2-clip", 2, "ds_configs/zero2_muon.json", CLIP),
    ("v3-zero3-clip", 2, "ds_configs/zero3_muon.json", CLIP),
    ("v3-pp2-zero1-clip", 2, "ds_configs/zero1_pp_muon.json", PP + CLIP),
    ("v3-ep2-zero1-clip", 2, "ds_configs/zero1_muon.json", EP + CLIP),
    # Per-head Muon (optimizer.params.per_head_muon: MLA's q_b_proj and kv_b_proj a block per head): the shipped
    # configs with that key, written into the test's root.
    ("v3-1rank-per-head", 1, "{root}/zero1_muon_per_head.json", []),
    ("v3-zero1-per-head", 2, "{root}/zero1_muon_per_head.json", []),
    ("v3-zero3-per-head", 2, "{root}/zero3_muon_per_head.json", []),
    ("dense-zero1", 2, "ds_configs/zero1_muon.json", DENSE),
    ("dense-zero1-clip", 2, "ds_configs/zero1_muon.json", DENSE + CLIP),
    ("v4-zero1", 2, "ds_configs/zero1_muon.json", V4),
    # Resume: steps 1-2 saved, then a run in the same checkpoint.dir resumes at step 3 (Muon's momentum and AdamW's
    # moments from the checkpoint), against the same 4 steps uninterrupted; constant lr (min_lr = tiny-v3's lr), so
    # that the 2-step run's schedule is the 4-step run's.
    ("v3-const", 2, "ds_configs/zero1_muon.json", ["train.min_lr=3e-3"]),  # also ZeRO-1's pair in MOE
    ("v3-const-half", 2, "ds_configs/zero1_muon.json", ["train.min_lr=3e-3", "train.steps=2", "checkpoint.interval=2",
                                                         "checkpoint.dir={root}/resume-checkpoints"]),
    ("v3-const-resumed", 2, "ds_configs/zero1_muon.json", ["train.min_lr=3e-3",
                                                            "checkpoint.dir={root}/resume-checkpoints"]),
    # Resharded: 1 rank saves steps 1-2; 2 ranks resume them through a universal checkpoint (Muon's momentum
    # carried by deepseek-ds, checkpoint/muon_universal.py), against 1 rank's 4 steps uninterrupted: ZeRO-1 -> 2,
    # and ZeRO-3 -> 3.
    *[layout for saved, resumed in RESHARDS for layout in (
        (f"v3-1rank-const-{saved}", 1, f"ds_configs/{saved}_muon.json", ["train.min_lr=3e-3"]),
        (f"v3-1rank-const-half-{saved}", 1, f"ds_configs/{saved}_muon.json",
         ["train.min_lr=3e-3", "train.steps=2", "checkpoint.interval=2", f"checkpoint.dir={{root}}/reshard-{saved}"]),
        (f"v3-const-resharded-{resumed}", 2, f"ds_configs/{resumed}_muon.json",
         ["train.min_lr=3e-3", f"checkpoint.dir={{root}}/reshard-{saved}"]))],
]
# (2-rank layout, its 1-rank run). ZeRO-1 is the resume tests' pair, v3-const against v3-1rank-const-zero1: a 2-rank
# ZeRO-1 layout that differed from v3-const only in its learning-rate schedule (cosine) would add no check, the cosine
# schedule on 2 ranks being followed by each other layout here, by v3-zero1-per-head (ZeRO-1) and by dense-zero1
# (ZeRO-1, against torch's reference).
MOE = [("v3-const", "v3-1rank-const-zero1"), *((name, "v3-1rank") for name in (
    "v3-zero2", "v3-zero3", "v3-pp2-zero1", "v3-ep2-zero1"))]
MOE_CLIP = ["v3-zero2-clip", "v3-zero3-clip", "v3-pp2-zero1-clip", "v3-ep2-zero1-clip"]
PER_HEAD = ["v3-zero1-per-head", "v3-zero3-per-head"]
ZERO_RUNS = {1: "v3-const", 2: "v3-zero2", 3: "v3-zero3"}  # the 2-rank MoE run of each ZeRO stage (its lr: no byte)
RESHARDED = [f"v3-const-resharded-{resumed}" for _, resumed in RESHARDS]


def _model(preset: str, **overrides):
    return build_model(prepare_config(build_model_config(preset, None, overrides)), 1, seed=1)


# ----------------------------------------------------------------------------------------------- the rule
@pytest.mark.unit
def test_rule_splits_tiny_v3_with_mtp():
    """Every matrix of the decoder and MTP layers (experts fused 3-D, one matrix each) is Muon's; the embedding,
    the head and every 1-D parameter AdamW's."""
    split = muon_split(_model("tiny-v3", num_nextn_predict_layers=1))
    muon = {n for n, m in split.items() if m}
    assert {n for n in split if "embed_tokens" in n or "lm_head" in n or n.endswith("norm.weight")} & muon == set()
    for leaf in ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
                 "o_proj.weight", "mlp.gate_proj.weight", "experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight",
                 "shared_experts.down_proj.weight", "eh_proj.weight"):
        assert any(n.endswith(leaf) for n in muon), leaf
    assert all(len(p.shape) >= 2 for n, p in _model("tiny-v3").named_parameters() if split.get(n))


@pytest.mark.unit
def test_rule_keeps_v4_hc_head_on_adamw_where_deepspeed_would_not():
    """DeepSpeed's own tagging (any >= 2-D parameter not named embed / lm_head) would give DeepSeek-V4's 2-D hc_head
    mapping to Muon; the rule keeps everything outside the decoder layers on AdamW, and tag_muon's tags win."""
    model = _model("tiny-v4")
    hc = [p for n, p in model.named_parameters() if "hc_head" in n and p.ndim == 2]
    assert hc
    for p in model.parameters():
        p.use_muon = p.ndim >= 2  # what DeepSpeed set before
    split = tag_muon(model)
    assert not any(p.use_muon for p in hc)
    experts = [p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert experts and all(p.use_muon and p.is_expert_group == MuonBlocks(2) for p in experts)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert split.muon_matrices == sum(m for n, m in muon_split(model).items() if n in trainable)


@pytest.mark.unit
@pytest.mark.parametrize("sets,needle", [
    (["lora.r=4"], "LoRA with Muon"),
    (["parallel.tensor_parallel=2"], "Muon with tensor parallelism"),
])
def test_refusals(sets, needle):
    with pytest.raises(ConfigError, match=needle):
        load_and_validate("recipes/tiny-v3.yaml", "ds_configs/zero1_muon.json", sets, 2)


@pytest.mark.unit
def test_sparse_indexer_clipping_refused():
    """V3.2's sparse stage clips the indexers by their own norm; Muon's update is taken after the norm of all."""
    with pytest.raises(ConfigError, match="indexer.stage sparse with gradient clipping and Muon"):
        load_and_validate("recipes/tiny-v3.yaml", "ds_configs/zero1_muon.json",
                          ["model.preset=tiny-v32", "indexer.stage=sparse", "train.grad_clip=1.0"], 2)


@pytest.mark.unit
@pytest.mark.parametrize("section,value,needle", [
    ("zero_optimization", {"stage": 0}, "Muon with ZeRO stage 0"),
    ("zero_optimization", {"stage": 3}, "zero_optimization.reduce_scatter false"),
    ("zero_optimization", {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer with Muon"),
    ("zero_optimization", {"stage": 1, "compute_grad_norm": False}, "compute_grad_norm false with Muon"),
])
def test_json_refusals(tmp_path, section, value, needle):
    ds = json.loads(open("ds_configs/zero1_muon.json").read())
    ds[section] = value
    (tmp_path / "muon.json").write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match=needle):
        load_and_validate("recipes/tiny-v3.yaml", str(tmp_path / "muon.json"), [], 2)


@pytest.mark.unit
def test_fused_gate_up_is_orthogonalised_per_projection():
    """A MuonBlocks(2) tensor [E, 2I, H] takes the update DeepSpeed's Muon gives each expert's gate and up halves
    as tensors of their own (what AutoEP's w1 and w3 get under expert parallelism), momentum included; DeepSpeed's
    whole-matrix update of the fused tensor differs."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    torch.manual_seed(0)
    grad, momentum = torch.randn(3, 8, 6), torch.randn(3, 8, 6)
    halves = [(grad[:, :4].clone(), momentum[:, :4].clone()), (grad[:, 4:].clone(), momentum[:, 4:].clone())]
    fused_momentum = momentum.clone()
    update = muon_update_in_blocks(grad.clone(), fused_momentum, 0.95, is_expert_group=MuonBlocks(2))
    apart = [muon_update(g, m, 0.95, is_expert_group=True) for g, m in halves]
    assert torch.equal(update, torch.cat(apart, dim=1))
    assert torch.equal(fused_momentum, torch.cat([m for _, m in halves], dim=1))
    whole = muon_update(grad.clone(), momentum.clone(), 0.95, is_expert_group=True)
    assert not torch.allclose(whole, update, atol=1e-3)


@pytest.mark.unit
def test_per_head_blocks_equal_deepspeeds_per_head_muon():
    """MuonBlocks(heads) on a 2-D projection takes the update of DeepSpeed's own per-head Muon (muon_update with
    num_heads, which its ZeRO 1/2 padded path does not pass); per_head_muon tags MLA's q_b_proj / q_proj and
    kv_b_proj with it, and nothing else."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    torch.manual_seed(0)
    grad, momentum = torch.randn(4 * 6, 10), torch.randn(4 * 6, 10)
    ours_momentum, theirs_momentum = momentum.clone(), momentum.clone()
    ours = muon_update_in_blocks(grad.clone(), ours_momentum, 0.95, is_expert_group=MuonBlocks(4))
    theirs = muon_update(grad.clone(), theirs_momentum, 0.95, num_heads=4)
    assert torch.allclose(ours, theirs, atol=1e-6) and torch.equal(ours_momentum, theirs_momentum)
    assert not torch.allclose(ours, muon_update(grad.clone(), momentum.clone(), 0.95), atol=1e-3)
    for overrides, projections in (({}, {"q_b_proj", "kv_b_proj"}), ({"q_lora_rank": None}, {"q_proj", "kv_b_proj"})):
        model = _model("tiny-v3", **overrides)  # q_lora_rank None: queries without LoRA, as DeepSeek-V2-Lite's
        tag_muon(model, heads=7)
        blocked = {n.split(".")[-2] for n, p in model.named_parameters()
                   if getattr(p, "is_expert_group", None) == MuonBlocks(7)}
        assert blocked == projections, overrides


@pytest.mark.unit
def test_ns_precision_fp32_runs_newton_schulz_in_fp32():
    """optimizer.params.ns_precision fp32: Newton-Schulz in fp32 where DeepSpeed would pick a half precision (its
    `standard` method runs in bf16 wherever bf16 is supported, this CPU too): the update equals torch.optim.Muon's
    iteration in fp32 (tests/reference_muon.py), and DeepSpeed's own choice is off it by bf16's error."""
    from reference_muon import _newton_schulz_fp32
    torch.manual_seed(0)
    grad = torch.randn(12, 20)  # rows < cols: no aspect-ratio scale
    # Zero momentum: the Nesterov update is a multiple of the gradient, which Newton-Schulz normalises away.
    want = _newton_schulz_fp32(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    fp32 = muon_update_in_blocks(grad.clone(), torch.zeros_like(grad), 0.95, ns_method="standard", fp32=True)
    auto = muon_update_in_blocks(grad.clone(), torch.zeros_like(grad), 0.95, ns_method="standard")
    assert torch.allclose(fp32, want, atol=1e-5)
    assert (auto - want).abs().max() > 1e-3


@pytest.mark.unit
def test_deepspeed_gets_the_config_without_deepseek_ds_keys(tmp_path):
    ds = json.loads(open("ds_configs/zero1_muon.json").read())
    ds["optimizer"]["params"].update(per_head_muon=True, ns_precision="fp32")
    (tmp_path / "muon.json").write_text(json.dumps(ds))
    _, resolved = load_and_validate("recipes/tiny-v3.yaml", str(tmp_path / "muon.json"), [], 2)
    assert ns_in_fp32(resolved) and per_head(resolved)
    kept = deepspeed_muon_config(resolved)["optimizer"]["params"]
    assert "per_head_muon" not in kept and "ns_precision" not in kept and kept["muon_lr"] == 0.02
    ds["optimizer"]["params"]["ns_precision"] = "fp64"
    (tmp_path / "muon.json").write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match="optimizer.params.ns_precision = 'fp64': choose one of auto, fp32"):
        load_and_validate("recipes/tiny-v3.yaml", str(tmp_path / "muon.json"), [], 2)


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-v4"])
def test_per_head_refused_without_mla(tmp_path, preset):
    ds = json.loads(open("ds_configs/zero1_muon.json").read())
    ds["optimizer"]["params"]["per_head_muon"] = True
    (tmp_path / "muon.json").write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match="per_head_muon with model .*: per-head Muon orthogonalises MLA's"):
        load_and_validate("recipes/tiny-v3.yaml", str(tmp_path / "muon.json"), [f"model.preset={preset}"], 2)
    load_and_validate("recipes/tiny-v3.yaml", str(tmp_path / "muon.json"), [], 2)


@pytest.mark.unit
@pytest.mark.parametrize("ds_config", ["zero1_muon.json", "zero2_muon.json", "zero3_muon.json",
                                       "zero1_pp_muon.json"])
def test_shipped_configs_validate_and_state_the_rule(ds_config):
    """Each shipped Muon config validates (with the recipe's clipping), and validate's summary states the rule
    (filled_sections)."""
    sets = ["parallel.pipeline_stages=2"] if "_pp" in ds_config else []
    cfg, ds = load_and_validate("recipes/tiny-v3.yaml", f"ds_configs/{ds_config}", sets, 2)
    assert ds["optimizer"]["type"] == "Muon" and ds["gradient_clipping"] == cfg.train.grad_clip > 0
    assert filled_sections(load_ds_config(f"ds_configs/{ds_config}")) == [
        f"optimizer Muon: {RULE} (deepseek_ds/models/muon.py)"]
    assert "output head" in RULE


# ----------------------------------------------------------------------------------------------- through the launcher
class MuonRuns:
    """runs(ranks, name): a layout's metrics records; runs.output_dir(ranks, name): its train.output_dir. Each rank
    count's layouts train in one launch of tests/muon_worker.py (the real training loop), the two launches at once:
    each rank runs one thread (muon_worker.py), and the 1-rank launch takes the core its rank alone would leave idle
    while the 2-rank launch trains."""

    def __init__(self, root, sets: list[str]):
        self.root, self.sets, self.done = root, sets, {}
        for stage in (1, 3):
            ds = json.loads(open(f"ds_configs/zero{stage}_muon.json").read())
            ds["optimizer"]["params"]["per_head_muon"] = True
            (root / f"zero{stage}_muon_per_head.json").write_text(json.dumps(ds))

    def _launch(self, ranks: int, names: list[str], *worker_args: str) -> dict:
        mine = [(n, ds.format(root=self.root), [e.format(root=self.root) for e in extra])
                for n, r, ds, extra in LAYOUTS if r == ranks and n in names]
        return train_layouts(ranks, self.root, mine, self.sets, worker="tests/muon_worker.py",
                             worker_args=worker_args)

    def _train(self) -> None:
        one_rank_ended = self.root / "one-rank-launch.ended"  # "ok" or "failed", once the launch has ended

        def one_rank() -> dict:
            status = "failed"
            try:
                dirs = self._launch(1, [n for n, r, _, _ in LAYOUTS if r == 1])
                status = "ok"
            finally:
                (self.root / "ended.tmp").write_text(status)
                (self.root / "ended.tmp").replace(one_rank_ended)  # whole, or not there
            return dirs

        # The RESHARDED layouts, last of the 2-rank launch, wait for it (muon_worker.py --after): they resume checkpoints
        # that 1-rank layouts saved.
        after = json.dumps({str(self.root / name): str(one_rank_ended) for name in RESHARDED})
        _rank_server()  # the ranks' fork server, started before the threads: starting it changes os.environ a moment
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ones = pool.submit(one_rank)
            twos = pool.submit(self._launch, 2, [n for n, r, _, _ in LAYOUTS if r == 2], "--after", after)
            self.done = {1: ones.result(), 2: twos.result()}

    def output_dir(self, ranks: int, name: str):
        if not self.done:
            self._train()
        return self.done[ranks][name]

    def __call__(self, ranks: int, name: str) -> list[dict]:
        return read_metrics(str(self.output_dir(ranks, name)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir) -> MuonRuns:
    return MuonRuns(tmp_path_factory.mktemp("muon"), SETS + [f"data.path={data_dir}"])


def _losses(records: list[dict]) -> list[float]:
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


def _norms(records: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in records]


@pytest.mark.launch
@pytest.mark.parametrize("name,one_rank", MOE, ids=[name for name, _ in MOE])
def test_moe_layouts_equal_one_rank(name, one_rank, runs):
    """Losses and gradient norms (of the gradients, before Muon) equal 1 rank's; under EP each rank orthogonalises
    the whole matrices of the experts it holds, each expert's gate and up apart as on one rank."""
    one, two = runs(1, one_rank), runs(2, name)
    assert len(set(_losses(one))) == STEPS  # it trains
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5), f"{name}: {_losses(two)} vs 1 rank {_losses(one)}"
    assert _norms(two) == pytest.approx(_norms(one), rel=1e-5), name


@pytest.mark.launch
@pytest.mark.parametrize("name", MOE_CLIP)
def test_clipped_moe_layouts_equal_one_rank(name, runs):
    """With gradient clipping, every layout clips the gradient by its norm before Muon's momentum, as 1 rank does
    (DeepSpeed alone clipped the orthogonalised update under ZeRO 1-3, by its own norm: DeepSpeed #7776)."""
    one, two, unclipped = runs(1, "v3-1rank-clip"), runs(2, name), runs(1, "v3-1rank")
    assert min(_norms(one)) > CLIP_NORM and _losses(one)[1:] != _losses(unclipped)[1:]  # every step clipped
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5), f"{name}: {_losses(two)} vs 1 rank {_losses(one)}"
    assert _norms(two) == pytest.approx(_norms(one), rel=1e-5), name


@pytest.mark.launch
@pytest.mark.parametrize("name", PER_HEAD)
def test_per_head_layouts_equal_one_rank(name, runs):
    """Per-head Muon gives the same losses and norms on 2 ranks (ZeRO-1; ZeRO-3, which passes its tag another way)
    as on 1, and not those of whole-matrix Muon."""
    one, two, whole = runs(1, "v3-1rank-per-head"), runs(2, name), runs(1, "v3-1rank")
    assert _losses(one)[1:] != pytest.approx(_losses(whole)[1:], rel=1e-6)
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5), f"{name}: {_losses(two)} vs 1 rank {_losses(one)}"
    assert _norms(two) == pytest.approx(_norms(one), rel=1e-5), name


@pytest.mark.launch
@pytest.mark.parametrize("clip", [[], CLIP], ids=["unclipped", "clipped"])
def test_dense_follows_torch_muon_reference(clip, runs, data_dir):
    """Losses and pre-clip gradient norms equal torch.optim.Muon + AdamW's, whose gradients
    torch.nn.utils.clip_grad_norm_ clips before either optimizer steps."""
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + DENSE + clip + [f"data.path={data_dir}"])
    with fp32_newton_schulz():
        losses, norms = muon_reference_run(cfg, data_dir, MUON_LR)
    got = runs(2, "dense-zero1" + ("-clip" if clip else ""))
    assert len(set(losses)) == STEPS
    if clip:
        assert min(norms) > CLIP_NORM
    assert _losses(got) == pytest.approx(losses, rel=1e-5), f"{_losses(got)} vs reference {losses}"
    assert _norms(got) == pytest.approx(norms, rel=1e-5), f"{_norms(got)} vs reference {norms}"


@pytest.mark.launch
def test_engine_trains_the_rule_not_deepspeeds_tags(runs):
    """The tags DeepSpeed's Muon reads in a running engine are the rule's: on DeepSeek-V4 every matrix of the decoder
    layers and nothing else, where DeepSpeed's own tagging would also give Muon the 2-D hc_head mapping."""
    for rank in range(2):
        tags = json.loads((runs.output_dir(2, "v4-zero1") / f"muon_tags.rank{rank}.json").read_text())
        shapes = {n: p.shape for n, p in _model("tiny-v4").named_parameters()}
        assert set(tags) == set(shapes)
        expected = {n: len(s) >= 2 and re.match(r"layers\.\d+\.layer\.", n) is not None for n, s in shapes.items()}
        assert tags == expected
        assert any("hc_head" in n and len(s) == 2 for n, s in shapes.items())


@pytest.mark.launch
def test_resume_is_bitwise(runs):
    """Steps 3-4 of a run resumed from step 2's checkpoint equal those of the uninterrupted run bit for bit."""
    whole, half, resumed = runs(2, "v3-const"), runs(2, "v3-const-half"), runs(2, "v3-const-resumed")
    assert [r["loss"] for r in half] == [r["loss"] for r in whole[:2]]
    assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in whole[2:]]


@pytest.mark.launch
@pytest.mark.parametrize("saved,resumed", RESHARDS)
def test_resharded_resume_follows_the_uninterrupted_run(saved, resumed, runs):
    """Saved by 1 rank after step 2 and resumed by 2 ranks through a universal checkpoint (ZeRO-1 -> ZeRO-2, whose
    momentum is whole matrices per rank; ZeRO-3 -> ZeRO-3, partitioned): steps 3-4 equal 1 rank's uninterrupted ones
    (losses and gradient norms within 1e-5), which needs Muon's momentum: a resume that lost it (zeros) misses
    them."""
    whole, half = runs(1, f"v3-1rank-const-{saved}"), runs(1, f"v3-1rank-const-half-{saved}")
    resharded = runs(2, f"v3-const-resharded-{resumed}")
    assert [r["loss"] for r in half] == [r["loss"] for r in whole[:2]]
    assert [r["step"] for r in resharded] == [3, 4]
    assert [r["loss"] for r in resharded] == pytest.approx([r["loss"] for r in whole[2:]], rel=1e-5)
    assert _norms(resharded) == pytest.approx(_norms(whole[2:]), rel=1e-5)


@pytest.mark.launch
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_plan_predicts_the_bytes_muon_holds(stage, runs, data_dir):
    """Every rank of the 2-rank ZeRO-1/2/3 Muon runs holds exactly the parameter, gradient and optimizer bytes `plan`
    predicts (bench zero's probe, peaks over the run's optimizer steps): the Muon matrices as a group of their own
    sorted by shape, ZeRO-3's momentum partitioned, ZeRO 1/2's momentum whole for every matrix overlapping the rank's
    slice plus DeepSpeed's staged copy of it. Against AdamW's plan of the same layout: ZeRO-3 holds less optimizer
    state; ZeRO 1/2 more (the staged copy and the whole matrices at the slices' edges outweigh Adam's second
    moment on 2 ranks)."""
    sets = SETS + [f"data.path={data_dir}"]
    cfg, ds = load_and_validate("recipes/tiny-v3.yaml", f"ds_configs/zero{stage}_muon.json", sets, 2)
    _, adamw_ds = load_and_validate("recipes/tiny-v3.yaml", f"ds_configs/zero{stage}.json", sets, 2)
    lay = layout_of(cfg, ds, 2)
    model = SpecParams(prepare_config(build_model_config("tiny-v3", None, {})))
    params = rank_params(model, model.bounds(1, cfg.model.partition_method, cfg.data.seq_len), 0, 1, 1)
    zero, adamw = zero_settings(ds, stage, element_bytes(ds)), zero_settings(adamw_ds, stage, element_bytes(adamw_ds))
    assert zero.muon and not adamw.muon
    fullest = 0
    for rank in range(2):
        held = json.loads((runs.output_dir(2, ZERO_RUNS[stage]) / f"held.rank{rank}.json").read_text())
        got = state_bytes(params, zero, lay.replicas, 1, held["dp_rank"])
        assert (got.params, got.grads, got.optimizer) == tuple(held["held"][k] for k in ("params", "grads",
                                                                                        "optimizer")), rank
        fullest = max(fullest, got.optimizer)
        adam = state_bytes(params, adamw, lay.replicas, 1, held["dp_rank"]).optimizer
        assert (got.optimizer < adam) is (stage == 3), (stage, got.optimizer, adam)
    assert estimate(cfg, ds, lay, 2**40, fused_attention=False, model=model).fullest.optimizer == fullest
