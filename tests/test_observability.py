"""Through real launches: per-step metrics, DeepSpeed monitors, MoE expert load, the NaN policy, and
validation numbers equal to a single-process transformers evaluation of the same weights.

Four launches in all (each check shares one): a 2-rank MoE run (ZeRO-1, gradient accumulation, activation
checkpointing, csv + tensorboard + wandb offline, a NaN loss injected on rank 1 at step 3 with
nan_policy=skip), a 2-stage pipeline run stopped by a NaN loss (nan_policy=stop), a 2-rank run stopped by
train.max_consecutive_skips (NaN losses from step 2 on, nan_policy=skip), and a 2-rank standalone evaluation of
the first run's checkpoint.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re

import numpy as np
import pytest
import torch

from deepseek_ds.config import load_run_config
from deepseek_ds.data import PackedDataset, prepare_dataset
from deepseek_ds.models.hf_io import to_hf_model
from deepseek_ds.models.pipeline import build_model, prepare_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.training.metrics import flops_per_token
from helpers import cli, read_metrics, run_ranks

pytestmark = pytest.mark.launch

STEPS, POISONED = 4, 3
# 66 validation samples of 128 tokens exist: 5 x 16 asks for more, so the set is capped at 66, which
# splits 33 / 33 over two ranks and leaves padded micro-batches.
EVAL_SAMPLES = 66
COMMON = [f"train.steps={STEPS}", "train.micro_batch_size=4", "train.global_batch_size=16", "eval.batches=5",
          "checkpoint.interval=0"]

# train.py with a NaN loss on one rank at optimizer steps POISON_STEP to POISON_LAST (default: POISON_STEP only;
# the loss function is patched in the rank).
INJECT = '''
import os, sys
from deepseek_ds.models.loss import TokenWeightedLoss
from deepseek_ds.training.main import main

STEP, RANK = int(os.environ["POISON_STEP"]), int(os.environ["POISON_RANK"])
LAST = int(os.environ.get("POISON_LAST", STEP))
_set, _call = TokenWeightedLoss.set_global_tokens, TokenWeightedLoss.__call__
steps = [0]

def set_global_tokens(self, *args):
    steps[0] += 1  # called once per optimizer step on every rank
    return _set(self, *args)

def call(self, logits, labels):
    loss = _call(self, logits, labels)
    return loss * float("nan") if STEP <= steps[0] <= LAST and int(os.environ["RANK"]) == RANK else loss

TokenWeightedLoss.set_global_tokens, TokenWeightedLoss.__call__ = set_global_tokens, call
sys.exit(main())
'''


def _launch(tmp, name: str, ds_config: str, sets: list[str], env: dict, check: bool = True):
    script = tmp / "inject_nan.py"
    script.write_text(INJECT)
    out = tmp / name
    args = [str(script), "--config", "recipes/tiny-v3.yaml", "--deepspeed_config", ds_config,
            "--set", f"train.output_dir={out}"]
    for s in sets:
        args += ["--set", s]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        proc = run_ranks(2, args, check=check)
    return str(out), proc


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("observability")
    with open("ds_configs/zero1.json") as f:
        ds = json.load(f)
    ds["csv_monitor"] = {"enabled": True, "job_name": "csv"}   # output_path filled in: <output_dir>/monitors
    ds["tensorboard"] = {"enabled": True, "job_name": "tb"}
    ds["wandb"] = {"enabled": True, "project": "deepseek-ds-test"}
    (tmp / "ds.json").write_text(json.dumps(ds))
    env = {"POISON_STEP": str(POISONED), "POISON_RANK": "1", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp),
           "WANDB_SILENT": "true"}
    sets = COMMON + [f"data.path={data_dir}", "eval.interval=1", "train.nan_policy=skip",
                     "model.activation_checkpoint_interval=1"]
    out, proc = _launch(tmp, "moe", str(tmp / "ds.json"), sets, env)
    return {"out": out, "records": read_metrics(out), "stdout": proc.stdout, "wandb": str(tmp / "wandb"),
            "cfg": load_run_config("recipes/tiny-v3.yaml", sets)}


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("observability_pp")
    sets = COMMON + [f"data.path={data_dir}", "eval.interval=2", "train.nan_policy=stop",
                     "parallel.pipeline_stages=2"]
    # Rank 1 is the last stage: the only one that computes the loss.
    out, proc = _launch(tmp, "pp", "ds_configs/zero1_pp.json", sets, {"POISON_STEP": str(POISONED), "POISON_RANK": "1"},
                        check=False)
    return {"out": out, "proc": proc, "records": read_metrics(out), "cfg": load_run_config("recipes/tiny-v3.yaml", sets)}


@pytest.fixture(scope="module")
def skips_run(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("observability_skips")
    # Every step from 2 on is poisoned on rank 1: the 3rd discarded update in a row (step 4) must end the run.
    sets = [f"data.path={data_dir}", "train.steps=6", "train.micro_batch_size=4", "train.global_batch_size=8",
            "train.nan_policy=skip", "train.max_consecutive_skips=3", "checkpoint.interval=1", "checkpoint.keep=10"]
    out, proc = _launch(tmp, "skips", "ds_configs/zero1.json", sets,
                        {"POISON_STEP": "2", "POISON_LAST": "6", "POISON_RANK": "1"}, check=False)
    return {"out": out, "proc": proc, "records": read_metrics(out)}


# ----------------------------------------------------------------------------------------------- reference
def sequential_model(cfg):
    mcfg = prepare_config(build_model_config(cfg.model.preset, cfg.model.path, cfg.model.overrides),
                          cfg.model.attn_implementation, cfg.model.experts_implementation)
    return build_model(mcfg, 1, cfg.train.seed), mcfg


def transformers_eval(model, mcfg, data_dir: str, seq_len: int) -> tuple[float, float]:
    """Mean loss (transformers' own causal-LM loss) and next-token accuracy over the first EVAL_SAMPLES
    validation samples, in one process, on the transformers model holding `model`'s weights."""
    hf = to_hf_model(model.layers, mcfg)
    valid = PackedDataset(data_dir, seq_len, split="valid")
    assert len(valid) == EVAL_SAMPLES
    x = torch.from_numpy(np.stack([valid[i] for i in range(EVAL_SAMPLES)]).astype(np.int64))
    with torch.no_grad():
        logits = hf(input_ids=x[:, :-1]).logits
    loss = hf.loss_function(logits=logits, labels=None, shift_labels=x[:, 1:].contiguous(), vocab_size=mcfg.vocab_size)
    accuracy = (logits.argmax(-1) == x[:, 1:]).double().mean()
    return float(loss), float(accuracy)


def trained_weights(run) -> tuple:
    """The weights of the run's final ZeRO-1 checkpoint, read straight from DeepSpeed's model-states file."""
    model, mcfg = sequential_model(run["cfg"])
    tag = os.path.join(run["out"], "checkpoints", f"step{STEPS:08d}")
    model.load_state_dict(torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=False)["module"])
    return model, mcfg, tag


