"""Start-up host memory per rank, ZeRO-3 (deepspeed.zero.Init) against ZeRO-1, on 2 local ranks, for full
training from the seeded start and (--lora R) for LoRA r=R on a base read from an HF directory this script writes:

    python scripts/zero3_startup_memory.py [--hidden 1024 --layers 12 --vocab 32256] [--lora 16] [--out REPORT.md]

Each stage is one `deepspeed` launch of this file's rank side, which runs the training set-up (build_run) and
records, on every rank: the process's peak RSS once the model is built (before the engine: what zero.Init saves),
whether its parameters were partitioned then, the parameter elements it holds, and the peak RSS once the engine
(optimizer state included) exists. A table of both stages is printed; nothing is timed. The ranks run with
MALLOC_MMAP_THRESHOLD_=1048576 (see driver) so that RSS shows what is held, not what glibc kept after a free.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def rank_side(args: argparse.Namespace) -> int:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    from deepseek_ds.config import load_and_validate
    from deepseek_ds.training import setup

    record = {}
    initialize = deepspeed.initialize

    def recording_initialize(*a, model, **kw):  # the moment between building the model and building the engine
        params = list(model.parameters())
        record.update(model_built_peak_gib=peak_rss_gib(), model_built_rss_gib=rss_gib(),
                      # LoRA's adapters, added after zero.Init, are partitioned by the engine
                      partitioned=("yes" if all(is_zero_param(p) for p in params) else
                                   "the base" if all(is_zero_param(p) for p in params if not p.requires_grad)
                                   and any(is_zero_param(p) for p in params) else "no"),
                      held_elements=sum(p.ds_tensor.numel() if is_zero_param(p) else p.numel() for p in params),
                      model_elements=sum(p.ds_numel if is_zero_param(p) else p.numel() for p in params))
        return initialize(*a, model=model, **kw)

    setup.deepspeed.initialize = recording_initialize
    cfg, ds = load_and_validate(os.path.join(ROOT, "recipes/tiny-v3.yaml"), args.ds_config, args.set,
                                int(os.environ["WORLD_SIZE"]))
    record["before_rss_gib"] = rss_gib()
    setup.build_run(cfg, ds)
    record["engine_built_peak_gib"] = peak_rss_gib()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def driver(args: argparse.Namespace) -> int:
    from deepseek_ds.utils.net import free_port
    from deepseek_ds.utils.system import deepspeed_executable, launch_env

    overrides = {"hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4,
                 "num_hidden_layers": args.layers, "vocab_size": args.vocab}
    common = [f"data.path={args.data}", "eval.interval=0", f"train.output_dir={args.work_dir}/out"]
    runs = [("full", ["model.preset=tiny-dense", *(f"model.overrides.{k}={v}" for k, v in overrides.items())])]
    if args.lora:
        runs.append((f"LoRA r={args.lora}", ["model.preset=null", f"model.path={_write_base(args.work_dir, overrides)}",
                                             f"lora.r={args.lora}"]))
    rows = []
    for training, sets in runs:
        for stage in (1, 3):
            result = os.path.join(args.work_dir, f"zero{stage}.json")
            cmd = [deepspeed_executable(), "--num_gpus", "2", "--master_port", str(free_port()),
                   os.path.abspath(__file__), "--rank-side", "--result", result,
                   "--ds-config", os.path.join(ROOT, f"ds_configs/zero{stage}.json")]
            for s in common + sets:
                cmd += ["--set", s]
            print(f"{training}, ZeRO-{stage}: 2 ranks ...", flush=True)
            # glibc keeps freed blocks below its self-raising mmap threshold in the heap, so RSS would still count
            # the layers zero.Init has already partitioned and freed; a fixed 1 MiB threshold hands them back.
            env = launch_env(OMP_NUM_THREADS="1",
                             MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "1048576"))
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                return 1
            with open(result) as f:
                rows += [(training, stage, rank, r) for rank, r in enumerate(json.load(f))]
    table = ["| training | ZeRO | rank | params (model) | params held | partitioned when built | RSS before build | "
             "RSS, model built | peak RSS, model built | peak RSS, engine built |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for training, stage, rank, r in rows:
        table.append(f"| {training} | {stage} | {rank} | {r['model_elements'] / 1e6:.0f}M | {r['held_elements'] / 1e6:.0f}M | "
                     f"{r['partitioned']} | {r['before_rss_gib']:.2f} GiB | "
                     f"{r['model_built_rss_gib']:.2f} GiB | {r['model_built_peak_gib']:.2f} GiB | "
                     f"{r['engine_built_peak_gib']:.2f} GiB |")
    print("\n" + "\n".join(table))
    if args.out:
        from deepseek_ds.bench.report import write_process_report

        write_process_report(args.out, "ZeRO-3 start-up host memory against ZeRO-1", (
            f"A dense model (tiny-dense with hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}), "
            "fp32, on 2 local ranks, one `deepspeed` launch per stage of this script's rank side, which runs the "
            "training set-up (build_run). Per rank: the parameters held once the model is built (ZeRO-3: under "
            "deepspeed.zero.Init, partitioned), the RSS before the build, once the model is built and its peak then, "
            "and the peak once the engine (optimizer states) exists. The ranks run with MALLOC_MMAP_THRESHOLD_="
            "1048576 so RSS shows what is held, not what glibc kept after a free; the host's environment below is "
            "the driver's. LoRA rows (--lora): the same model saved once as an HF directory by this script and read "
            "as model.path (ZeRO-3: rank 0 reads each gathered layer), attention and MLP adapters of rank r."),
            ["\n".join(table)])
        print(f"wrote {args.out}")
    return 0


def _write_base(work_dir: str, overrides: dict) -> str:
    """The dense model at its seeded initialisation as an HF directory: the base LoRA adapts."""
    from transformers import AutoModelForCausalLM

    from deepseek_ds.models.presets import build_model_config

    out = os.path.join(work_dir, "base")
    AutoModelForCausalLM.from_config(build_model_config("tiny-dense", None, overrides)).save_pretrained(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32256)
    p.add_argument("--lora", type=int, default=0, help="also LoRA of this rank on the same model, read from model.path")
    p.add_argument("--data", default=os.path.join(ROOT, "data_cache/stdlib-v2048-8.0mb"))
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=None, help="write the table as a report here (e.g. docs/bench/zero3-startup.md)")
    p.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--ds-config", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_side:
        return rank_side(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.work_dir = args.work_dir or tmp
        return driver(args)


if __name__ == "__main__":
    sys.exit(main())
