"""`deepseek-ds`: the toolkit's sub-commands, each a thin call into the modules that do the work."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from .config import ConfigError


def _world_size(args) -> int:
    if args.hostfile:
        from deepspeed.launcher.runner import fetch_hostfile

        hosts = fetch_hostfile(args.hostfile)
        if not hosts:
            raise ConfigError(f"--hostfile {args.hostfile!r} names no hosts (format: 'node-0 slots=8' per line)")
        return sum(hosts.values())
    return args.num_gpus or _local_devices()


def _local_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def cmd_validate(args) -> int:
    from .training.main import load_and_validate

    cfg, ds = load_and_validate(args, _world_size(args))
    print(f"OK: {args.config} with {cfg.deepspeed_config} on {_world_size(args)} ranks "
          f"(global batch {ds['train_batch_size']} = micro {ds['train_micro_batch_size_per_gpu']} x "
          f"grad-accum {ds['gradient_accumulation_steps']} x data-parallel)")
    return 0


def cmd_train(args) -> int:
    """Validate, then hand over to the DeepSpeed launcher (the same command a user would type)."""
    cmd_validate(args)
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    argv = [launcher]
    argv += ["--hostfile", args.hostfile] if args.hostfile else ["--num_gpus", str(_world_size(args))]
    argv += ["train.py", "--config", args.config]
    if args.deepspeed_config:
        argv += ["--deepspeed_config", args.deepspeed_config]
    for s in args.set:
        argv += ["--set", s]
    print(" ".join(argv), flush=True)
    os.execv(argv[0], argv)
    return 0  # not reached


def cmd_models_list(args) -> int:
    from .models.presets import PRESETS

    for name, p in PRESETS.items():
        print(f"{name:<22} {p.config_cls.model_type:<12} {p.description}")
    return 0


def cmd_models_partition(args) -> int:
    from .models.pipeline import partition, partition_table, prepare_config
    from .models.presets import build_model_config

    cfg = prepare_config(build_model_config(args.preset, args.path))
    parts = partition(cfg, args.stages, args.method, args.seq_len)
    print(f"{args.path or args.preset}: {args.stages} stages, method {args.method}")
    print(partition_table(cfg, parts, args.seq_len))
    return 0


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="run YAML, e.g. recipes/tiny-v3.yaml")
    p.add_argument("--deepspeed_config", default=None, help="DeepSpeed JSON (default: the run YAML's deepspeed_config)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--num_gpus", "--num-gpus", type=int, default=None, help="local ranks (default: GPUs, or 2 on CPU)")
    g.add_argument("--hostfile", default=None, help="DeepSpeed hostfile for a multi-host run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepseek-ds", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("train", help="validate a run, then start it with the DeepSpeed launcher")
    _add_run_args(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("validate", help="check a run YAML + DeepSpeed JSON + world size without starting anything")
    _add_run_args(p)
    p.set_defaults(func=cmd_validate)

    models = sub.add_parser("models", help="model presets and pipeline partitions").add_subparsers(
        dest="models_command", metavar="SUBCOMMAND", required=True)
    models.add_parser("list", help="list the model presets").set_defaults(func=cmd_models_list)
    p = models.add_parser("partition", help="print the pipeline partition table (meta device: no memory needed)")
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--path", default=None, help="a local HF directory instead of a preset")
    p.add_argument("--stages", type=int, default=16)
    p.add_argument("--method", default="balanced")
    p.add_argument("--seq-len", type=int, default=4096)
    p.set_defaults(func=cmd_models_partition)

    _register_optional(sub)
    return parser


def _register_optional(sub) -> None:
    """Sub-commands that live with their own modules (each module's register() adds its parsers)."""
    from .checkpoint import cli as checkpoint_cli
    from .inference import cli as inference_cli
    from .bench import checkpoint_bench, data_bench, pipeline_bench, zero_bench
    from .data import cli as data_cli
    from .launcher import cli as launcher_cli

    data = sub.add_parser("data", help="prepare and inspect tokenized datasets").add_subparsers(
        dest="data_command", metavar="SUBCOMMAND", required=True)
    data_cli.register(data)
    for module in (launcher_cli, checkpoint_cli, inference_cli):
        module.register(sub)
    bench = sub.add_parser("bench", help="benchmarks that print tables and write reports").add_subparsers(
        dest="bench_command", metavar="SUBCOMMAND", required=True)
    for module in (data_bench, checkpoint_bench, zero_bench, pipeline_bench):
        module.register(bench)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"deepseek-ds: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
