"""Checkpoints through the real launcher: a rank killed mid-save, exact resume (ZeRO-1, ZeRO-3, PP=2; with dropout,
the RNG, in tests/test_resume_chain.py), stop on SIGTERM, resharding (2 ranks -> 1, PP=2 -> PP=1), refusal of a foreign
checkpoint, retention, and the CLI.

Launches are few and shared: each reference run also provides the checkpoints that the resume runs and
tests/test_export.py start from (session fixtures in conftest.py)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from deepseek_ds import checkpoint
from deepseek_ds.checkpoint import is_converted, universal_dir
from deepseek_ds.checkpoint.resuming import resume
from deepseek_ds.checkpoint.safe_load import trusted_types_only
from deepseek_ds.checkpoint.state import read_buffers
from helpers import (
    BIN,
    ROOT,
    checkpoint_sets,
    cli,
    free_port,
    fresh_ckpt_dir,
    launch_env,
    losses,
    read_metrics,
    router_biases,
    train,
)

GLOBAL_BATCH = 16  # recipes/tiny-v3.yaml


# ----------------------------------------------------------------------------------------------- atomic + exact
@pytest.mark.launch
def test_rank_killed_mid_save_leaves_latest_on_the_complete_checkpoint(zero1):
    assert zero1["proc"].returncode != 0
    assert sorted(zero1["losses"]) == [1, 2, 3, 4]  # the reference losses were all logged before the kill
    assert zero1["latest"] == "step00000002"
    assert ".step00000004.partial" in zero1["listing"] and "step00000004" not in zero1["listing"]
    assert checkpoint.latest_tag(str(zero1["ckpt"])) == "step00000002"


@pytest.mark.launch
def test_resume_after_the_kill_is_bitwise_exact_zero1(zero1, tmp_path, data_dir):
    """A new run in the same checkpoint.dir resumes from step 2 on its own and repeats steps 3-4 bit for bit."""
    ckpt = zero1["ckpt"]
    sets = checkpoint_sets(data_dir, 4, 2, f"checkpoint.dir={ckpt}", "checkpoint.keep=1")
    resumed = losses(train(2, str(tmp_path / "out"), sets))
    assert resumed == {3: zero1["losses"][3], 4: zero1["losses"][4]}
    listing = sorted(os.listdir(ckpt))
    assert ".step00000004.partial" not in listing  # cleaned on resume
    assert "step00000002" not in listing  # retention: keep=1
    assert (ckpt / "latest").read_text() == "step00000004"
    tag = ckpt / "step00000004"
    meta = checkpoint.read_meta(str(tag))
    assert meta["step"] == 4 and meta["consumed_samples"] == 4 * GLOBAL_BATCH
    assert meta["layout"]["data_parallel"] == 2 and meta["layout"]["zero_stage"] == 1
    from deepseek_ds.data import dataset_info

    assert meta["tokenizer_hash"] == dataset_info(data_dir)["tokenizer_hash"]
    assert sorted(os.listdir(tag / "rng")) == ["rank_00000.pt", "rank_00001.pt"]
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    biases = [k for k in states["module"] if k.endswith("e_score_correction_bias")]
    assert len(biases) == 3  # tiny-v3: decoder layers 1-3 are MoE
    assert set(read_buffers(str(tag))) == {f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                                                      for i in (1, 2, 3)}


@pytest.mark.launch
def test_resume_on_one_rank_reshards_zero1(zero1, tmp_path, data_dir):
    """dp 2 -> 1 through an automatic universal conversion; step 4 also checks that Adam's moments followed."""
    ckpt = fresh_ckpt_dir(zero1["step2"], tmp_path / "ckpt")
    records = train(1, str(tmp_path / "out"), checkpoint_sets(data_dir, 4, 2, f"checkpoint.dir={ckpt}"))
    resumed = losses(records)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - zero1["losses"][step]) < 1e-5
    # The universal checkpoint holds parameters only: the router biases came back from buffers/*.safetensors.
    bias = router_biases(records)[3]
    assert bias and any(abs(v) > 0 for v in bias.values())
    assert bias == pytest.approx(zero1["biases"][3], abs=1e-7)
    assert is_converted(universal_dir(str(ckpt / "step00000002"), "sequential"))
    assert checkpoint.read_meta(str(ckpt / "step00000004"))["layout"]["data_parallel"] == 1


