"""deepseek-ds: train DeepSeek-family models with DeepSpeed. The sub-packages are layered; see README "Layout"."""

import os

# DeepSpeed guesses its accelerator at first import and, finding no GPU, warns "Setting accelerator to CPU" in
# every process (four times per 2-rank run). Without CUDA the answer is known: say it, so the warning (and the
# guess) goes away for this process and the ranks it launches. An explicit DS_ACCELERATOR always wins. torch is
# imported only to decide, once: the processes started from this one inherit the answer (DS_ACCELERATOR, or with
# CUDA the mark that it was looked at), so a data-prepare worker that needs no torch does not pay its import
# (seconds of CPU each).
_LOOKED = "DEEPSEEK_DS_ACCELERATOR_LOOKED"
if "DS_ACCELERATOR" not in os.environ and _LOOKED not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ[_LOOKED] = "1"
