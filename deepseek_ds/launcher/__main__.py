"""`python -m deepseek_ds.launcher preflight ...`: the launcher commands without the `deepseek-ds`
entry point (e.g. from a Slurm batch script, or before `pip install -e .`)."""

import argparse
import sys

from deepseek_ds.launcher.cli import register


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m deepseek_ds.launcher")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