# ----------------------------------------------------------------------------------------------- MoE run
def test_every_step_has_the_metrics(moe_run):
    recs, cfg = moe_run["records"], moe_run["cfg"]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    mcfg = build_model_config(cfg.model.preset)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    for r in recs:
        assert r["lr"] > 0 and r["step_time"] > 0 and r["memory_gb"] > 0.05  # a torch process' RSS
        assert r["tokens_per_sec"] == pytest.approx(tokens / r["step_time"], rel=1e-9)
        assert r["samples_per_sec"] == pytest.approx(cfg.train.global_batch_size / r["step_time"], rel=1e-9)
        flops = flops_per_token(mcfg, cfg.data.seq_len) * tokens
        assert r["tflops_per_device"] == pytest.approx(flops / r["step_time"] / 2 / 1e12, rel=1e-9)
        assert r["mfu"] is None  # CPU, no train.peak_tflops
        assert r["consumed_samples"] == r["step"] * cfg.train.global_batch_size
    for r in (recs[0], recs[1], recs[3]):
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["skipped"] is False
    # Rank 0 reports; the other rank stays off the console but keeps its own log file.
    assert moe_run["stdout"].count(f"step {STEPS}: validation loss") == 1
    for rank in (0, 1):
        with open(os.path.join(moe_run["out"], "logs", f"rank{rank}.log")) as f:
            assert f"step {POISONED}: the loss is not finite" in f.read()
    assert os.path.getsize(os.path.join(moe_run["out"], "loss.png")) > 10_000


