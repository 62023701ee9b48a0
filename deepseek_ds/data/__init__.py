"""Data pipeline: inputs -> tokenizer -> parallel, checksummed shards -> packed memory-mapped samples
-> a resumable global-batch sampler sharded over data-parallel ranks.

Importing this package stays light (numpy, tqdm): torch, transformers and datasets load only when used.
"""

from .blend import BlendedDataset, open_training_data
from .builtin import ensure_builtin_dataset
from .errors import DataError
from .layout import dataset_info
from .packed import PackedDataset
from .prepare import prepare_dataset
from .prompts import PromptDataset
from .sampler import GlobalBatchSampler, micro_batch, micro_batches, sample_count
from .sft import ChatDataset, open_dataset
from .tokenizer import load_tokenizer

__all__ = ["DataError", "ensure_builtin_dataset", "prepare_dataset", "load_tokenizer", "dataset_info",
           "PackedDataset", "BlendedDataset", "ChatDataset", "PromptDataset", "open_dataset", "open_training_data",
           "GlobalBatchSampler", "micro_batch", "micro_batches", "sample_count"]
