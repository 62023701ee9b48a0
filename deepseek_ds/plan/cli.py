"""`deepseek-ds plan`: will this run fit, and which layout is fastest? Also the one-line verdict that `validate` and
`train` print for the run they check."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
from deepspeed.accelerator import get_accelerator

from ..config import ConfigError, load_ds_config, load_run_config, precision, validate
from ..launcher.hostfile import read_hostfile, select_slots
from ..launcher.world import world_size
from ..models.presets import PRESETS
from ..utils.cli_args import add_hostfile, add_num_gpus, add_run_args, add_slot_filters, positive_int, spellings
from ..utils.errors import UserError
from ..utils.fmt import parse_bytes
from . import report
from .comm import comm_json
from .estimate import attention_is_fused, estimate, layout_line, layout_of
from .params import SpecParams
from .steptime import DEFAULT_GPU, GPUS, Hardware, search, step_time

_LAYOUT_KEYS = {"pp": "parallel.pipeline_stages", "ep": "parallel.expert_parallel", "tp": "parallel.tensor_parallel",
                "sp": "parallel.sequence_parallel", "micro": "train.micro_batch_size"}


class PlanError(UserError):
    pass


def memory_size(text: str) -> int:
    """'80GB' -> bytes (utils.fmt.parse_bytes)."""
    size = parse_bytes(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"--gpu-memory {text!r}: a size such as 80GB, 24GiB or 81559MiB")
    return size


def layout_sets(text: str) -> tuple[list[str], int | None]:
    """--layout pp=16,ep=64,tp=1,sp=1,zero=1,micro=1 -> the --set overrides it means, and the ZeRO stage (if
    given)."""
    sets, zero = [], None
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in (*_LAYOUT_KEYS, "zero") or not value.isdigit():
            raise PlanError(f"--layout {text!r}: {item!r} is not KEY=N with KEY one of pp, ep, tp, sp, zero, micro; "
                            "e.g. --layout pp=16,ep=64,tp=1,zero=1,micro=1")
        if key == "zero":
            zero = int(value)
        else:
            sets.append(f"{_LAYOUT_KEYS[key]}={value}")
    return sets, zero


def local_memory(world: int, cpu: bool) -> int:
    """This host's accelerator memory per rank: the first GPU's, or on the CPU accelerator the RAM shared by the
    ranks."""
    if not cpu:
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(world, 1)


def run_verdict(cfg, world: int, gpu_memory: int | None, strict: bool, hostfile: str | None) -> str:
    """The plan's verdict for a run validate() accepted; --strict turns DOES NOT FIT into a PlanError. Without
    --gpu-memory it compares against this host's memory where that is the run's: the ranks run here (no hostfile) on
    DeepSpeed's accelerator of this process, or this host has a GPU; a GPU-less login node knows nothing of the
    hostfile's GPUs."""
    cpu_run = not hostfile and get_accelerator().device_name() == "cpu"
    if gpu_memory is None and not cpu_run and not torch.cuda.is_available():
        return "plan: unknown GPU memory (pass --gpu-memory SIZE, e.g. --gpu-memory 80GB, for the plan's verdict)"
    ds = load_ds_config(cfg.deepspeed_config)
    plan = estimate(cfg, ds, layout_of(cfg, ds, world), gpu_memory or local_memory(world, cpu_run),
                    attention_is_fused(cfg, cpu_run), cpu=cpu_run)
    line = report.verdict(plan)
    if strict and not plan.fits:
        raise PlanError(line + "; lower train.micro_batch_size, raise the ZeRO stage or parallelism, or see "
                        "`deepseek-ds plan --search`")
    return line if plan.fits else "warning: " + line


def _preset_of_path(path: str) -> str | None:
    """The preset a model directory's name names (DeepSeek-V2-Lite, deepseek-coder-6.7b-base: the longest preset
    name it starts with), if any."""
    base = os.path.basename(os.path.normpath(path)).lower()
    named = [p for p in PRESETS if base == p or base.startswith(p + "-")]
    return max(named, key=len) if named else None


def _absent_model_as_preset(cfg) -> None:
    """A model.path this machine lacks (a cluster's /models/...) is planned from its preset: model.preset, else the
    one its directory name names; said in one line."""
    path = cfg.model.path
    if not path or os.path.isdir(path):
        return
    preset = cfg.model.preset or _preset_of_path(path)
    if preset is None:
        raise PlanError(f"model.path {path} is not on this machine and names no preset: set model.preset to the "
                        f"architecture to plan (--set model.preset=NAME; one of {', '.join(sorted(PRESETS))}), or "
                        "plan where the model directory is")
    cfg.model = dataclasses.replace(cfg.model, path=None, preset=preset)
    print(f"note: model.path {path} is not on this machine: planning from the {preset} preset", file=sys.stderr)


