"""`python -m deepseek_ds.launcher preflight ...`: the launcher commands without the `deepseek-ds` entry point
(e.g. from a Slurm batch script, or before `pip install -e .`)."""

from __future__ import annotations

import argparse
import sys

from deepseek_ds.launcher.cli import register
from deepseek_ds.utils.errors import run_command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepseek_ds.launcher")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_command(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
