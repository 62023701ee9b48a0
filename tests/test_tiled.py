"""Tiled MLPs (models/tiled.py) in one process: a tiled model's loss, gradients, expert loads and balance losses equal
the untiled model's, and its MLPs hold no whole-sequence intermediate saved for backward, in forward or backward."""

import weakref

import pytest
import torch
import torch.nn.functional as F

from deepseek_ds.config.schema import MoESection
from deepseek_ds.models.layers import DecoderLayerPipe
from deepseek_ds.models.moe import LoadBalancer, resolve_settings
from deepseek_ds.models.pipeline import build_model, prepare_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.models.tiled import tile_mlps

pytestmark = pytest.mark.unit

# 74 tokens in tiles of 10: the last tile has 4, and one tile spans the end of a sequence and the start of the next.
B, T, TILE = 2, 37, 10


@pytest.fixture(autouse=True)
def one_thread():
    """These tiny models' steps are thousands of small ops: with more threads on shared cores they take ~6x longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(preset: str, tile: int, dtype=torch.float64, experts: str = "eager", ckpt: int = 0,
          overrides: dict | None = None, trains=None):
    """The seeded model with the MoE balancing hooks on (bias update and sequence-wise loss), tiled if tile > 0.
    float64 by default, where the tiled and untiled sums differ only by rounding ~1e-16 (transformers' grouped_mm
    experts have no float64 kernel: the eager experts then). trains(name): which parameters train (default all)."""
    mcfg = prepare_config(build_model_config(preset, None, overrides or {}), experts_implementation=experts)
    model = build_model(mcfg, 1, seed=7, activation_checkpoint_interval=ckpt).to(dtype).train()
    for name, p in model.named_parameters():
        p.requires_grad_(trains is None or trains(name))
    settings = resolve_settings(MoESection(seq_aux_alpha=1e-2, bias_update_speed=1e-3), mcfg)
    balancer = LoadBalancer(model, settings, 1 / B, B, "cpu") if settings else None
    tiled = tile_mlps(model, tile) if tile else 0
    return mcfg, model, balancer, tiled


def batch(mcfg) -> torch.Tensor:
    return torch.randint(0, mcfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))


def train_step(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the largest |want|."""
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def differences(preset: str, ckpt: int = 0, **kw) -> dict[str, float]:
    """One training step, untiled then tiled (kw: build's; ckpt: the tiled model's activation checkpointing): the
    relative difference of the loss, every parameter's gradient, the balance losses and the evaluation logits. What
    must be exactly the same (module count, state-dict names, which parameters get gradients, expert loads) is
    asserted here."""
    mcfg, plain, plain_bal, _ = build(preset, 0, **kw)
    _, tiled, tiled_bal, count = build(preset, TILE, ckpt=ckpt, **kw)
    assert count == sum(isinstance(m, DecoderLayerPipe) for m in tiled.modules())
    assert list(tiled.state_dict()) == list(plain.state_dict())  # checkpoints and HF export see the same names
    ids = batch(mcfg)
    out = {"loss": relative_difference(train_step(tiled, ids), train_step(plain, ids))}
    want = dict(plain.named_parameters())
    for name, p in tiled.named_parameters():
        assert (p.grad is None) == (want[name].grad is None), name
        if p.grad is not None:
            out[name] = relative_difference(p.grad, want[name].grad)
    if plain_bal:
        blocks = plain_bal.load.total.shape[0]
        assert plain_bal.load.total.sum() == B * T * mcfg.num_experts_per_tok * blocks  # each token counted once
        assert torch.equal(tiled_bal.load.total, plain_bal.load.total)
        assert plain_bal.aux_sums[0] > 0
        out["balance losses"] = relative_difference(tiled_bal.aux_sums, plain_bal.aux_sums)
    with torch.no_grad():  # evaluation (no hooks, no backward) computes in tiles too
        out["evaluation logits"] = relative_difference(tiled.eval()(ids), plain.eval()(ids))
    return out


def over(found: dict[str, float], rel: float) -> dict[str, float]:
    return {what: d for what, d in found.items() if d > rel}


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v2", "tiny-dense"])
def test_tiled_step_equals_untiled(preset):
    assert not over(differences(preset), 1e-6)


def test_tiled_step_with_training_kernels_and_activation_checkpointing():
    """float32 and transformers' grouped_mm experts, as training runs, and every tiled decoder layer under
    SequentialLM's activation checkpointing. The same sums in another order differ by about 1e-6 of a parameter's
    largest gradient in float32 (its norm weight's), so 1e-5 here."""
    assert not over(differences("tiny-v3", dtype=torch.float32, experts="grouped_mm", ckpt=1), 1e-5)


