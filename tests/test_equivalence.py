"""Distributed equivalence, the core promise: the same seed, data and global batch give the same losses
under every parallel layout, and those equal a single-process transformers + torch AdamW reference (tiny-v3 in
every layout; the R1-Distill-Qwen layout, tiny-qwen2, under ZeRO-3, PP=2 and LoRA, DeepSeek-V4 under ZeRO-1, ZeRO-3,
PP=2 and PP=4, and DeepSeek-V3.2 under ZeRO-1, ZeRO-3 and PP=2, in the launches of their rank counts)."""

import pytest
import torch

from deepseek_ds.bench.comm_counter import counts_file, read_counts
from deepseek_ds.checkpoint.state import read_buffers
from deepseek_ds.config import load_ds_config, load_run_config
from deepseek_ds.models.hf_io import hf_state_dict
from deepseek_ds.models.lora import apply_lora
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.plan.comm import run_comm_bytes
from helpers import cli, read_metrics, train, train_layouts
from reference import lora_reference_losses, reference_losses, reference_model
from reference_data import StreamSamples, step_batch
from reference_indexer import indexer_loss_reference

STEPS = 3
# Adam's eps 1e-5 and seed 7 keep every token's routing decision clear of a near tie that the layouts' roundoff could
# flip (test_moe_launch.SETS explains; at the default seed and eps the reference's smallest gap was 2.3e-6).
SETS = [f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=64",
        "train.warmup_steps=0", "checkpoint.interval=0", "train.eps=1e-5", "train.seed=7"]


# DeepSeek-R1-Distill-Qwen's architecture (transformers' qwen2: q/k/v biases, grouped-query attention, untied head),
# and LoRA on it (the family's default targets, attention and MLP; the biases frozen) from an HF directory.
QWEN2 = ["model.preset=tiny-qwen2"]
QWEN2_LORA = ["model.preset=null", "model.path={qwen2_base}", "lora.r=4", "lora.alpha=8"]


# DeepSeek-V4: tiny-v4 (sliding, CSA and HCA attention, 2 hyper-connection streams) with two hash-routed layers, so
# that a split can put one after the first stage (it needs the token ids carried there).
V4 = ["model.preset=tiny-v4", "model.attn_implementation=eager",
      "model.overrides.mlp_layer_types=[hash_moe, hash_moe, moe, moe]"]
# DeepSeek-V3.2 (its lightning indexer frozen): tiny-v32 keeps 16 of the 64 tokens' keys per query.
V32 = ["model.preset=tiny-v32"]
# Its trainable indexer's stages, weights 5x tiny-v32's (scores far from uniform: a KL far from 0); warm-up through the
# pipeline (the query mask travels to stage 1), sparse under ZeRO-3 (each indexer's and attention's weights gathered).
V32_INDEXER = [*V32, "model.overrides.initializer_range=0.1"]
INDEXER_LAYOUTS = [
    ("v32-warmup-pp2-zero1", 2, "ds_configs/zero1_pp.json", [*V32_INDEXER, "indexer.stage=warmup",
                                                            "parallel.pipeline_stages=2"]),
    # Clipped below both the LM's and the indexers' gradient norms (~3.6 and ~0.1 at step 1): each by its own, in
    # ZeRO-3's optimizer and in ZeRO-1's across pipeline stages and with expert groups.
    ("v32-sparse-zero3", 2, "ds_configs/zero3.json", [*V32_INDEXER, "indexer.stage=sparse", "train.grad_clip=0.05"]),
    ("v32-sparse-pp2-zero1", 2, "ds_configs/zero1_pp.json", [*V32_INDEXER, "indexer.stage=sparse",
                                                            "train.grad_clip=0.05", "parallel.pipeline_stages=2"]),
    ("v32-sparse-ep2-zero1", 2, "ds_configs/zero1.json", [*V32_INDEXER, "indexer.stage=sparse",
                                                         "train.grad_clip=0.05", "parallel.expert_parallel=2"]),
]


