"""`deepseek-ds checkpoint list|verify|reshard`: inspect a run's checkpoints; check their files against the sizes and
checksums recorded when they were saved; convert one ahead of a resume on another layout (training converts on its own when it finds the layout changed; doing it here keeps that work off the
job's clock)."""

from __future__ import annotations

import argparse
import os

from .format import (
    PIPELINE,
    SCHEMES,
    SEQUENTIAL,
    CheckpointError,
    complete_tags,
    is_converted,
    read_meta,
    saved_layout,
    tag_dir_of,
    universal_dir,
)
from .integrity import check_tag


def _size_gb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 1e9


def _tags(checkpoint_dir: str) -> list[str]:
    """The complete tags of a checkpoint directory, oldest first (saying so when there are none)."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a directory; pass the checkpoint.dir of a training run")
    tags = complete_tags(checkpoint_dir)
    if not tags:
        print(f"{checkpoint_dir}: no complete checkpoints")
    return tags


def cmd_list(args: argparse.Namespace) -> int:
    for tag in _tags(args.checkpoint_dir):
        tag_dir = os.path.join(args.checkpoint_dir, tag)
        meta = read_meta(tag_dir)
        converted = [s for s in SCHEMES if is_converted(universal_dir(tag_dir, s))]
        print(f"{tag}  step {meta['step']:>8}  samples {meta['consumed_samples']:>10}  "
              f"{saved_layout(meta).describe():<28} {_size_gb(tag_dir):8.3f} GB  {meta['saved_at']}"
              + (f"  universal: {', '.join(converted)}" if converted else ""))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """A table of every complete tag (files, bytes, OK/DAMAGED and the first bad file); 1 when the newest is
    damaged (a resume would fall back to an older one), else 0."""
    tags = _tags(args.checkpoint_dir)
    if not tags:
        return 0
    checks = [check_tag(os.path.join(args.checkpoint_dir, tag)) for tag in tags]
    print(f"{'tag':<16} {'files':>6} {'bytes':>14}  status")
    for tag, c in zip(tags, checks):
        status = "OK" if c.ok and c.recorded else "OK (no sizes or checksums recorded)" if c.ok else \
            f"DAMAGED: {c.problem}"
        print(f"{tag:<16} {c.files:>6} {c.bytes:>14}  {status}")
    return 0 if checks[-1].ok else 1


def cmd_reshard(args: argparse.Namespace) -> int:
    # Imported here: deepspeed and transformers take seconds to import, which every other `deepseek-ds` command
    # (and `--help`) would pay at start-up.
    from ..models.presets import build_model_config
    from .universal import to_universal

    tag_dir = tag_dir_of(args.checkpoint)
    scheme = PIPELINE if args.pipeline_stages > 1 else SEQUENTIAL
    out = to_universal(tag_dir, scheme, build_model_config(path=tag_dir), workers=args.workers)
    print(f"{out}: universal checkpoint for pipeline_stages={args.pipeline_stages} (any data-parallel size); "
          f"a run with checkpoint.dir={os.path.dirname(tag_dir)} resumes from it")
    return 0


def register(subparsers) -> None:
    """Add `checkpoint` (list, verify, reshard) to the `deepseek-ds` sub-commands."""
    group = subparsers.add_parser("checkpoint", help="list or verify checkpoints; convert one for another layout"
                                  ).add_subparsers(
        dest="checkpoint_command", metavar="SUBCOMMAND", required=True)
    p = group.add_parser("list", help="complete checkpoints of a checkpoint.dir with step, layout and size")
    p.add_argument("checkpoint_dir")
    p.set_defaults(func=cmd_list)
    p = group.add_parser("verify", help="check every checkpoint's files against their recorded sizes and checksums "
                                        "(exit 1 when the newest is damaged)")
    p.add_argument("checkpoint_dir")
    p.set_defaults(func=cmd_verify)
    p = group.add_parser("reshard", help="universal checkpoint for another data-parallel size / pipeline layout")
    p.add_argument("checkpoint", help="checkpoint.dir of a run (its newest complete step) or one step directory")
    p.add_argument("--pipeline-stages", type=int, required=True, help="parallel.pipeline_stages of the resuming run")
    p.add_argument("--workers", type=int, default=4, help="processes extracting and merging optimizer shards")
    p.set_defaults(func=cmd_reshard)
