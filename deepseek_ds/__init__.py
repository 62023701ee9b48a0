"""deepseek-ds: train DeepSeek-family models with DeepSpeed. The sub-packages are layered; see README "Layout"."""

import os

import torch

# DeepSpeed guesses its accelerator at first import and, finding no GPU, warns "Setting accelerator to CPU" in
# every process (four times per 2-rank run). Without CUDA the answer is known: say it, so the warning (and the
# guess) goes away for this process and the ranks it launches. An explicit DS_ACCELERATOR always wins.
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"
