"""ZeRO-3 builds the model under deepspeed.zero.Init and loads model.path one gathered layer at a time: each rank
holds only its partition from the start, and training still starts from the directory's weights exactly.
(test_equivalence.py's zero3 layout checks the seeded start against the single-process reference.)"""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from deepseek_ds.config import load_run_config
from helpers import train, training_loss
from reference import reference_model

SETS = ["train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=64", "checkpoint.interval=0",
        "eval.interval=0", "train.steps=2"]


@pytest.mark.launch
def test_zero3_partitions_at_build_and_loads_an_hf_directory(data_dir, tmp_path):
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={data_dir}"])
    model, _ = reference_model(cfg)
    with torch.no_grad():  # other weights than the seeded init: the first loss proves they were loaded
        for p in model.parameters():
            p.mul_(1.5)
        # Router biases that change which experts are chosen: every rank must route with them, not only the reader.
        biases = [b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")]
        assert biases
        for b in biases:
            b.copy_(torch.linspace(-0.5, 0.5, b.numel()))
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir, max_shard_size="500KB")
    records = train(2, str(tmp_path / "run"), SETS + [f"data.path={data_dir}", f"model.path={hf_dir}",
                                                      "model.preset=null"], ds_config="ds_configs/zero3.json")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert records[0]["loss"] == pytest.approx(training_loss(hf, data_dir, 1, seq_len=64, global_batch=8,
                                                             micro_batch=2), rel=1e-5)
    assert records[1]["loss"] < records[0]["loss"]  # it trains from there
    total = sum(p.numel() for p in hf.parameters())
    held = []
    for rank in (0, 1):
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        m = re.search(r"ZeRO-3: built partitioned .*: this rank holds (\d+) of (\d+) parameter elements", log)
        assert m and int(m.group(2)) == total, log[-2000:]
        held.append(int(m.group(1)))
        # Rank 0 reads each gathered layer; the others read nothing and get their partition from it.
        read = float(re.search(r"loaded ([\d.]+) MB of weights", log).group(1))
        assert (read > 0) if rank == 0 else (read == 0)
    # Each rank holds its half (DeepSpeed pads every parameter to a multiple of the world size).
    assert total <= sum(held) < total + 2 * len(list(hf.parameters()))
    assert max(held) < 0.51 * total