@pytest.fixture(scope="module")
def qwen2_base(tmp_path_factory, data_dir) -> str:
    """QWEN2_LORA's model.path: tiny-qwen2's seeded weights with non-zero biases (they start at 0), so that the
    frozen biases count in every loss."""
    model, _ = reference_model(load_run_config("recipes/tiny-v3.yaml", SETS + QWEN2 + [f"data.path={data_dir}"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    out = tmp_path_factory.mktemp("qwen2_base")
    model.save_pretrained(out)
    return str(out)


def initial_adapters(cfg) -> dict[str, torch.Tensor]:
    """HF name -> tensor of the adapters a LoRA run of `cfg` starts from on any layout: models.lora draws each from
    the run's seed and its module's HF name (an input of the reference, as the seeded base weights are)."""
    mcfg = prepare_config(build_model_config(cfg.model.preset, cfg.model.path, cfg.model.overrides))
    layers = local_layers(build_model(mcfg, 1, seed=None))
    apply_lora(torch.nn.ModuleList(layers), cfg.lora, mcfg, cfg.train.seed)
    return {n: t.detach().clone() for n, t in hf_state_dict(layers).items() if ".lora_" in n}


def _filled(extra: list[str], qwen2_base: str) -> list[str]:
    return [s.format(qwen2_base=qwen2_base) for s in extra]


@pytest.fixture(scope="module")
def reference(data_dir, qwen2_base):
    """reference(extra) -> (losses, gradient norms before clipping, step 1's gradients by HF name): the single-process
    run of the model a layout's overrides choose (model.preset, model.path, model.overrides; tiny-v3 by default) and,
    with lora.r > 0, of transformers + peft (no gradients then), each computed once."""
    done: dict[tuple, tuple[list[float], list[float], dict]] = {}

    def losses(extra: list[str]) -> tuple[list[float], list[float], dict]:
        model = tuple(s for s in _filled(extra, qwen2_base)
                      if s.startswith(("model.preset=", "model.path=", "model.overrides.", "model.attn_", "lora.")))
        if model not in done:
            cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [*model, f"data.path={data_dir}"])
            norms: list[float] = []
            grads: dict[str, torch.Tensor] = {}
            done[model] = (lora_reference_losses(cfg, cfg.model.path, data_dir, initial_adapters(cfg), norms)
                           if cfg.lora.r else reference_losses(cfg, data_dir, grad_norms=norms, first_grads=grads)), \
                norms, grads
        return done[model]
    return losses


LAYOUTS = [
    # (id, ranks, deepspeed config, extra overrides); the layouts of one rank count train in one launch.
    ("zero0", 2, "ds_configs/zero0.json", []),
    ("zero1", 2, "ds_configs/zero1.json", []),
    ("zero2", 2, "ds_configs/zero2.json", []),
    ("zero3", 2, "ds_configs/zero3.json", []),
    # 8 micro-batches, as the other pipeline schedules run them (below, and test_schedules_equal_1f1b).
    ("pp2-zero1", 2, "ds_configs/zero1_pp.json", ["parallel.pipeline_stages=2", "train.micro_batch_size=1"]),
    ("pp4-zero1", 4, "ds_configs/zero1_pp.json", ["parallel.pipeline_stages=4", "train.micro_batch_size=1"]),
    ("pp2-zbh1-zero1", 2, "ds_configs/zero1_pp.json", ["parallel.pipeline_stages=2", "train.micro_batch_size=1",
                                                       "parallel.pipeline_schedule=zb-h1"]),
    # With activation checkpointing (the split backward recomputes through torch's non-reentrant checkpoint).
    ("pp4-zbh1-zero1", 4, "ds_configs/zero1_pp.json", ["parallel.pipeline_stages=4", "train.micro_batch_size=1",
                                                       "parallel.pipeline_schedule=zb-h1",
                                                       "model.activation_checkpoint_interval=1"]),
    ("pp2-dualpipev-zero1", 2, "ds_configs/zero1_pp.json", ["parallel.pipeline_stages=2", "train.micro_batch_size=1",
                                                            "parallel.pipeline_schedule=dualpipev"]),
    # 8 model stages need 8 pipeline layers: tiny-v3 has 7 (embedding, 4 decoder layers, norm, head); 1f1b beside it.
    ("pp4-6layers-zero1", 4, "ds_configs/zero1_pp.json", ["model.overrides.num_hidden_layers=6",
                                                          "parallel.pipeline_stages=4", "train.micro_batch_size=1"]),
    ("pp4-dualpipev-zero1", 4, "ds_configs/zero1_pp.json", ["model.overrides.num_hidden_layers=6",
                                                            "parallel.pipeline_stages=4", "train.micro_batch_size=1",
                                                            "parallel.pipeline_schedule=dualpipev"]),
    ("pp2xdp2-dualpipev-zero1-ckpt", 4, "ds_configs/zero1_pp.json", ["parallel.pipeline_stages=2",
                                                                     "train.micro_batch_size=1",
                                                                     "parallel.pipeline_schedule=dualpipev",
                                                                     "model.activation_checkpoint_interval=1"]),
    # 4 ranks: also exercises activation checkpointing inside the pipeline (embedding first layer excluded).
    ("pp2xdp2-zero1-ckpt", 4, "ds_configs/zero1_pp.json", ["parallel.pipeline_stages=2",
                                                           "model.activation_checkpoint_interval=1"]),
    ("sp2-zero2", 2, "ds_configs/zero2.json", ["parallel.sequence_parallel=2"]),
    ("sp2xdp2-zero1", 4, "ds_configs/zero1.json", ["parallel.sequence_parallel=2"]),
    ("qwen2-zero3", 2, "ds_configs/zero3.json", QWEN2),
    ("qwen2-pp2-zero1", 2, "ds_configs/zero1_pp.json", [*QWEN2, "parallel.pipeline_stages=2"]),
    ("qwen2-lora-zero3", 2, "ds_configs/zero3.json", QWEN2_LORA),
    ("v4-zero1", 2, "ds_configs/zero1.json", V4),
    ("v4-zero3", 2, "ds_configs/zero3.json", V4),
    # Stage 1 starts at the second hash layer (specs: embedding, layers 0-3, norm, head).
    ("v4-pp2-zero1", 2, "ds_configs/zero1_pp.json", [*V4, "parallel.pipeline_stages=2",
                                                     "model.partition_method=0,2,7"]),
    ("v4-pp4-zero1", 4, "ds_configs/zero1_pp.json", [*V4, "parallel.pipeline_stages=4",
                                                     "model.partition_method=0,2,3,5,7"]),
    ("v32-zero1", 2, "ds_configs/zero1.json", V32),
    ("v32-zero3", 2, "ds_configs/zero3.json", V32),
    ("v32-pp2-zero1", 2, "ds_configs/zero1_pp.json", [*V32, "parallel.pipeline_stages=2"]),
    ("v32-ep2-zero1", 2, "ds_configs/zero1.json", [*V32, "parallel.expert_parallel=2"]),
]


class LayoutRuns:
    """runs(ranks, name): the metrics records of a layout; runs.output_dir(ranks, name): its train.output_dir. On first
    use of a rank count, all its layouts train in one launch of tests/layouts_worker.py (the real training loop, as
    train.py runs it), one start-up for all, with every collective counted (bench comm's counter, which only
    reads tensor sizes)."""

    def __init__(self, root_factory, sets: list[str], qwen2_base: str):
        self.root_factory, self.sets, self.qwen2_base = root_factory, sets, qwen2_base
        self.done: dict[int, dict] = {}

    def output_dir(self, ranks: int, name: str):
        if ranks not in self.done:
            mine = [(n, ds, _filled(extra, self.qwen2_base)) for n, r, ds, extra in LAYOUTS + INDEXER_LAYOUTS
                    if r == ranks]
            self.done[ranks] = train_layouts(ranks, self.root_factory(f"ranks{ranks}"), mine, self.sets,
                                             worker_args=("--first-grads", "--count-comm"))
        return self.done[ranks][name]

    def __call__(self, ranks: int, name: str) -> list[dict]:
        return read_metrics(str(self.output_dir(ranks, name)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, qwen2_base) -> LayoutRuns:
    return LayoutRuns(tmp_path_factory.mktemp, SETS + [f"data.path={data_dir}"], qwen2_base)


@pytest.mark.launch
@pytest.mark.parametrize("name,ranks,ds_config,extra", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_losses_equal_single_process_reference(name, ranks, ds_config, extra, reference, runs):
    records = runs(ranks, name)
    reference, reference_norms, reference_grads = reference(extra)
    losses, norms = [r["loss"] for r in records], [r["grad_norm"] for r in records]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # Step 1 checks the forward pass and loss; steps 2-3 check that gradients, clipping and AdamW agree.
    assert losses == pytest.approx(reference, rel=1e-5), f"{name}: {losses} vs reference {reference}"
    assert len(set(reference)) == STEPS  # the reference really trains: every step's loss differs
    # Adam normalises a gradient's size away, so the losses are nearly blind to a gradient off by a factor (one
    # rank's contribution x (1 + 1e-4) moves them by less than 1e-6): each step's norm before clipping is not.
    assert norms == pytest.approx(reference_norms, rel=1e-5), f"{name}: grad norms {norms} vs {reference_norms}"
    # And step 1's gradient of every parameter (the reference's trainable ones; LoRA's reference records none).
    if not reference_grads:
        return
    grads: dict[str, torch.Tensor] = {}
    for path in sorted(runs.output_dir(ranks, name).glob("first_grads.rank*.pt")):
        grads.update(torch.load(path))
    if "parallel.expert_parallel=2" in extra:
        # AutoEP holds each rank's experts in its own layout (checkpoint/tensor_names.py converts them when saving):
        # their gradients count in the norms above; every other parameter's is compared below.
        experts = {p for p in reference_grads if ".mlp.experts." in p}
        assert experts and all(grads.pop(p).shape != reference_grads[p].shape for p in experts)
        reference_grads = {p: g for p, g in reference_grads.items() if p not in experts}
    assert set(grads) == set(reference_grads), \
        f"{name}: parameters with a gradient differ: {sorted(set(grads) ^ set(reference_grads))[:5]}"
    # Relative to each gradient's largest entry, or for the few far smaller than the whole (V4's hyper-connection
    # scales: ~1e-5, sums that cancel, whose fp32 roundoff is ~1e-10) to 1e-4 of the whole gradient's norm.
    floor = 1e-4 * torch.sqrt(sum(g.double().norm() ** 2 for g in reference_grads.values())).item()
    for param, want in reference_grads.items():
        error = (grads[param] - want).abs().max().item() / max(want.abs().max().item(), floor)
        assert error <= 1e-5, f"{name}: step 1's gradient of {param} is off by {error:.2e} of its largest entry"


@pytest.mark.launch
@pytest.mark.parametrize("name,ranks,base", [("pp2-zbh1-zero1", 2, "pp2-zero1"), ("pp4-zbh1-zero1", 4, "pp4-zero1"),
                                             ("pp2-dualpipev-zero1", 2, "pp2-zero1"),
                                             ("pp4-dualpipev-zero1", 4, "pp4-6layers-zero1"),
                                             ("pp2xdp2-dualpipev-zero1-ckpt", 4, "pp2xdp2-zero1-ckpt")])
def test_schedules_equal_1f1b(name, ranks, base, runs):
    """The same micro-batches in another order give DeepSpeed's 1F1B losses and gradient norms (the gradients
    themselves are compared with the reference's above; the DualPipeV layout with data parallelism splits each
    replica's 2 micro-batches of 2 into 4 of 1)."""
    records, baseline = runs(ranks, name), runs(ranks, base)
    for key in ("loss", "grad_norm"):
        got, want = [r[key] for r in records], [r[key] for r in baseline]
        assert got == pytest.approx(want, rel=1e-6, abs=0), f"{name}: {key} {got} vs 1f1b's {want}"


# The 2-rank launch's layouts: issue 53's on tiny-v3 (ZeRO-0..3, PP=2, SP=2; EP=2 on tiny-v32, the same AutoEP
# all-to-alls: the launch has no tiny-v3 EP layout; TP=2 runs in test_tensor_parallel.py's launch) and the other
# families'. Not the trained indexer's (its metrics differ by a few bytes) nor LoRA's (an HF directory).
COMM_LAYOUTS = ["zero0", "zero1", "zero2", "zero3", "pp2-zero1", "pp2-zbh1-zero1", "sp2-zero2", "v32-ep2-zero1",
                "pp2-dualpipev-zero1", "qwen2-zero3", "qwen2-pp2-zero1", "v4-zero1", "v4-zero3", "v4-pp2-zero1", "v32-zero1",
                "v32-zero3", "v32-pp2-zero1"]


@pytest.mark.launch
@pytest.mark.parametrize("name", COMM_LAYOUTS)
def test_measured_communication_equals_the_plans(name, runs, data_dir):
    """Each rank's bytes per collective kind in steps 2-3, counted on the real run (bench/comm_counter.py), equal
    what plan/comm.py predicts for the layout within 2% (the mean over a stage's ranks: EP routing splits the
    all-to-alls unevenly, their sum is fixed). Step 1 is left out: it sets up once (ZeRO-3 gathers everything twice
    before its trace exists and converts parameters registered late), and --first-grads gathers the gradients."""
    _, ranks, ds_config, extra = next(layout for layout in LAYOUTS if layout[0] == name)
    out = runs.output_dir(ranks, name)
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={data_dir}", *extra])
    planned = run_comm_bytes(cfg, load_ds_config(ds_config), ranks)
    counts = [read_counts(counts_file(str(out), rank)) for rank in range(ranks)]
    per_stage = ranks // len(planned)
    for step in range(2, STEPS + 1):
        for stage, plan in enumerate(planned):
            mine = [c[step] for c in counts[stage * per_stage:(stage + 1) * per_stage]]
            for kind in set(plan) | {k for c in mine for k in c}:
                measured = sum(c.get(kind, 0) for c in mine) / len(mine)
                assert measured == pytest.approx(plan.get(kind, 0), rel=0.02), \
                    f"{name} step {step} stage {stage} {kind}: measured {measured:.0f} B, planned {plan.get(kind, 0)} B"
    assert min(sum(p.values()) for p in planned) > 2**17  # activations, gradients or parameters: not only metrics


@pytest.mark.launch
@pytest.mark.parametrize("name,ranks", [("v4-zero3", 2), ("v4-pp2-zero1", 2)])
def test_v4_hash_tables_are_saved_and_exported_unchanged_by_training(name, ranks, runs, data_dir, tmp_path):
    """The hash-routed layers' token -> experts tables (buffers, no gradient) in the final checkpoint of a V4 layout
    equal, bitwise, those the model was built with (training, ZeRO-3's partitioning and the pipeline left them), and
    so do those of its `export hf`, which transformers loads as deepseek_v4, and its frozen indexers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    records = runs(ranks, name)
    tag = runs.output_dir(ranks, name) / "checkpoints" / f"step{records[-1]['step']:08d}"
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + V4 + [f"data.path={data_dir}"])
    mcfg = prepare_config(build_model_config(cfg.model.preset, None, cfg.model.overrides), "eager")
    initial = hf_state_dict(local_layers(build_model(mcfg, 1, cfg.train.seed)))
    built = {n: t for n, t in initial.items() if n.endswith("tid2eid")}
    saved = read_buffers(str(tag))
    assert len(built) == 2
    for n, table in built.items():
        assert torch.equal(saved[n], table), n
    out = tmp_path / "hf"
    assert cli(["export", "hf", str(tag), "--out", str(out), "--dtype", "fp32", "--work-dir", str(tmp_path)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    exported = load_file(out / "model.safetensors")
    for n, table in built.items():
        on_disk = n.replace(".mlp.", ".ffn.")  # transformers' save_pretrained writes V4's published module names
        assert exported[on_disk].dtype == table.dtype and torch.equal(exported[on_disk], table), n
        assert torch.equal(model.get_submodule(n.removesuffix(".tid2eid")).tid2eid, table), n
    # The frozen lightning indexers (no optimizer state: DeepSpeed saves them apart) are exported as they started.
    indexers = {n: t for n, t in model.state_dict().items() if ".indexer." in n and "rotary" not in n}
    assert indexers and all(torch.equal(t, initial[n]) for n, t in indexers.items())


@pytest.mark.launch
@pytest.mark.parametrize("name,ranks,ds_config,extra", INDEXER_LAYOUTS, ids=[layout[0] for layout in INDEXER_LAYOUTS])
def test_v32_indexer_stages_step_one_equals_the_definition(name, ranks, ds_config, extra, runs, data_dir):
    """indexer.stage warmup / sparse: step 1's lm_loss equals transformers' loss of the model (dense in warm-up), its
    indexer_loss the whole-tensor reference of the definition (tests/reference_indexer.py) on the same global batch,
    and loss = lm_loss + indexer.loss_weight x indexer_loss; the next steps' losses move."""
    records = runs(ranks, name)
    stage = next(s.split("=")[1] for s in extra if s.startswith("indexer.stage="))
    dense = ["model.overrides.index_topk=64"] if stage == "warmup" else []
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [*extra, *dense, "model.attn_implementation=eager",
                                                          f"data.path={data_dir}"])
    model, _ = reference_model(cfg)
    (input_ids, labels), = step_batch(StreamSamples(data_dir, cfg.data.seq_len), 1, 8, cfg.train.seed,
                                      cfg.train.shuffle)
    lm, indexer = indexer_loss_reference(model, input_ids, labels, sparse=stage == "sparse")
    first = records[0]
    assert first["lm_loss"] == pytest.approx(lm, rel=1e-5)
    assert first["indexer_loss"] == pytest.approx(indexer.item(), rel=1e-5) and first["indexer_loss"] > 1e-2
    assert first["loss"] == pytest.approx(first["lm_loss"] + cfg.indexer.loss_weight * first["indexer_loss"], rel=1e-12)
    assert len({r["indexer_loss"] for r in records}) == STEPS


@pytest.mark.launch
@pytest.mark.parametrize("name", ["v32-sparse-zero3", "v32-sparse-pp2-zero1", "v32-sparse-ep2-zero1"])
def test_v32_sparse_stage_clips_the_model_and_the_indexers_apart(name, runs, data_dir):
    """indexer.stage sparse: step 1's logged grad_norm_lm and grad_norm_indexer are the norms of the language model's
    and the indexers' recorded gradients (grad_norm of both), and Adam's first moments after step 1 are (1 - beta1) x
    each gradient clipped by its own group's norm; one global norm would have scaled the indexers' by
    clip / grad_norm, ~36x less."""
    extra = next(e for n, _, _, e in INDEXER_LAYOUTS if n == name)
    records = runs(2, name)
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + extra + [f"data.path={data_dir}"])
    out = runs.output_dir(2, name)
    ranks = [(torch.load(out / f"first_grads.rank{r}.pt"), torch.load(out / f"first_moments.rank{r}.pt"))
             for r in range(2)]
    # AutoEP's experts' gradients are recorded in its own layout (compared through the norms only, as in
    # test_losses_equal_single_process_reference): there the group norms are the ZeRO-3 layout's, on the same batch.
    ep = "parallel.expert_parallel=2" in extra
    grads = {**ranks[0][0], **ranks[1][0]}  # a pipeline stage records its own parameters

    def norm(indexers: bool) -> float:
        return float(torch.sqrt(sum(g.double().norm() ** 2 for n, g in grads.items() if (".indexer." in n) == indexers)))

    first, clip = records[0], cfg.train.grad_clip
    same = runs(2, "v32-sparse-zero3")[0] if ep else {"grad_norm_lm": norm(False), "grad_norm_indexer": norm(True)}
    lm, indexer = first["grad_norm_lm"], first["grad_norm_indexer"]
    assert lm == pytest.approx(same["grad_norm_lm"], rel=1e-5)
    assert indexer == pytest.approx(norm(True), rel=1e-5) and indexer == pytest.approx(same["grad_norm_indexer"], rel=1e-5)
    assert first["grad_norm"] == pytest.approx((lm ** 2 + indexer ** 2) ** 0.5, rel=1e-5)
    assert clip < indexer < lm  # both groups clipped
    for grads, moments in ranks:
        assert set(moments) == set(grads) and any(".indexer." in n for n in grads)
        for n, g in grads.items():
            if ep and ".mlp.experts." in n:
                continue
            # DeepSpeed's clip coefficient, of the parameter's own group
            want = (1 - cfg.train.beta1) * clip / ((indexer if ".indexer." in n else lm) + 1e-6) * g
            error = (moments[n] - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
            assert error <= 1e-5, f"Adam's first moment of {n} after step 1 is off by {error:.2e}"


@pytest.mark.launch
def test_v32_indexer_warmup_changes_the_indexers_only(runs, data_dir, tmp_path):
    """After the warm-up every tensor of its `export hf` (as transformers loads it, deepseek_v32) but the indexers' is
    bitwise the model it started from, and every indexer tensor moved."""
    from transformers import AutoModelForCausalLM

    records = runs(2, "v32-warmup-pp2-zero1")
    tag = runs.output_dir(2, "v32-warmup-pp2-zero1") / "checkpoints" / f"step{records[-1]['step']:08d}"
    out = tmp_path / "hf"
    assert cli(["export", "hf", str(tag), "--out", str(out), "--dtype", "fp32", "--work-dir", str(tmp_path)]) == 0
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + V32_INDEXER + [f"data.path={data_dir}"])
    mcfg = prepare_config(build_model_config(cfg.model.preset, None, cfg.model.overrides))
    initial = hf_state_dict(local_layers(build_model(mcfg, 1, cfg.train.seed)))
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.model_type == "deepseek_v32"
    exported = exported.state_dict()
    assert set(initial) <= set(exported)
    indexer = {n for n in initial if ".indexer." in n}
    assert indexer and all(not torch.equal(exported[n], initial[n]) for n in indexer)
    assert all(torch.equal(exported[n], initial[n]) for n in initial if n not in indexer)


@pytest.mark.unit
def test_reference_detects_a_different_batch(data_dir):
    """The comparison above can fail: a different seed (other samples, other init) moves the losses."""
    base = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={data_dir}"])
    other = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={data_dir}", "train.seed=99"])
    a, b = reference_losses(base, data_dir), reference_losses(other, data_dir)
    assert abs(a[0] - b[0]) / a[0] > 1e-4


@pytest.mark.launch
def test_training_from_an_hf_directory_with_pipeline(data_dir, tmp_path):
    """model.path: each stage of a PP=2 run loads only its layers from the sharded safetensors directory;
    the first loss equals transformers' loss of the from_pretrained model on the same global batch."""
    from transformers import AutoModelForCausalLM

    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={data_dir}"])
    model, mcfg = reference_model(cfg)
    hf_dir = tmp_path / "hf"
    # Different weights from the seeded init the run would otherwise use: the loss proves they were loaded.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    model.save_pretrained(hf_dir, max_shard_size="500KB")
    records = train(2, str(tmp_path / "run"), SETS + [f"data.path={data_dir}", f"model.path={hf_dir}", "model.preset=null",
                                                      "parallel.pipeline_stages=2", "train.steps=1"],
                    ds_config="ds_configs/zero1_pp.json")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    (input_ids, labels), = step_batch(StreamSamples(data_dir, cfg.data.seq_len), 1, 8, cfg.train.seed, cfg.train.shuffle)
    with torch.no_grad():
        logits = hf(input_ids=input_ids).logits
        expected = hf.loss_function(logits=logits, labels=None, shift_labels=labels, vocab_size=mcfg.vocab_size).item()
    assert records[0]["loss"] == pytest.approx(expected, rel=1e-5)
    with open(tmp_path / "run" / "logs" / "rank1.log") as f:
        assert "loaded" in f.read()  # the last stage read its own share, logged per rank
