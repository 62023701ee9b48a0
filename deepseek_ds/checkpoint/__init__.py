"""Checkpoints that survive anything: atomic save, retention, automatic resume (resharded through DeepSpeed
universal checkpoints when the parallel layout changed), refusal of foreign checkpoints.

  format.py        tags, checkpoint.json, the layout that wrote a checkpoint, compatibility with a run
  safe_load.py     torch.load without running pickled code (DeepSpeed's loads included)
  state.py         what DeepSpeed's files lack: RNG states, persistent buffers by HF name
  saving.py        save: write, flush, publish, prune
  resuming.py      resume: native or resharded, or refused with the fix
  tensor_names.py  DeepSpeed's tensor names of each container (and AutoEP's) <-> HF names
  universal.py     conversion into a DeepSpeed universal checkpoint for another layout
  weights.py       THE reader of a checkpoint's weights (export, eval, generate)
  integrity.py     every file's size and checksum (xxh3_64) in checkpoint.json; verification, fallback to an intact tag
  lock.py          one job per checkpoint.dir (a lock file naming its holder; stale ones taken over)
  cli.py           `deepseek-ds checkpoint list|verify|reshard`

Only format's names are re-exported here: the other modules import deepspeed and transformers, which the
`deepseek-ds` command line should not pay for at start-up.
"""

from .format import (
    FORMAT_VERSION,
    LATEST,
    META,
    MODEL_CONFIG,
    PIPELINE,
    SCHEMES,
    SEQUENTIAL,
    CheckpointError,
    check_compatible,
    complete_tags,
    current_layout,
    is_converted,
    latest_tag,
    model_fingerprint,
    read_meta,
    saved_layout,
    tag_dir_of,
    tag_for,
    universal_dir,
)

__all__ = ["FORMAT_VERSION", "LATEST", "META", "MODEL_CONFIG", "PIPELINE", "SCHEMES", "SEQUENTIAL", "CheckpointError",
           "check_compatible", "complete_tags", "current_layout", "is_converted", "latest_tag",
           "model_fingerprint", "read_meta", "saved_layout", "tag_dir_of", "tag_for", "universal_dir"]