def test_nan_step_is_skipped_and_leaves_the_weights_alone(moe_run):
    before, bad, after = moe_run["records"][POISONED - 2:POISONED + 1]
    assert bad["loss"] is None and bad["grad_norm"] is None  # NaN and inf are written as null
    assert bad["skipped"] is True and bad["skipped_steps"] == after["skipped_steps"] == 1
    assert before["skipped_steps"] == 0
    # No optimizer step: the validation loss is bit-identical to the step before; no scheduler step: same lr.
    assert bad["eval_loss"] == before["eval_loss"]
    assert after["lr"] == bad["lr"] > before["lr"]
    assert math.isfinite(after["loss"]) and after["eval_loss"] < bad["eval_loss"]


def test_expert_load_counts_every_routed_token_once(moe_run):
    cfg = moe_run["cfg"]
    mcfg = build_model_config(cfg.model.preset)
    # Each of the global batch's tokens goes to top_k experts, once (not again in checkpoint recomputation).
    mean = cfg.train.global_batch_size * cfg.data.seq_len * mcfg.num_experts_per_tok / mcfg.n_routed_experts
    moe_layers = range(mcfg.first_k_dense_replace, mcfg.num_hidden_layers)
    for r in moe_run["records"]:
        for layer in moe_layers:
            key = f"moe/layer{layer}"
            assert r[f"{key}/load_mean"] == mean
            assert mean < r[f"{key}/load_max"] <= cfg.train.global_batch_size * cfg.data.seq_len
            assert r[f"{key}/load_ratio"] == r[f"{key}/load_max"] / mean
        assert r["moe/load_ratio_max"] == max(r[f"moe/layer{layer}/load_ratio"] for layer in moe_layers)
    # The router bias statistics are those of the buffers in the final checkpoint.
    states = torch.load(os.path.join(trained_weights(moe_run)[2], "mp_rank_00_model_states.pt"), weights_only=False)
    last = moe_run["records"][-1]
    for layer in moe_layers:
        b = states["module"][f"layers.{layer + 1}.layer.mlp.gate.e_score_correction_bias"].double()
        expected = [b.min(), b.max(), b.mean(), b.std(unbiased=False)]
        got = [last[f"moe/layer{layer}/bias_{s}"] for s in ("min", "max", "mean", "std")]
        assert got == pytest.approx([float(v) for v in expected], abs=1e-12)


def test_validation_equals_single_process_transformers_evaluation(moe_run, data_dir):
    last = moe_run["records"][-1]
    model, mcfg, _ = trained_weights(moe_run)
    loss, accuracy = transformers_eval(model, mcfg, data_dir, moe_run["cfg"].data.seq_len)
    assert last["eval_tokens"] == EVAL_SAMPLES * moe_run["cfg"].data.seq_len
    assert abs(last["eval_loss"] - loss) < 1e-6
    assert last["eval_ppl"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-12)
    assert abs(last["eval_accuracy"] - accuracy) < 1e-9
    # The comparison can fail: the initial weights give another validation loss.
    init_loss, _ = transformers_eval(*sequential_model(moe_run["cfg"]), data_dir, moe_run["cfg"].data.seq_len)
    assert abs(init_loss - loss) > 1e-3


