"""train.objective dpo: the reference log-probabilities, stored (objectives/dpo.py has the pair step,
models/preference_loss.py the losses).

The reference model's log-probabilities of every pair of the training split are computed once, before training and
before any resume (so `preference.reference: null` is the starting weights even on a resume), on the training
layout itself: the engine's weights are swapped for the reference's (an HF directory) for the pass and back, so the
run never holds two models. They are stored in <checkpoint dir>/reference_logps/ with their sha256 and a key of
what they depend on (the dataset's shards, seq_len, truncation, the reference or starting weights' files): a resume
or re-run with the same key reuses them; another key, or a damaged file, recomputes them. The pass stores its
parts as it goes (<split>.parts/), so a run killed during the pass resumes it where it stopped, bitwise the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from peft.tuners.lora import LoraLayer
from tqdm import tqdm

from ...checkpoint.tensor_names import load_hf_weights_split
from ...config import precision
from ...data import micro_batch
from ...data.layout import read_meta
from ...data.pairs import small_valid_warning
from ...models.pipeline import local_layers, split_micro_batch, to_device
from ...models.preference_loss import sequence_logps
from ...utils.fs import write_bytes_atomic, write_json_atomic
from ..evaluation import _pipeline_eval_loss, pipeline_eval_chunks
from ..run import Run

REFERENCE_DIR = "reference_logps"
REFERENCE_PARTS = 100  # a killed pass loses at most about 1% of its work


def _files_identity(directory: str) -> list:
    """A model directory by its files' names, sizes and modification times (hashing a 671B model's weights to key a
    cache would cost more than the pass)."""
    root = Path(directory)
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in root.iterdir() if p.is_file())


def reference_key(run: Run, split: str = "train") -> str:
    cfg, meta = run.cfg, read_meta(run.dataset_dir)
    ref = cfg.preference.reference
    start = ({"path": _files_identity(cfg.model.path)} if cfg.model.path else
             {"preset": cfg.model.preset, "seed": cfg.train.seed})
    desc = {"shards": [s["bin_sha256"] for s in meta["splits"][split]["shards"]], "seq_len": cfg.data.seq_len,
            "truncation": cfg.data.truncation, "overrides": cfg.model.overrides, "ds_precision": precision(run.ds),
            "reference": {"path": _files_identity(ref)} if ref else {"starting_weights": start}}
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()


def ensure_reference(run: Run, dataset, split: str = "train") -> np.ndarray | None:
    """[pairs, 2] float64 (chosen, rejected) reference log-probabilities of a split, reused or computed; None for a
    reference-free loss. Every rank calls it."""
    if split == "valid" and run.rank == 0 and (warning := small_valid_warning(len(dataset))):
        run.log.warning(warning)  # once, at the run's start: eval_reward_accuracy over a few pairs means little
    if not run.loss_fn.needs_reference:
        return None
    if lora_base_reference(run):
        if not run.pipeline:
            if run.rank == 0 and split == "train":
                run.log.info("LoRA: the reference is the base model (the adapters off), computed with each "
                             "micro-batch: no reference pass")
            return None
        # A pipeline's train_batch runs the stages in its own schedule, with no forward of the base in between: the
        # pass below stores the base's values, computed now, before the first step (B = 0: the adapters change nothing).
    folder = Path(run.cfg.checkpoint_dir) / REFERENCE_DIR
    key = reference_key(run, split)
    # Rank 0 reads and decides, for every rank (another host may not see the folder, and all must take one path).
    stored = _from_rank0(_stored(folder, split, key) if run.rank == 0 else None)
    if stored is not None and len(stored) == len(dataset):
        if run.rank == 0:
            run.log.info("reference log-probabilities (%s): reused %s (%d pairs)", split, folder, len(stored))
        return stored
    ref = run.cfg.preference.reference
    with _reference_weights(run, ref):
        values = _resumable_pass(run, dataset, folder / f"{split}.parts", key)
    if run.rank == 0:
        data, sha = _encoded(values)
        write_bytes_atomic(folder / f"{split}.bin", data)
        write_json_atomic(folder / f"{split}.json", {"key": key, "pairs": len(values), "sha256": sha})
        shutil.rmtree(folder / f"{split}.parts", ignore_errors=True)
        run.log.info("reference log-probabilities (%s) of %d pairs (%s) stored in %s", split, len(values),
                     ref or "the starting weights", folder)
    dist.barrier()
    return values


def _encoded(values: np.ndarray) -> tuple[bytes, str]:
    """The stored form of [pairs, 2] log-probabilities: little-endian float64 bytes, and their sha256."""
    data = values.astype("<f8").tobytes()
    return data, hashlib.sha256(data).hexdigest()


def _decoded(path: Path, sha: str | None) -> np.ndarray | None:
    """A stored file's [pairs, 2] log-probabilities, None when it is missing or not the bytes `sha` names."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return np.frombuffer(data, dtype="<f8").reshape(-1, 2).copy() if hashlib.sha256(data).hexdigest() == sha else None


