"""deepseek-ds: train DeepSeek-family models with DeepSpeed. The sub-packages are layered; see README "Layout"."""

import os

# DeepSpeed JIT-builds its ops (cpu_adam, fused_adam, the shm comm op) into TORCH_EXTENSIONS_DIR, by default torch's
# ~/.cache/torch_extensions: set it here, on the first import of the package, so that every entry point (the CLI,
# train.py, `python -m deepseek_ds...`, bench workers) and the ranks they launch use the ops scripts/setup.sh built.
# A source checkout (an editable install: pyproject.toml beside this package) keeps them in its own
# .cache/torch_extensions, as setup.sh does; an installed package has no project directory of its own (not the
# current directory: every directory would rebuild them) and keeps torch's per-user default. A user's value wins.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "TORCH_EXTENSIONS_DIR" not in os.environ and os.path.isfile(os.path.join(_ROOT, "pyproject.toml")):
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(_ROOT, ".cache", "torch_extensions")

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
