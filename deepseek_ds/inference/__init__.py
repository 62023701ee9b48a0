"""Using a trained checkpoint: eval.py (validation loss, perplexity, accuracy), generate.py (text), export.py (HF
directory, TorchScript, ONNX); cli.py registers their `deepseek-ds` commands."""