@pytest.mark.launch
def test_sigterm_stops_cleanly_and_resume_is_bitwise_exact_zero3(zero3, tmp_path, data_dir):
    """Resume the ZeRO-3 run from step 4, saving every step in the background (checkpoint.async), SIGTERM every rank
    (as a scheduler does) once step 5 is logged: the ranks finish a step, wait for its background save to be
    published and exit 0; every loss up to there equals the uninterrupted run's bit for bit."""
    ckpt = fresh_ckpt_dir(zero3["step4"], tmp_path / "ckpt")
    out = tmp_path / "out"
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
           "--config", "recipes/tiny-v3.yaml", "--deepspeed_config", "ds_configs/zero3.json",
           "--set", f"train.output_dir={out}"]
    for s in checkpoint_sets(data_dir, 8, 1, f"checkpoint.dir={ckpt}", "checkpoint.async=true"):
        cmd += ["--set", s]
    with open(tmp_path / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=log, stderr=subprocess.STDOUT)
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None:
            assert time.monotonic() < deadline, "no step logged in 300 s"
            time.sleep(0.05)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())
                 and "deepspeed.launcher" not in " ".join(p.cmdline())]
        assert len(ranks) == 2
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    assert rc == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    resumed = losses(read_metrics(str(out)))
    stopped = max(resumed)
    assert 5 <= stopped < 8, f"stopped at step {stopped}: the signal was not acted on before the end"
    assert resumed == {s: zero3["losses"][s] for s in range(5, stopped + 1)}
    assert checkpoint.latest_tag(str(ckpt)) == checkpoint.tag_for(stopped)
    meta = checkpoint.read_meta(str(ckpt / checkpoint.tag_for(stopped)))
    assert meta["step"] == stopped and meta["consumed_samples"] == stopped * GLOBAL_BATCH
    assert f"saved checkpoint step {stopped} in the background" in (tmp_path / "launcher.log").read_text()
    assert cli(["checkpoint", "verify", str(ckpt)]) == 0


@pytest.mark.launch
def test_resume_is_bitwise_exact_pipeline(pipeline, tmp_path, data_dir):
    ckpt = fresh_ckpt_dir(pipeline["step2"], tmp_path / "ckpt")
    sets = checkpoint_sets(data_dir, 4, 2, f"checkpoint.dir={ckpt}", "parallel.pipeline_stages=2")
    resumed = losses(train(2, str(tmp_path / "out"), sets, "ds_configs/zero1_pp.json"))
    assert resumed == {3: pipeline["losses"][3], 4: pipeline["losses"][4]}
    assert sorted(os.listdir(ckpt / "step00000004" / "buffers")) == ["stage_00.safetensors", "stage_01.safetensors"]


@pytest.mark.launch
def test_reshard_cli_then_resume_pipeline_on_one_stage(pipeline, tmp_path, data_dir, capsys):
    """PP=2 -> PP=1: `deepseek-ds checkpoint reshard` renames the pipeline's parameters (`<i>.key`) to
    SequentialLM's (`layers.<i>.key`) through their HF names; the resumed run uses that conversion."""
    ckpt = fresh_ckpt_dir(pipeline["step2"], tmp_path / "ckpt")
    assert cli(["checkpoint", "reshard", str(ckpt), "--pipeline-stages", "1", "--workers", "1"]) == 0
    uni = Path(universal_dir(str(ckpt / "step00000002"), "sequential"))
    assert (uni / "zero" / "layers.1.layer.self_attn.kv_a_proj_with_mqa.weight" / "fp32.pt").is_file()
    assert not (uni / "zero" / "1.layer.self_attn.kv_a_proj_with_mqa.weight").exists()
    converted_at = (uni / "universal.json").stat().st_mtime_ns
    resumed = losses(train(1, str(tmp_path / "out"), checkpoint_sets(data_dir, 4, 2, f"checkpoint.dir={ckpt}")))
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - pipeline["losses"][step]) < 1e-5
    assert (uni / "universal.json").stat().st_mtime_ns == converted_at  # reused, not converted again
    capsys.readouterr()
    assert cli(["checkpoint", "list", str(ckpt)]) == 0
    listing = capsys.readouterr().out
    assert "step00000002" in listing and "universal: sequential" in listing and "dp=1 pp=1" in listing