def test_monitors_receive_the_metrics(moe_run):
    recs = moe_run["records"]
    samples = [r["consumed_samples"] for r in recs]
    # csv_monitor: one file per metric, rows (samples, value), in the run's directory by default.
    csv_dir = os.path.join(moe_run["out"], "monitors", "csv")
    for key in ("loss", "eval_loss", "grad_norm", "tokens_per_sec", "moe/layer1/load_max"):
        with open(os.path.join(csv_dir, "Train_Samples_" + key.replace("/", "_") + ".csv")) as f:
            rows = [line.strip().split(",") for line in f][1:]
        assert [int(s) for s, _ in rows] == samples
        for (_, value), r in zip(rows, recs):
            if r[key] is None:  # NaN loss / inf grad norm: null in metrics.jsonl, the number itself in the csv
                assert not math.isfinite(float(value))
            else:
                assert float(value) == pytest.approx(r[key], rel=1e-12)
    # tensorboard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(moe_run["out"], "monitors", "tb"))
    acc.Reload()
    events = acc.Scalars("Train/Samples/eval_loss")
    assert [e.step for e in events] == samples
    assert [e.value for e in events] == pytest.approx([r["eval_loss"] for r in recs], rel=1e-6)
    # wandb (offline): the run file holds each history value right after its key (protobuf value_json).
    (run_file,) = glob.glob(os.path.join(moe_run["wandb"], "offline-run-*", "run-*.wandb"))
    with open(run_file, "rb") as f:
        blob = f.read()
    for r in recs:
        for key in ("eval_loss", "tokens_per_sec"):
            value = json.dumps(r[key]).encode()
            assert re.search(re.escape(f"Train/Samples/{key}".encode()) + b"\x82\x01" + bytes([len(value)])
                             + re.escape(value), blob), (key, r["step"])


