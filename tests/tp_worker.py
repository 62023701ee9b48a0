"""One rank of tests/test_tensor_parallel.py's 2-rank runs, all in one launch (layouts_worker.py: the real set-up and
training loop per layout), with one addition so that a layout can resume a checkpoint an earlier layout of the same
launch saved: --resume-from CKPT_DIR STEP_DIR (repeatable) gives the layout whose checkpoint.dir is CKPT_DIR a
checkpoint.dir holding only a copy of STEP_DIR, as helpers.fresh_ckpt_dir does between launches."""

import argparse
import contextlib
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from layouts_worker import run_layouts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume-from", nargs=2, action="append", default=[], metavar=("CKPT_DIR", "STEP_DIR"))
    ours, rest = parser.parse_known_args(argv)
    seeds = {f"checkpoint.dir={ckpt}": Path(step) for ckpt, step in ours.resume_from}

    @contextlib.contextmanager
    def around(layout: list[str]):
        seed = next((s for s in layout if s in seeds), None)
        if seed is not None:
            # An earlier layout of this launch saved it, so the process group is up: one rank copies, all wait.
            step, target = seeds[seed], Path(seed.split("=", 1)[1])
            if dist.get_rank() == 0:
                shutil.copytree(step, target / step.name)
            dist.barrier()
        yield

    return run_layouts(rest, around=around)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