def _plan(args: argparse.Namespace) -> tuple:
    """(run config, DeepSpeed JSON, world size) of the layout asked for, checked by validate()."""
    world = args.gpus or world_size(args.num_gpus, args.hostfile, args.include, args.exclude)
    sets, zero = layout_sets(args.layout) if args.layout else ([], None)
    cfg = load_run_config(args.config, args.set + sets)
    _absent_model_as_preset(cfg)
    cfg.deepspeed_config = args.deepspeed_config or cfg.deepspeed_config
    ds = load_ds_config(cfg.deepspeed_config)
    if zero is not None:
        ds.setdefault("zero_optimization", {})["stage"] = zero
    validate(cfg, ds, world, cuda_available=not args.cpu, files=False)
    return cfg, ds, world


def gpus_per_node(args: argparse.Namespace) -> int:
    """GPUs of one node: a hostfile's fewest selected slots on a host (a group that fits there fits in every node),
    --num_gpus (one host), else --gpus-per-node or 8."""
    if args.hostfile:
        slots = select_slots(read_hostfile(args.hostfile), args.include or "", args.exclude or "")
        return min(len(s) for s in slots.values())
    return args.num_gpus or args.gpus_per_node or 8


def hardware_assumed(args: argparse.Namespace) -> tuple[int, float, str]:
    """(memory per GPU, peak TFLOP/s, where that peak comes from) of --gpu-memory, --peak-tflops and --gpu: the
    explicit flags win over the preset's figures; without either the peak is an H100's, and the plan says so."""
    gpu = GPUS.get(args.gpu)
    memory = args.gpu_memory or (gpu.memory if gpu else None)
    if memory is None:
        raise PlanError(f"the plan needs each GPU's memory: pass --gpu-memory SIZE or --gpu NAME "
                        f"(one of {', '.join(GPUS)})")
    if args.peak_tflops:
        return memory, args.peak_tflops, f"{args.peak_tflops:g} TFLOP/s (--peak-tflops)"
    if gpu:
        return memory, gpu.peak_tflops, (f"{gpu.peak_tflops:g} TFLOP/s bf16 dense peak of the --gpu {args.gpu} "
                                         f"preset ({gpu.name})")
    peak = GPUS[DEFAULT_GPU].peak_tflops
    return memory, peak, (f"{peak:g} TFLOP/s assumed (an H100's bf16 dense peak): pass --gpu or --peak-tflops for "
                          "yours")


def cmd_plan(args: argparse.Namespace) -> int:
    if args.gpus_per_node and (not args.gpus or args.gpus % args.gpus_per_node):
        raise PlanError(f"--gpus-per-node {args.gpus_per_node} needs --gpus N, a multiple of it")
    memory, peak, peak_source = hardware_assumed(args)
    try:
        cfg, ds, world = _plan(args)
    except ConfigError as e:
        raise PlanError(f"this layout is not valid for {args.config}: {e}") from e
    hw = Hardware(peak, args.mfu, args.bandwidth * 1e9, args.intra_bandwidth * 1e9, gpus_per_node(args))
    model = SpecParams(cfg.model.hf_config)
    assumed = {"gpu": args.gpu, "peak_tflops": peak, "mfu": args.mfu}
    if precision(ds) == "fp32" and not args.peak_tflops:
        peak_source += " (the run is fp32, whose matmuls do not reach it: pass --peak-tflops for fp32/TF32)"
    if args.search:
        found = search(cfg, ds, world, memory, hw, args.cpu, model)
        if args.json:
            print(json.dumps([{**report.as_json(p), **assumed, "step_time_s": t.total_s} for p, t in found[:args.top]],
                             indent=2))
        elif not found:
            print(f"no valid layout of {world} GPUs fits in {memory} bytes each")
        else:
            print(f"{len(found)} valid layouts of {world} GPUs fit; the fastest (MFU {args.mfu:.0%} of {peak_source}, "
                  f"{args.bandwidth:g} GB/s between nodes, {args.intra_bandwidth:g} GB/s inside one, communication "
                  "not overlapped):")
            print(report.ranking(found, args.top))
        return 0 if found else 1
    plan = estimate(cfg, ds, layout_of(cfg, ds, world), memory, attention_is_fused(cfg, args.cpu), model, cpu=args.cpu)
    t = step_time(cfg, plan, hw, model, ds)
    comm = comm_json(cfg, ds, plan, model)
    if args.json:
        print(json.dumps({**report.as_json(plan), **assumed, "step_time_s": t.total_s,
                          "bandwidth_bytes_per_s": {"between_nodes": hw.bandwidth, "inside_node": hw.intra_bandwidth},
                          "comm_bytes": comm}, indent=2))
    else:
        muon = ", Muon" if plan.optimizer == "Muon" else ""  # AdamW, the default, goes unsaid
        print(f"{plan.model}, {plan.precision}{muon}, {world} GPUs: {layout_line(plan.layout)}")
        print(report.table(plan))
        if args.cpu:
            print(report.RUNTIME_NOTE)
        print(report.verdict(plan).removeprefix("plan: "))
        print("estimated " + report.why(plan, t))
        print(report.comm_line(comm))
        print(f"compute at MFU {args.mfu:.0%} of {peak_source}")
    return 0 if plan.fits else 1


