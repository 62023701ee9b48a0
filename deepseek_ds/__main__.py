"""`deepseek-ds` and `python -m deepseek_ds`: the CLI, imported only when it runs. A console script imports its
entry module at the top, and every spawned worker process (data prepare's tokenizer workers) re-imports the parent's
main script: with the script pointing here, that re-import costs this file, not the whole CLI (deepspeed,
transformers: ~5 CPU seconds per worker)."""

import sys


def main() -> int:
    from .cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
