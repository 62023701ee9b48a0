"""Train a DeepSeek-family model: `deepspeed --num_gpus 2 train.py --config recipes/tiny-v3.yaml`."""

import sys

from deepseek_ds.training.main import main

if __name__ == "__main__":
    sys.exit(main())