def add_verdict_args(p: argparse.ArgumentParser) -> None:
    """validate / train: the memory the verdict compares against, and --strict."""
    p.add_argument(*spellings("--gpu-memory"), type=memory_size, default=None, metavar="SIZE",
                   help="memory per GPU for the plan's verdict, e.g. 80GB (default: this host's first GPU; on the "
                        "CPU accelerator its RAM / ranks; with a hostfile and no GPU here: no verdict)")
    p.add_argument("--strict", action="store_true", help="refuse the run when the plan says it does not fit "
                                                         "(default: a warning)")


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-rank memory and step-time estimates of a run's layout; --search ranks all "
                                    "valid layouts", description=__doc__)
    add_run_args(p)
    world = p.add_mutually_exclusive_group()
    add_num_gpus(world, help="ranks on this host")
    add_hostfile(world)
    world.add_argument("--gpus", type=positive_int, default=None, metavar="N", help="GPUs of a cluster (no hostfile)")
    p.add_argument(*spellings("--gpus-per-node"), type=positive_int, default=None, metavar="G",
                   help="with --gpus: GPUs per node (tensor and expert groups inside a node use --intra-bandwidth; "
                        "default 8; with --hostfile its slots per host, with --num_gpus all of them)")
    add_slot_filters(p)
    p.add_argument("--gpu", choices=list(GPUS), default=None,
                   help="a GPU's datasheet memory and bf16 dense peak (" +
                        "; ".join(f"{k}: {g.name}, {g.memory // 2**30} GB, {g.peak_tflops:g} TFLOP/s"
                                  for k, g in GPUS.items()) + "); --gpu-memory and --peak-tflops override them")
    p.add_argument(*spellings("--gpu-memory"), type=memory_size, default=None, metavar="SIZE",
                   help="memory per GPU, e.g. 80GB (GB = GiB); needed without --gpu")
    p.add_argument("--layout", default=None, metavar="pp=P,ep=E,tp=T,sp=S,zero=Z,micro=M",
                   help="this layout instead of the run config's (any subset of the keys)")
    p.add_argument("--search", action="store_true", help="rank every valid layout that fits by estimated step time")
    p.add_argument("--top", type=positive_int, default=5, help="--search: layouts printed (default 5)")
    p.add_argument("--json", action="store_true", help="one JSON object (with --search: a list, fastest first)")
    p.add_argument(*spellings("--peak-tflops"), type=float, default=None,
                   help="dense peak TFLOP/s per GPU in the run's precision (default: --gpu's, else "
                        f"{GPUS[DEFAULT_GPU].peak_tflops:g}, an H100's bf16)")
    p.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak the compute reaches (default 0.4)")
    p.add_argument("--bandwidth", type=float, default=50.0,
                   help="GB/s per GPU between nodes for collectives (default 50: 400 Gb/s InfiniBand)")
    p.add_argument(*spellings("--intra-bandwidth"), type=float, default=300.0,
                   help="GB/s per GPU inside a node (default 300: NVLink)")
    p.add_argument("--cpu", action="store_true", help="plan for DeepSpeed's CPU accelerator (no fused attention "
                                                      "kernel for MLA; a rank's peak is its process's resident set, "
                                                      "runtime included)")
    p.set_defaults(func=cmd_plan)