def _stored(folder: Path, split: str, key: str) -> np.ndarray | None:
    try:
        record = json.loads((folder / f"{split}.json").read_text())
    except (OSError, ValueError):
        return None
    return _decoded(folder / f"{split}.bin", record.get("sha256")) if record.get("key") == key else None


def _from_rank0(value):
    box = [value]
    dist.broadcast_object_list(box, 0)
    return box[0]


def part_pairs(pairs: int, dp_size: int, micro_batch_size: int) -> int:
    """Pairs per stored part of a reference pass: about 1/REFERENCE_PARTS of the split in whole micro-batches of every
    data-parallel rank. A part's micro-batches depend on nothing else, so a pass resumed after a kill computes each
    part exactly as an uninterrupted one does: the same values, bitwise."""
    step = dp_size * micro_batch_size
    return max(1, math.ceil(pairs / REFERENCE_PARTS / step)) * step


def _resumable_pass(run: Run, dataset, parts: Path, key: str) -> np.ndarray:
    """[pairs, 2] reference log-probabilities, computed part by part; each part is stored in `parts` as it is done,
    with its sha256 in manifest.json, so a pass killed midway resumes at its first part not stored intact."""
    n = len(dataset)
    size = part_pairs(n, run.dp_size, run.cfg.train.micro_batch_size)
    total = math.ceil(n / size)
    kept, shas = _from_rank0(_kept_parts(parts, key, size) if run.rank == 0 else None)
    if run.rank == 0:
        if kept:
            run.log.info("reference pass: resuming at pair %d of %d (%d of %d parts kept in %s)", len(kept) * size,
                         n, len(kept), total, parts)
        else:
            shutil.rmtree(parts, ignore_errors=True)
            parts.mkdir(parents=True)
    values = list(kept)
    for c in tqdm(range(len(kept), total), initial=len(kept), total=total, desc="reference pass", unit="part",
                  disable=run.rank != 0, dynamic_ncols=True):
        values.append(reference_pass(run, dataset, c * size, min(size, n - c * size))[:, :2])
        if run.rank == 0:
            data, sha = _encoded(values[-1])
            write_bytes_atomic(parts / f"{c:06d}.bin", data)
            shas.append(sha)
            write_json_atomic(parts / "manifest.json", {"key": key, "pairs_per_part": size, "sha256": shas})
    return np.concatenate(values)


def _kept_parts(parts: Path, key: str, size: int) -> tuple[list[np.ndarray], list[str]]:
    """The leading parts of an interrupted pass with this key and part size that are intact, and their sha256s."""
    try:
        manifest = json.loads((parts / "manifest.json").read_text())
    except (OSError, ValueError):
        return [], []
    if manifest.get("key") != key or manifest.get("pairs_per_part") != size:
        return [], []
    kept, shas = [], []
    for c, sha in enumerate(manifest.get("sha256", [])):
        values = _decoded(parts / f"{c:06d}.bin", sha)
        if values is None:
            break
        kept.append(values)
        shas.append(sha)
    return kept, shas


