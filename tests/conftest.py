"""Shared, session-scoped fixtures: the expensive things (a prepared corpus) are built once."""

import os

import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    """A small built-in (stdlib) corpus with the tiny models' 2048-token BPE, prepared once per session."""
    from deepseek_ds.data import ensure_builtin_dataset

    cache = os.environ.get("DEEPSEEK_DS_TEST_DATA") or str(tmp_path_factory.mktemp("data_cache"))
    return ensure_builtin_dataset(cache, vocab_size=2048, max_mb=1.0, progress=False)
