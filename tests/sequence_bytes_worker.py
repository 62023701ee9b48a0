"""One rank of a sequence-parallel forward on each tiny preset: the bytes autograd saves on this rank for its shard
of a [2, 96] batch (test_plan._saved_bytes), written by rank 0 as JSON to the path given, for test_plan's SP check."""

import argparse
import json

import torch

from deepseek_ds.models.pipeline import build_model, prepare_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.parallel import sequence
from deepseek_ds.parallel.degrees import Degrees
from deepseek_ds.parallel.layout import RankLayout
from deepseek_ds.training.process import init_distributed
from test_plan import MODELS, _saved_bytes

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--local_rank", type=int)  # the launcher's
    out = parser.parse_args().out
    rank, world = init_distributed()
    shard = RankLayout.create(Degrees(sequence=world), world, rank).sequence_shard
    saved = {}
    for preset in MODELS:
        mcfg = prepare_config(build_model_config(preset))
        model = build_model(mcfg, 1, 1).train()
        sequence.enable(model, shard)
        ids = torch.randint(0, mcfg.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
        saved[preset] = _saved_bytes(model, shard.take(ids), False)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(saved, f)
