"""Command-line flags that several entry points share, declared once.

Spelling: flags that the `deepspeed` launcher also has keep DeepSpeed's spelling (--deepspeed_config, --num_gpus,
--master_port) and our own flags use dashes (--seq-len); every multi-word flag also accepts the other spelling
(--deepspeed-config, --num-gpus, --master-port), so nobody has to remember which is which.
"""

from __future__ import annotations

import argparse
import math

SET_HELP = ("override one run YAML value, e.g. --set train.steps=50 or --set model.overrides.hidden_size=1024 "
            "(repeatable; applied in order, after the YAML; values are parsed as YAML)")
CONFIG_HELP = "run YAML, e.g. recipes/tiny-v3.yaml"
DEEPSPEED_CONFIG_HELP = "DeepSpeed JSON, e.g. ds_configs/zero1.json (default: the run YAML's deepspeed_config)"


def spellings(flag: str) -> list[str]:
    """`--num_gpus` -> [`--num_gpus`, `--num-gpus`]: the given (documented) spelling first, then the other one."""
    name = flag[2:]
    other = name.replace("_", "-") if "_" in name else name.replace("-", "_")
    return [flag] if other == name else [flag, "--" + other]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 1-65535")
    return value


def add_run_args(p: argparse.ArgumentParser, *, config_required: bool = True, config_help: str = CONFIG_HELP,
                 set_help: str = SET_HELP, deepspeed_config: bool = True) -> None:
    """--config RUN.yaml, --deepspeed_config JSON and the repeatable --set SECTION.KEY=VALUE."""
    p.add_argument("--config", required=config_required, default=None, metavar="RUN.yaml", help=config_help)
    if deepspeed_config:
        p.add_argument(*spellings("--deepspeed_config"), default=None, metavar="JSON", help=DEEPSPEED_CONFIG_HELP)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=set_help)


def add_num_gpus(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, *aliases: str,
                 help: str = "ranks to start on this host (default: its GPUs, or 2 without CUDA)") -> None:
    p.add_argument(*spellings("--num_gpus"), *aliases, dest="num_gpus", type=positive_int, default=None,
                   metavar="N", help=help)


def add_hostfile(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, **kwargs) -> None:
    kwargs.setdefault("help", "DeepSpeed hostfile ('HOST slots=N' per line) for a multi-host run")
    p.add_argument("--hostfile", "-H", default=None, metavar="FILE", **kwargs)


def add_world_args(p: argparse.ArgumentParser) -> None:
    """Where the ranks run: --num_gpus N on this host, or --hostfile FILE (one of them)."""
    group = p.add_mutually_exclusive_group()
    add_num_gpus(group)
    add_hostfile(group)


def add_slot_filters(p: argparse.ArgumentParser) -> None:
    """--include / --exclude, as deepspeed's: which hosts and slots of the hostfile to use (one of them)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--include", "-i", default="", metavar="SPEC",
                       help="only these hosts/slots of the hostfile, e.g. 'node-0@node-1:0,2' (default: all)")
    group.add_argument("--exclude", "-e", default="", metavar="SPEC",
                       help="all hosts/slots of the hostfile but these, e.g. 'node-1:0' (default: none)")


def add_master_port(p: argparse.ArgumentParser, default: int | None = None,
                    help: str = "rendezvous port on the first host (default: DeepSpeed's, 29500)") -> None:
    p.add_argument(*spellings("--master_port"), dest="master_port", type=port, default=default, metavar="PORT",
                   help=help)


def add_local_rank(p: argparse.ArgumentParser) -> None:
    """--local_rank, which the `deepspeed` launcher passes to every rank (the rank reads LOCAL_RANK instead)."""
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