# ----------------------------------------------------------------------------------------------- eval / generate
def test_standalone_eval_on_two_ranks_and_one_process_matches(moe_run, data_dir, tmp_path):
    ckpt = os.path.join(moe_run["out"], "checkpoints")
    last = moe_run["records"][-1]
    run_ranks(2, ["--module", "deepseek_ds.inference.cli", "eval", "--checkpoint", ckpt, "--data", data_dir,
                  "--out", str(tmp_path / "two.json")])
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["ranks"] == 2 and two["samples"] == EVAL_SAMPLES
    assert abs(two["eval_loss"] - last["eval_loss"]) < 1e-6
    # `deepseek-ds eval` in one process, other micro-batches (3 samples each), the dataset the checkpoint
    # names: the same token-weighted numbers.
    assert cli(["eval", "--checkpoint", ckpt, "--set", "train.micro_batch_size=3",
                "--out", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["data"] == os.path.abspath(data_dir)
    assert one["ranks"] == 1 and one["eval_tokens"] == last["eval_tokens"]
    assert abs(one["eval_loss"] - last["eval_loss"]) < 1e-6
    assert abs(one["eval_accuracy"] - last["eval_accuracy"]) < 1e-9


def test_generate_from_the_checkpoint(moe_run, tmp_path, capsys):
    from deepseek_ds.inference import cli, generate

    ckpt = os.path.join(moe_run["out"], "checkpoints")
    model, tok = generate.load_model(ckpt)
    greedy = generate.generate(model, tok, "import os\n", max_new_tokens=8)
    # Greedy is the argmax continuation, computed here without a cache.
    ids = generate.prompt_ids(tok, "import os\n")
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    assert greedy.tolist() == ids[0, -8:].tolist()
    # A nucleus holding only the top token is greedy; a wide one samples something else, reproducibly.
    assert generate.generate(model, tok, "import os\n", 8, top_p=1e-9).tolist() == greedy.tolist()
    sampled = generate.generate(model, tok, "import os\n", 8, top_p=0.95, seed=1)
    assert sampled.tolist() == generate.generate(model, tok, "import os\n", 8, top_p=0.95, seed=1).tolist()
    assert sampled.tolist() != greedy.tolist()
    # The same model as an HF directory gives the same text through the command line.
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    assert cli.main(["generate", "--model", str(tmp_path / "hf"), "--prompt", "import os\n", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == "import os\n" + tok.decode(greedy, skip_special_tokens=True) + "\n"


# ----------------------------------------------------------------------------------------------- pipeline run
def test_pipeline_stops_on_nan_with_a_checkpoint_and_exact_validation(pipeline_run, data_dir):
    proc, recs = pipeline_run["proc"], pipeline_run["records"]
    assert proc.returncode != 0
    assert "train.nan_policy: stop" in proc.stdout + proc.stderr
    assert [r["step"] for r in recs] == list(range(1, POISONED + 1))
    assert recs[-1]["loss"] is None and recs[-1]["skipped"] is True
    # The update was discarded, so the checkpoint saved at the bad step holds the weights the step-2
    # validation (DeepSpeed's pipeline eval_batch) was computed with.
    tag = os.path.join(pipeline_run["out"], "checkpoints", f"step{POISONED:08d}")
    model, mcfg = sequential_model(pipeline_run["cfg"])
    files = glob.glob(os.path.join(tag, "layer_*-model_states.pt"))
    assert len(files) == len(model.layers)
    for f in files:
        idx = int(re.search(r"layer_(\d+)-", f).group(1))
        model.layers[idx].load_state_dict(torch.load(f, weights_only=False))
    loss, accuracy = transformers_eval(model, mcfg, data_dir, pipeline_run["cfg"].data.seq_len)
    step2 = recs[1]
    assert abs(step2["eval_loss"] - loss) < 1e-6
    assert abs(step2["eval_accuracy"] - accuracy) < 1e-9
    assert "eval_loss" not in recs[0]  # eval.interval=2


def test_what_stopped_the_run_is_in_every_rank_log(pipeline_run):
    """Post-mortems read logs/rankN.log: the message that ended the rank is there, not only on the console."""
    for rank in (0, 1):
        with open(os.path.join(pipeline_run["out"], "logs", f"rank{rank}.log")) as f:
            log = f.read()
        assert "ERROR" in log and "train.nan_policy: stop" in log.split("ERROR", 1)[1], f"rank{rank}.log"


def test_eval_refuses_data_of_another_tokenizer(moe_run, tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("another corpus, another tokenizer\n" * 200)
    other = prepare_dataset([str(tmp_path / "corpus")], str(tmp_path / "other"), vocab_size=300, progress=False)
    ckpt = os.path.join(moe_run["out"], "checkpoints")
    assert cli(["eval", "--checkpoint", ckpt, "--data", other]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deepseek-ds: error: {other} was tokenized with another tokenizer")
    assert "--tokenizer" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------- consecutive skips
def test_consecutive_skips_save_and_stop(skips_run):
    proc, recs, out = skips_run["proc"], skips_run["records"], skips_run["out"]
    # The exit status of every non-finite stop (training/main.py: NonFiniteLoss -> 3), passed on by the launcher.
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert ("deepseek-ds: step 4: DeepSpeed discarded the last 3 updates in a row (train.max_consecutive_skips: 3)"
            in proc.stderr)
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["skipped"] for r in recs] == [False, True, True, True] and recs[-1]["skipped_steps"] == 3
    ckpt = os.path.join(out, "checkpoints")
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("step")) == [f"step{s:08d}" for s in (1, 2, 3, 4)]
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "step00000004"
    # The weights saved at the stop are those of step 1, the last applied update, bit for bit.
    first, last = (torch.load(os.path.join(ckpt, f"step{s:08d}", "mp_rank_00_model_states.pt"),
                              weights_only=False)["module"] for s in (1, 4))
    assert first.keys() == last.keys() and all(torch.equal(first[k], last[k]) for k in first)
    for rank in (0, 1):
        with open(os.path.join(out, "logs", f"rank{rank}.log")) as f:
            assert "train.max_consecutive_skips: 3" in f.read().split("ERROR", 1)[1], f"rank{rank}.log"