@pytest.mark.parametrize("preset,overrides", [("tiny-v3", {"first_k_dense_replace": 0}), ("tiny-dense", {})])
def test_only_the_mlps_train(preset, overrides):
    """Everything before the first MLP (its MoE block's router too) frozen, so its input needs no gradient, and the
    experts' and MLPs' own weights training (as LoRA on the routed experts alone): backward still reaches them."""
    found = differences(preset, overrides=overrides, trains=lambda name: ".mlp." in name and ".mlp.gate." not in name)
    assert any(".mlp." in name for name in found)  # the MLPs' own gradients were compared
    assert not over(found, 1e-6)


class Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedBytes:
    """Bytes saved for backward, live at once: each tensor autograd saves, counted once per storage (parameters
    excluded) from when it is saved until autograd frees it. Each storage is 'mlp' (saved in forward while an MLP
    module runs: what the MLPs hold until backward), 'recompute' (saved in backward: the tiles' recomputation), or
    'other'."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list] = {}  # storage -> [bytes, kind, references]
        self.now = {"mlp": 0, "recompute": 0, "other": 0}
        self.peak = dict(self.now)
        self.peak_all = 0
        self.in_mlp = 0
        for layer in model.modules():
            if isinstance(layer, DecoderLayerPipe):
                layer.layer.mlp.register_forward_pre_hook(lambda *_: self._enter(1))
                layer.layer.mlp.register_forward_hook(lambda *_: self._enter(-1))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def _enter(self, step: int) -> None:
        self.in_mlp += step

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        held = Held(t)
        if key in self.params or size == 0:
            return held
        if key not in self.live:
            kind = "recompute" if torch._C._current_graph_task_id() != -1 else "mlp" if self.in_mlp else "other"
            self.live[key] = [size, kind, 0]
            self.now[kind] += size
            self.peak[kind] = max(self.peak[kind], self.now[kind])
            self.peak_all = max(self.peak_all, sum(self.now.values()))
        self.live[key][2] += 1
        weakref.finalize(held, self._free, key)  # when autograd drops the saved tensor
        return held

    def _free(self, key: int) -> None:
        entry = self.live[key]
        entry[2] -= 1
        if entry[2] == 0:
            self.now[entry[1]] -= entry[0]
            del self.live[key]


def measure(preset: str, tile: int) -> tuple[SavedBytes, dict]:
    mcfg, model, _, _ = build(preset, tile, dtype=torch.float32, experts="grouped_mm")
    saved = SavedBytes(model)
    ids = batch(mcfg)
    with saved.hooks:
        logits = model(ids)
        held = dict(saved.now)  # end of forward: everything saved for backward is still held
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert not saved.live  # backward freed every saved tensor
    return saved, held


def whole_intermediates(mcfg, layer: int) -> int:
    """Bytes of one MLP's gate and up projections for all B x T tokens (float32): the dense MLP's, or the shared
    experts' plus the routed experts' (top-k of them per token)."""
    if mcfg.model_type == "llama" or layer < mcfg.first_k_dense_replace:
        width = 2 * mcfg.intermediate_size
    else:
        width = 2 * mcfg.moe_intermediate_size * (mcfg.n_shared_experts + mcfg.num_experts_per_tok)
    return B * T * width * 4


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-dense"])
def test_tiles_hold_no_whole_sequence_intermediate(preset):
    plain, plain_held = measure(preset, 0)
    tiled, tiled_held = measure(preset, TILE)
    mcfg = build_model_config(preset, None, {})
    per_layer = [whole_intermediates(mcfg, i) for i in range(mcfg.num_hidden_layers)]
    print(f"\n{preset}: MLPs hold {plain_held['mlp']} B saved for backward untiled, {tiled_held['mlp']} B tiled "
          f"(gate/up of all tokens: {sum(per_layer)} B); tiles' recomputation peak {tiled.peak['recompute']} B "
          f"(one layer's gate/up: {min(per_layer)}-{max(per_layer)} B); whole step's peak {plain.peak_all} B "
          f"untiled, {tiled.peak_all} B tiled")
    # Untiled, the MLPs hold every layer's whole-sequence intermediates; tiled, at least those are gone.
    assert plain_held["mlp"] >= sum(per_layer)
    assert plain_held["mlp"] - tiled_held["mlp"] >= sum(per_layer)
    assert plain.peak["recompute"] == 0
    # Backward's recomputation holds one tile's: less than any one layer's intermediates for the whole sequence.
    assert 0 < tiled.peak["recompute"] < min(per_layer)
    assert tiled.peak_all < plain.peak_all