# ----------------------------------------------------------------------------------------------- in-process
@pytest.mark.launch
def test_foreign_checkpoint_is_refused(zero1, tmp_path, data_dir):
    """resume() itself (in a world of one) refuses another model before touching the engine; the message names
    every differing field, and the tokenizer."""
    import logging
    import types

    import torch.distributed as dist

    from deepseek_ds.config import load_run_config
    from deepseek_ds.models.pipeline import prepare_config
    from deepseek_ds.models.presets import build_model_config

    ckpt = fresh_ckpt_dir(zero1["step2"], tmp_path / "ckpt")
    other = {"num_hidden_layers": 3, "hidden_size": 64}
    run = types.SimpleNamespace(cfg=load_run_config("recipes/tiny-v3.yaml", [f"checkpoint.dir={ckpt}"]), rank=0, world=1,
                                log=logging.getLogger("test"), dataset_dir=data_dir, engine=None,
                                model_config=prepare_config(build_model_config("tiny-v3", overrides=other)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        with pytest.raises(checkpoint.CheckpointError) as err:
            resume(run)
    finally:
        dist.destroy_process_group()
    text = str(err.value)
    assert "model config num_hidden_layers: checkpoint 4, this run 3" in text
    assert "model config hidden_size: checkpoint 128, this run 64" in text
    assert "tokenizer hash" not in text  # same data: only the model differs

    tag = str(zero1["step2"])
    meta = checkpoint.read_meta(tag)
    with pytest.raises(checkpoint.CheckpointError, match=f"tokenizer hash: checkpoint {meta['tokenizer_hash'][:12]}.*"
                                                          "this run ffffffffffff"):
        checkpoint.check_compatible(tag, meta, build_model_config("tiny-v3"), "f" * 64)
    checkpoint.check_compatible(tag, meta, build_model_config("tiny-v3"), meta["tokenizer_hash"])  # its own: fine


@pytest.mark.unit
def test_latest_tag_skips_incomplete_directories(tmp_path):
    def tag(name: str, complete: bool):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / checkpoint.META).write_text(json.dumps({"format_version": checkpoint.FORMAT_VERSION}))

    tag("step00000002", True)
    tag("step00000004", False)  # hand-made or from older code: no checkpoint.json
    tag(".step00000006.partial", False)
    (tmp_path / "latest").write_text("step00000004")
    assert checkpoint.complete_tags(str(tmp_path)) == ["step00000002"]
    assert checkpoint.latest_tag(str(tmp_path)) == "step00000002"
    assert checkpoint.latest_tag(str(tmp_path / "missing")) is None


@pytest.mark.unit
def test_the_layout_record_round_trips_and_older_records_take_their_run_configs_degrees():
    """A checkpoint's layout is the one Layout type (plan's and the run's), saved as its dict. Records written before
    it held sequence parallelism and the batch shape read the degrees from the run config; DeepSpeed's files depend on
    neither the batch shape nor how its data-parallel ranks split into replicas and sequence ranks."""
    import dataclasses

    from deepseek_ds.parallel.degrees import Layout

    lay = Layout(4, 2, 1, 2, 2, 1, "bf16", (0, 3, 6), micro_batch=2, grad_accum=4)
    assert checkpoint.saved_layout({"layout": json.loads(json.dumps(dataclasses.asdict(lay))), "run_config": {}}) == lay
    old = {"data_parallel": 4, "pipeline_stages": 1, "pipeline_parts": None, "zero_stage": 1, "precision": "bf16"}
    got = checkpoint.saved_layout({"layout": old, "run_config": {"parallel": {"sequence_parallel": 2,
                                                                              "expert_parallel": 2}}})
    assert (got.replicas, got.sequence_parallel, got.expert_parallel, got.micro_batch) == (2, 2, 2, None)
    assert got.same_files(Layout(4, expert_parallel=2, zero_stage=1, precision="bf16", micro_batch=8, grad_accum=1))
    assert not got.same_files(dataclasses.replace(got, zero_stage=2))
    assert not got.same_files(dataclasses.replace(got, pipeline_parts=(0, 2, 4)))


class _Payload:
    """Unpickling this creates a directory: proof that the pickle's code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.launch
def test_tampered_checkpoint_is_never_unpickled(zero1, tmp_path):
    """A model-states file replaced by a pickle carrying code: DeepSpeed would torch.load it with
    weights_only=False; under trusted_types_only the code does not run."""
    from deepseek_ds.inference.export import export_hf

    ckpt = fresh_ckpt_dir(zero1["step2"], tmp_path / "ckpt")
    marker = tmp_path / "code-ran"
    torch.save({"module": _Payload(str(marker))}, ckpt / "step00000002" / "mp_rank_00_model_states.pt")
    with pytest.raises(pickle.UnpicklingError):
        export_hf(str(ckpt), str(tmp_path / "hf"), work_dir=str(tmp_path))
    with pytest.raises(pickle.UnpicklingError), trusted_types_only():
        torch.load(ckpt / "step00000002" / "mp_rank_00_model_states.pt", weights_only=False)
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # restored on the way out


@pytest.mark.launch
def test_checkpoint_bench_prints_save_load_and_raw_rows(data_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "deepseek_ds.bench.checkpoint_bench", "--set", f"data.path={data_dir}",
                           "--repeats", "1", "--work-dir", str(tmp_path)], cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("checkpoint ", "raw ", "training step"))]
    assert [r.split("  ")[0] for r in rows] == [
        "checkpoint save, synchronous (DeepSpeed + RNG + fsync + publish)",
        "checkpoint save, checkpoint.async: the step blocked", "checkpoint save, checkpoint.async: durable and published",
        "raw sequential write + fsync", "checkpoint load (resume)", "raw sequential read (cache dropped)",
        "training step, an async save in flight", "training step alone"]
    cells = [[c.strip() for c in r.split("  ") if c.strip()] for r in rows]
    assert len({c[1] for c in cells}) == 1 and float(cells[0][1]) > 0.001  # the same GB on every row
    assert all(float(c[2]) > 0 for c in cells)
    assert "peak memory" in proc.stdout and "DeepSeek-V3 (684B parameters" in proc.stdout