@contextlib.contextmanager
def _reference_weights(run: Run, reference: str | None):
    """The engine holding the reference's weights inside the block (none to load: the starting weights), its own
    restored after: each rank keeps a copy of its own share (ZeRO-3: its partition) meanwhile."""
    if not reference:
        yield
        return
    module = run.engine.module
    saved = {name: _own(p).clone() for name, p in module.named_parameters()}
    buffers = [b.data.clone() for b in module.buffers()]
    try:
        load_hf_weights_split(local_layers(module), reference, run.model_config, run.layout.tensor_rank,
                              run.cfg.parallel.tensor_parallel)
        yield
    finally:
        with torch.no_grad():
            for name, p in module.named_parameters():
                if hasattr(p, "ds_tensor") and p.data.numel():
                    # ZeRO-3 keeps some parameters gathered (persistent ones, recently used ones): released, so the
                    # next forward gathers them again from the restored partitions instead of using the reference's.
                    p.partition()
                _own(p).copy_(saved[name])
            for b, s in zip(module.buffers(), buffers, strict=True):
                b.data.copy_(s)


def _own(p) -> torch.Tensor:
    """What this rank holds of a parameter: its ZeRO-3 partition, or its data."""
    return p.ds_tensor.data if hasattr(p, "ds_tensor") else p.data


def lora_base_reference(run: Run) -> bool:
    """LoRA without preference.reference: the reference is the frozen base, the policy with its adapters off."""
    return bool(run.cfg.lora.r) and not run.cfg.preference.reference


def buffer_copies(module) -> list[torch.Tensor]:
    """Copies of the module's buffers (router biases): a LoRA base's starting ones, kept as its reference's."""
    return [b.detach().clone() for b in module.buffers()]


@contextlib.contextmanager
def adapters_off(module, base_buffers: list[torch.Tensor]):
    """The model without its LoRA adapters (peft's switch on each adapted layer) and with the base's starting
    buffers (router biases) inside the block."""
    layers = [m for m in module.modules() if isinstance(m, LoraLayer)]
    buffers, current = list(module.buffers()), buffer_copies(module)
    for m in layers:
        m.enable_adapters(False)
    with torch.no_grad():
        for b, base in zip(buffers, base_buffers, strict=True):
            b.copy_(base)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        with torch.no_grad():
            for b, now in zip(buffers, current, strict=True):
                b.copy_(now)


def reference_pass(run: Run, dataset, start: int = 0, count: int | None = None) -> np.ndarray:
    """[count, 4] summed log-probabilities of pairs start .. start + count - 1 (default: all) chosen and rejected
    responses under the engine's current weights, then their trained-token counts: each data-parallel rank its
    contiguous share, the same number of forwards everywhere (ZeRO-3 gathers in lockstep), gathered to every rank."""
    engine, mb = run.engine, run.cfg.train.micro_batch_size
    n = len(dataset) - start if count is None else count
    # Whole micro-batches (a pipeline's shapes are fixed), the last rows repeating the last pair.
    per_rank = math.ceil(math.ceil(n / run.dp_size) / mb) * mb
    mine = [start + min(i, n - 1) for i in range(run.dp_rank * per_rank, (run.dp_rank + 1) * per_rank)]
    raw = [micro_batch(dataset, mine[a:a + mb]) for a in range(0, per_rank, mb)]
    rows: list[torch.Tensor] = []

    def collect(logits, labels):
        logps, counts = sequence_logps(logits, labels)
        rows.append(torch.cat([logps.double().reshape(2, -1), counts.double().reshape(2, -1)]).t())
        return logps.sum() * 0  # the pipeline engine wants a loss to reduce

    if run.pipeline:
        with _pipeline_eval_loss(engine, collect):
            for chunk in pipeline_eval_chunks(engine, raw):
                engine.eval_batch(iter([split_micro_batch(b) for b in chunk]), compute_loss=True, bcast_loss=False,
                                  num_micro_batches=len(chunk))
        del rows[len(raw):]  # a DualPipeV chunk's padding
    else:
        was_training = engine.module.training
        engine.module.eval()
        with torch.no_grad():
            for inputs, labels in map(split_micro_batch, raw):
                collect(engine(to_device(inputs, engine.device)), labels.to(engine.device))
        engine.module.train(was_training)
    out = torch.cat(rows) if rows else torch.zeros(per_rank, 4, dtype=torch.float64, device=engine.device)
    if run.pipeline:  # only the last stage computed them
        dist.all_reduce(out, group=engine.grid.get_pipe_parallel_group())
    gathered = [torch.zeros_like(out) for _ in range(run.dp_size)]
    dist.all_gather(gathered, out, group=run.layout.gradient_group)
    return torch.cat(gathered)[:n].cpu().numpy()
