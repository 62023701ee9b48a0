"""Preference optimization (train.objective: dpo): data prepare of pairs, the loss formulas, validate's refusals, and
the training launch against an independent transformers computation of TRL's DPO formulas."""

import json
import math
import os
import subprocess
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deepseek_ds.config import load_ds_config, load_run_config
from deepseek_ds.data import DataError, load_tokenizer, open_dataset, prepare_dataset
from deepseek_ds.data.chat import Message, encode
from deepseek_ds.models.preference_loss import preference_terms
from helpers import IGNORE_INDEX, read_metrics, refused, train_layouts
from reference import reference_model
from reference_data import step_samples

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
STEPS, GLOBAL, MICRO, SEQ = 3, 4, 2, 32


def _record(i: int) -> dict:
    w = WORDS[i % 8] + WORDS[(i * 3 + 1) % 8][: 2 + i % 3]
    if i % 2:  # TRL's conversational form, implicit prompt (the shared first turn)
        user = {"role": "user", "content": f"reverse {w}"}
        return {"chosen": [user, {"role": "assistant", "content": w[::-1]}],
                "rejected": [user, {"role": "assistant", "content": w[::-1][1:]}]}
    return {"prompt": f"reverse {w}", "chosen": w[::-1], "rejected": w}


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    lines = [json.dumps(_record(i)) for i in range(40)] + [json.dumps({"prompt": "x", "chosen": "y", "rejected": "y"})]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def pref_data(pairs_file, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("pref") / "ds"
    return prepare_dataset([str(pairs_file)], str(out), vocab_size=300, valid_fraction=0.1, progress=False,
                           data_format="preference")


@pytest.mark.unit
def test_pairs_are_two_rendered_conversations_trained_on_their_responses(pref_data, pairs_file):
    from deepseek_ds.data.layout import read_meta
    meta = read_meta(pref_data)
    assert meta["format"] == "preference" and meta["identical_pairs"] == 1
    assert meta["num_docs"] == 2 * 41
    tok = load_tokenizer(pref_data)
    ds = open_dataset(pref_data, load_run_config("recipes/tiny-v3.yaml", [f"data.seq_len={SEQ}"]).data)
    records = [json.loads(x) for x in pairs_file.read_text().splitlines()]
    seen = 0
    for k in range(len(ds)):
        pair = ds[k]
        assert pair.shape == (2, 3, SEQ)
        for side, row in zip(("chosen", "rejected"), pair):
            n = int((row[2] != np.arange(SEQ)).argmax()) or SEQ  # the padding restarts the positions
            ids, labels = row[0][:n].tolist(), row[1]
            matches = []
            for r in records:
                prompt = r.get("prompt") or r["chosen"][0]["content"]
                answer = r[side] if isinstance(r[side], str) else r[side][-1]["content"]
                enc = encode(tok, (Message("user", prompt), Message("assistant", answer)), "last")
                if enc.ids == ids:
                    trained = [t for t, m in zip(enc.ids[1:], enc.trained[1:]) if m]
                    matches.append(trained)
            assert matches, f"pair {k} {side}: not a rendered record"
            # Labels: exactly the response's tokens and its EOS (the last one), nothing of the prompt.
            assert [int(x) for x in labels if x != IGNORE_INDEX] == matches[0]
            assert matches[0][-1] == tok.eos_token_id
        seen += 1
    assert seen == len(ds) == 41 - meta["splits"]["valid"]["num_docs"] // 2


@pytest.mark.unit
def test_bad_pairs_name_file_and_line_or_are_skipped(tmp_path, pairs_file, capsys):
    from deepseek_ds.cli import main
    bad = tmp_path / "bad.jsonl"
    bad.write_text(pairs_file.read_text().splitlines()[0] + "\n" + json.dumps({"prompt": "a", "chosen": "",
                                                                             "rejected": "b"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: message 1: empty assistant content"):
        prepare_dataset([str(bad)], str(tmp_path / "a"), vocab_size=300, progress=False, data_format="preference")
    assert main(["data", "prepare", "--format", "preference", "--input", str(bad), "--out", str(tmp_path / "b"),
                 "--vocab-size", "300", "--skip-bad", "--valid-fraction", "0", "--no-progress"]) == 0
    assert "1 bad lines skipped" in capsys.readouterr().out
    same = tmp_path / "same.jsonl"
    same.write_text(bad.read_text().splitlines()[0] + "\n" + json.dumps({"prompt": "q", "chosen": "a", "rejected": "a"}))
    assert main(["data", "prepare", "--format", "preference", "--input", str(same), "--out", str(tmp_path / "c"),
                 "--vocab-size", "300", "--valid-fraction", "0", "--no-progress"]) == 0
    assert "warning: 1 pairs have the same chosen and rejected response" in capsys.readouterr().out
    assert main(["data", "dump", "--data", str(tmp_path / "b"), "--seq-len", "24"]) == 0
    dumped = json.loads(capsys.readouterr().out)
    assert set(dumped) == {"chosen", "rejected"} and dumped["chosen"]["input_ids"] != dumped["rejected"]["input_ids"]


def _trl_reference(pc, pr, rc, rr, nc, nr, loss, beta, ls=0.0, gamma=0.0):
    """TRL's formulas, per pair, written out on Python floats."""
    if loss in ("ipo", "simpo"):
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
    if loss == "simpo":
        z = (pc - pr) - gamma / beta
        return -math.log(1 / (1 + math.exp(-beta * z))) * (1 - ls) - math.log(1 / (1 + math.exp(beta * z))) * ls
    z = (pc - pr) - (rc - rr)
    if loss == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    return -math.log(1 / (1 + math.exp(-beta * z))) * (1 - ls) - math.log(1 / (1 + math.exp(beta * z))) * ls


@pytest.mark.unit
@pytest.mark.parametrize("loss,ls", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("simpo", 0.1)])
def test_loss_formulas_equal_trl(loss, ls):
    from deepseek_ds.models.preference_loss import normalised
    g = torch.Generator().manual_seed(0)
    policy, ref = -10 * torch.rand(6, generator=g, dtype=torch.float64), -10 * torch.rand(6, generator=g,
                                                                                       dtype=torch.float64)
    counts = torch.tensor([3, 5, 7, 2, 4, 9])
    losses, chosen, rejected = preference_terms(normalised(policy, counts, loss), normalised(ref, counts, loss), loss,
                                                0.3, ls, 0.5)
    for k in range(3):
        expected = _trl_reference(*policy[[k, k + 3]].tolist(), *ref[[k, k + 3]].tolist(), counts[k].item(),
                                  counts[k + 3].item(), loss, 0.3, ls, 0.5)
        assert losses[k].item() == pytest.approx(expected, rel=1e-12)
    if loss == "sigmoid":
        assert chosen.tolist() == pytest.approx((0.3 * (policy[:3] - ref[:3])).tolist(), rel=1e-12)
        assert rejected.tolist() == pytest.approx((0.3 * (policy[3:] - ref[3:])).tolist(), rel=1e-12)


@pytest.mark.unit
def test_validate_refuses_objective_and_data_mismatches_and_another_reference(pref_data, data_dir, tmp_path):
    ds = load_ds_config("ds_configs/zero1.json")
    base = ["train.micro_batch_size=2", "train.global_batch_size=4", f"data.seq_len={SEQ}", "eval.interval=0"]
    cfg = load_run_config("recipes/tiny-v3.yaml", base + [f"data.path={pref_data}"])
    # Each refusal names the field and its fix.
    assert "set train.objective: dpo" in refused(cfg, ds, match="is a preference dataset")
    cfg = load_run_config("recipes/tiny-v3.yaml", base + [f"data.path={data_dir}", "train.objective=dpo"])
    assert "--format preference" in refused(cfg, ds, match="is not a preference dataset")
    model, _ = reference_model(load_run_config("recipes/tiny-v3.yaml", ["model.overrides.vocab_size=512"]))
    model.save_pretrained(tmp_path / "other")
    cfg = load_run_config("recipes/tiny-v3.yaml", base + [f"data.path={pref_data}", "train.objective=dpo",
                                                          f"preference.reference={tmp_path / 'other'}"])
    assert f"preference.reference '{tmp_path / 'other'}'" in refused(
        cfg, ds, match=r"another architecture or vocabulary than the policy's \(vocab_size 512 vs")
    dpo = base + [f"data.path={pref_data}", "train.objective=dpo"]
    for sets, match, fix in (
            (["preference.loss=simpo", f"preference.reference={tmp_path / 'other'}"], "simpo is reference-free",
             "remove it"),
            (["lora.r=4", f"preference.reference={tmp_path / 'other'}"], "with LoRA: the reference is the base",
             "remove preference.reference"),
            (["data.packing=true"], "dpo does not support data.packing", "set data.packing: false"),
            (["model.overrides.num_nextn_predict_layers=1", "train.mtp_loss_weight=0.3"], "dpo trains no MTP module",
             "set model.overrides.num_nextn_predict_layers: 0")):
        message = refused(load_run_config("recipes/tiny-v3.yaml", dpo + sets), ds, match=match)
        assert fix in message, (sets, message)
    ep = dpo + ["parallel.expert_parallel=2", "train.global_batch_size=8", f"preference.reference={tmp_path / 'other'}"]
    message = refused(load_run_config("recipes/tiny-v3.yaml", ep), load_ds_config("ds_configs/zero3.json"), world=2,
                      match="with parallel.expert_parallel or tensor_parallel > 1 and ZeRO-3 is not supported yet")
    assert "use ZeRO stage 1 or 2" in message


# ----------------------------------------------------------------------------------------------- launches
# Adam's eps at 1e-6: with 1e-8 Adam's first update lr x g / (|g| + eps) turns the rounding noise of gradients near
# 1e-8 into steps of up to lr / 20 (measured against TRL), and two exact computations' second losses part by 4e-5
# (expert parallelism groups the experts' tokens otherwise).
SETS = [f"train.steps={STEPS}", f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL}",
        f"data.seq_len={SEQ}", "train.warmup_steps=0", "checkpoint.interval=0", "eval.interval=0",
        "train.objective=dpo", "preference.beta=0.5", "train.lr=1e-2", "train.eps=1e-6"]


PASS_SETS = ["train.steps=1"]  # the reference pass over many_pairs, then one step
# The run TRL's DPOTrainer repeats: a constant rate (min_lr = lr), no weight decay (Trainer exempts norms and biases),
# and no MoE balancing (TRL neither moves router biases nor adds DeepSeek's balance loss).
TRL_SETS = ["train.min_lr=1e-2", "train.weight_decay=0", "moe.bias_update_speed=0", "moe.seq_aux_alpha=0"]


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """An HF directory of the policy's architecture with other weights (the seeded init x 1.2): the reference."""
    model, _ = reference_model(load_run_config("recipes/tiny-v3.yaml", SETS))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.2)
    out = tmp_path_factory.mktemp("reference")
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def many_pairs(tmp_path_factory) -> str:
    """400 pairs: a reference pass of 100 parts, long enough to be killed midway."""
    root = tmp_path_factory.mktemp("many")
    (root / "pairs.jsonl").write_text("".join(json.dumps(_record(i)) + "\n" for i in range(400)))
    return prepare_dataset([str(root / "pairs.jsonl")], str(root / "ds"), vocab_size=300, valid_fraction=0,
                           progress=False, data_format="preference")


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory, pref_data, reference_dir, many_pairs):
    sets = SETS + [f"data.path={pref_data}", f"preference.reference={reference_dir}"]
    start = ["preference.reference=null"]  # the starting weights
    lora = start + [f"model.path={reference_dir}", "model.preset=null", "lora.r=4", f"eval.interval={STEPS}"]
    # "one" twice: the second resumes the first's run for one more step (the same output directory).
    one = train_layouts(1, tmp_path_factory.mktemp("dpo1"), [("one", "ds_configs/zero1.json", []),
                                                            ("one-start", "ds_configs/zero1.json",
                                                             start + [f"eval.interval={STEPS}"]),
                                                            ("one", "ds_configs/zero1.json", [f"train.steps={STEPS + 1}"]),
                                                            ("ipo", "ds_configs/zero1.json", ["preference.loss=ipo"]),
                                                            ("rpo", "ds_configs/zero1.json", ["preference.rpo_alpha=0.5"]),
                                                            ("lora", "ds_configs/zero1.json", lora),
                                                            ("simpo", "ds_configs/zero1.json", start + [
                                                                "preference.loss=simpo", "preference.simpo_gamma=0.4"]),
                                                            ("trl", "ds_configs/zero1.json", TRL_SETS)],
                        sets)
    two = train_layouts(2, tmp_path_factory.mktemp("dpo2"), [("zero1", "ds_configs/zero1.json", []),
                                                            ("zero3", "ds_configs/zero3.json", []),
                                                            ("pp2", "ds_configs/zero1_pp.json",
                                                             ["parallel.pipeline_stages=2"]),
                                                            ("ep2", "ds_configs/zero1.json",
                                                             ["parallel.expert_parallel=2"]),
                                                            ("tp2", "ds_configs/zero1.json",
                                                             ["parallel.tensor_parallel=2"]),
                                                            ("lora-pp2", "ds_configs/zero1_pp.json", lora + [
                                                                "parallel.pipeline_stages=2"]),
                                                            ("pass", "ds_configs/zero1.json", PASS_SETS + [
                                                                f"data.path={many_pairs}"])], sets)
    return {**{k: read_metrics(str(v)) for k, v in {**one, **two}.items()}, "one_dir": one["one"],
            "lora_dir": one["lora"], "start_dir": one["one-start"], "pass_dir": two["pass"],
            "lora_pp_dir": two["lora-pp2"]}


def _first_step(cfg, pref_data, reference_dir):
    """(policy logps, reference logps, trained labels) of step 1's rows, B chosen then B rejected, computed with
    transformers' models: the policy's seeded init and the reference directory."""
    from transformers import AutoModelForCausalLM

    policy, _ = reference_model(cfg)
    ref = AutoModelForCausalLM.from_pretrained(reference_dir)
    ds = open_dataset(pref_data, cfg.data)
    pairs = [ds[i] for i in step_samples(1, len(ds), GLOBAL, cfg.train.seed, cfg.train.shuffle)]
    rows = [torch.from_numpy(p[side]) for side in (0, 1) for p in pairs]
    counts = torch.tensor([float((r[1] != IGNORE_INDEX).sum()) for r in rows], dtype=torch.float64)
    return _logps(policy.eval(), rows), _logps(ref.eval(), rows), counts


def _logps(model, rows) -> torch.Tensor:
    """Summed log-probabilities of each row's labels (transformers' model, its own log_softmax)."""
    out = []
    with torch.no_grad():
        for inputs, labels, positions in rows:
            logits = model(input_ids=inputs[None], position_ids=positions[None]).logits[0].double()
            keep = labels != IGNORE_INDEX
            out.append(F.log_softmax(logits, -1)[keep].gather(1, labels[keep][:, None]).sum().item())
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.launch
def test_first_step_equals_trl_formulas_and_layouts_equal_one_process(dpo_runs, pref_data, reference_dir):
    """Step 1's loss, rewards and accuracy equal TRL's sigmoid DPO computed here on transformers' models (the
    policy's seeded init and the reference directory); 2-rank ZeRO-1, ZeRO-3, PP=2, EP=2, TP=2 and LoRA on PP=2 equal
    one process over 3 steps (losses and grad norms); with
    the starting weights as the reference the first loss is ln 2; a resumed run reuses the stored reference pass."""
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={pref_data}"])
    ds = open_dataset(pref_data, cfg.data)
    pol, rf, _ = _first_step(cfg, pref_data, reference_dir)
    beta = 0.5
    z = (pol[:GLOBAL] - pol[GLOBAL:]) - (rf[:GLOBAL] - rf[GLOBAL:])
    chosen, rejected = beta * (pol[:GLOBAL] - rf[:GLOBAL]), beta * (pol[GLOBAL:] - rf[GLOBAL:])
    first = dpo_runs["one"][0]
    assert first["loss"] == pytest.approx(-F.logsigmoid(beta * z).mean().item(), rel=1e-5)
    assert abs(first["loss"] - math.log(2)) > 1e-3  # the reference differs from the policy
    assert first["rewards_chosen"] == pytest.approx(chosen.mean().item(), rel=1e-5, abs=1e-6)
    assert first["rewards_rejected"] == pytest.approx(rejected.mean().item(), rel=1e-5, abs=1e-6)
    assert first["reward_margin"] == pytest.approx((chosen - rejected).mean().item(), rel=1e-5, abs=1e-6)
    assert first["reward_accuracy"] == (chosen > rejected).double().mean().item()
    one = [r["loss"] for r in dpo_runs["one"]]
    assert [r["step"] for r in dpo_runs["one"]] == list(range(1, STEPS + 2))
    one = one[:STEPS]
    assert len(set(one)) == STEPS and one[-1] < one[0]  # it trains
    stored = json.loads((dpo_runs["one_dir"] / "checkpoints" / "reference_logps" / "train.json").read_text())
    assert stored["pairs"] == len(ds) and len(stored["sha256"]) == 64
    log = (dpo_runs["one_dir"] / "logs" / "rank0.log").read_text()
    assert log.count("reference log-probabilities (train) of") == 1 and "reference log-probabilities (train): reused" in log
    start = [r["loss"] for r in dpo_runs["one-start"]]
    assert start[0] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the policy at step 1
    evaluated = dpo_runs["one-start"][-1]  # eval.interval: the validation pairs' metrics, on their stored reference
    assert evaluated["eval_pairs"] == 4 and 0 <= evaluated["eval_reward_accuracy"] <= 1
    assert evaluated["eval_reward_margin"] == pytest.approx(
        evaluated["eval_rewards_chosen"] - evaluated["eval_rewards_rejected"], abs=1e-9)
    assert math.isfinite(evaluated["eval_loss"]) and evaluated["eval_loss"] != pytest.approx(math.log(2), abs=1e-4)
    # The reference directory is read into each layout's own split of the model (EP: each rank its experts).
    for name, single in (("zero1", "one"), ("zero3", "one"), ("pp2", "one"), ("ep2", "one"), ("tp2", "one"),
                         ("lora-pp2", "lora")):
        one = [r["loss"] for r in dpo_runs[single]][:STEPS]
        assert [r["loss"] for r in dpo_runs[name]] == pytest.approx(one, rel=1e-5), name
        norms = [r["grad_norm"] for r in dpo_runs[single]][:STEPS]
        # LoRA: B starts at 0, so Adam's first update moves each B entry by about lr whatever its gradient's size,
        # rounding noise included: the adapters' norms part by up to 2.6e-5 at steps 2-3 (measured).
        assert [r["grad_norm"] for r in dpo_runs[name]] == pytest.approx(
            norms, rel=5e-5 if name.startswith("lora") else 1e-5), name
        # A margin is beta x a difference of fp32 sequence log-probabilities of magnitude ~30 that the layouts sum
        # in other orders: measured within 1.8e-5 of one process's (the losses agree to 1e-5 relative).
        assert [r["reward_margin"] for r in dpo_runs[name]] == pytest.approx(
            [r["reward_margin"] for r in dpo_runs[single]][:STEPS], abs=5e-5), name
    # LoRA on a pipeline stores the base's pass before the first step (one process computes it with each micro-batch).
    assert json.loads((dpo_runs["lora_pp_dir"] / "checkpoints" / "reference_logps" / "train.json").read_text())[
        "pairs"] == len(ds)


@pytest.mark.launch
def test_ipo_simpo_and_rpo_first_losses_equal_their_formulas(dpo_runs, pref_data, reference_dir):
    """IPO: ((z - 1/(2 beta))^2) with z on per-token mean logps (TRL DPOTrainer); SimPO: -logsigmoid(beta z) with
    z = mean-logp margin - gamma / beta and no reference (TRL CPOTrainer), rewards beta x mean logps; RPO: DPO's loss
    + alpha x the chosen response's per-token mean negative log-likelihood, per pair."""
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={pref_data}"])
    pol, rf, n = _first_step(cfg, pref_data, reference_dir)
    z = (pol[:GLOBAL] - pol[GLOBAL:]) - (rf[:GLOBAL] - rf[GLOBAL:])
    rpo = -F.logsigmoid(0.5 * z) + 0.5 * (-pol[:GLOBAL] / n[:GLOBAL])
    assert dpo_runs["rpo"][0]["loss"] == pytest.approx(rpo.mean().item(), rel=1e-5)
    assert dpo_runs["rpo"][0]["reward_margin"] == pytest.approx(dpo_runs["one"][0]["reward_margin"], abs=1e-6)
    pol, rf, beta, B = pol / n, rf / n, 0.5, GLOBAL
    z = (pol[:B] - pol[B:]) - (rf[:B] - rf[B:])
    assert dpo_runs["ipo"][0]["loss"] == pytest.approx(((z - 1 / (2 * beta)) ** 2).mean().item(), rel=1e-5)
    z = (pol[:B] - pol[B:]) - 0.4 / beta
    simpo = dpo_runs["simpo"][0]
    assert simpo["loss"] == pytest.approx(-F.logsigmoid(beta * z).mean().item(), rel=1e-5)
    assert simpo["rewards_chosen"] == pytest.approx(beta * pol[:B].mean().item(), rel=1e-5)
    assert simpo["reward_accuracy"] == (pol[:B] > pol[B:]).double().mean().item()
    ipo = [r["loss"] for r in dpo_runs["ipo"]]
    assert ipo[-1] < ipo[0]
    # SimPO from a random init at this rate rises before it falls: it moves (trains) at every step.
    assert len({r["loss"] for r in dpo_runs["simpo"]}) == STEPS


@pytest.mark.launch
def test_lora_reference_is_the_base_with_adapters_off(dpo_runs):
    """LoRA without preference.reference: no reference pass; at step 1 the adapters (B = 0) change nothing, so the
    loss is ln 2 and the rewards 0; then the loss falls, and validation measures against the base too."""
    records = dpo_runs["lora"]
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[-1]["eval_reward_margin"] != pytest.approx(0.0, abs=1e-6)
    assert not (dpo_runs["lora_dir"] / "checkpoints" / "reference_logps").exists()


@pytest.mark.launch
@pytest.mark.parametrize("run", ["one-start", "lora"])
def test_eval_of_a_checkpoint_on_the_preference_split_equals_training_validation(run, dpo_runs, tmp_path):
    """`deepseek-ds eval` of the last checkpoint (a model rebuilt from its weights, the reference rebuilt from the run's
    starting weights or LoRA base) gives the pair metrics training's validation logged at that step (the engine, the
    stored or adapters-off reference)."""
    from deepseek_ds.cli import main

    folder = dpo_runs["start_dir" if run == "one-start" else "lora_dir"]
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(folder / "checkpoints"), "--split", "valid", "--out", str(out)]) == 0
    got, logged = json.loads(out.read_text()), dpo_runs[run][-1]
    assert got["eval_pairs"] == logged["eval_pairs"] == 4
    for key in ("eval_loss", "eval_rewards_chosen", "eval_rewards_rejected", "eval_reward_margin"):
        assert got[key] == pytest.approx(logged[key], rel=1e-4, abs=1e-5), key
    assert got["eval_reward_accuracy"] == logged["eval_reward_accuracy"]


@pytest.mark.launch
def test_three_steps_equal_trl_dpo_trainer(dpo_runs, pref_data, pairs_file, reference_dir, tmp_path):
    """TRL's own DPOTrainer (sigmoid loss, the same seeded policy, reference directory, pairs in the run's order,
    AdamW at the run's rate, betas, eps and clipping, 2 micro-batches of 2 pairs) on one process: its loss, rewards,
    accuracy and gradient norm of each of 3 steps equal the run's within 1e-5. TRL tokenizes the records itself with
    the dataset tokenizer's chat template, and its sequences are checked to be the run's token for token."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from deepseek_ds.data.tokenizer import chat_template_of

    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + TRL_SETS + [f"data.path={pref_data}"])
    tok = load_tokenizer(pref_data)
    tok.chat_template = chat_template_of(tok)
    ds = open_dataset(pref_data, cfg.data)
    by_ids = {}
    for line in pairs_file.read_text().splitlines():
        r = json.loads(line)
        prompt = r.get("prompt") or r["chosen"][0]["content"]
        sides = [r[s] if isinstance(r[s], str) else r[s][-1]["content"] for s in ("chosen", "rejected")]
        ids = encode(tok, (Message("user", prompt), Message("assistant", sides[0])), "last").ids
        by_ids[tuple(ids)] = {"prompt": [{"role": "user", "content": prompt}],
                              **{s: [{"role": "assistant", "content": a}] for s, a in zip(("chosen", "rejected"), sides)}}
    order = [i for step in range(1, STEPS + 1)
             for i in step_samples(step, len(ds), GLOBAL, cfg.train.seed, cfg.train.shuffle)]
    rows = [ds[i] for i in order]
    records = [by_ids[tuple(p[0][0][:_length(p[0])].tolist())] for p in rows]
    policy, _ = reference_model(cfg)
    t = cfg.train
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.5, loss_type=["sigmoid"], learning_rate=t.lr,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=t.beta1,
                     adam_beta2=t.beta2, adam_epsilon=t.eps, max_grad_norm=t.grad_clip, max_steps=STEPS,
                     per_device_train_batch_size=MICRO, gradient_accumulation_steps=GLOBAL // MICRO,
                     train_sampling_strategy="sequential", logging_steps=1, pad_to_multiple_of=SEQ, save_strategy="no", report_to="none",
                     use_cpu=True, bf16=False, seed=cfg.train.seed, disable_dropout=True)
    trainer = DPOTrainer(model=policy, ref_model=AutoModelForCausalLM.from_pretrained(reference_dir), args=args,
                         train_dataset=Dataset.from_list(records), processing_class=tok)
    for k, p in enumerate(rows):  # TRL's tokenization of each pair is the run's sequences
        tokenized = trainer.train_dataset[k]
        for side, row in zip(("chosen", "rejected"), p):
            assert tokenized["prompt_ids"] + tokenized[f"{side}_ids"] == row[0][:_length(row)].tolist(), (k, side)
            assert len(tokenized[f"{side}_ids"]) == int((row[1] != IGNORE_INDEX).sum()), (k, side)
    trainer.accelerator.clip_grad_norm_ = _clip_grad_norm_fp64
    trainer.train()
    trl = [r for r in trainer.state.log_history if "rewards/margins" in r]
    ours = dpo_runs["trl"]
    assert len(trl) == len(ours) == STEPS
    rewards = (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
               ("reward_margin", "rewards/margins"))
    for step, (a, b) in enumerate(zip(ours, trl, strict=True), 1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), step
        assert a["reward_accuracy"] == pytest.approx(b["rewards/accuracies"], abs=1e-9), step
        # A reward is beta x a difference of summed log-probabilities of magnitude ~40: after the first update the
        # two trainings' float rounding differs by ~1e-6 relative there (measured up to 2.6e-5 in a reward at step 3).
        tolerance = 1e-5 if step == 1 else 5e-5
        for mine, theirs in rewards:
            assert a[mine] == pytest.approx(b[theirs], abs=tolerance), (step, mine)
    assert ours[-1]["loss"] < ours[0]["loss"]


def _length(row) -> int:
    """A stored sequence's length without its padding (where the padding restarts the positions)."""
    return int((row[2] != np.arange(len(row[2]))).argmax()) or len(row[2])


def _clip_grad_norm_fp64(parameters, max_norm: float, **_) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ with the norm summed in float64. On CPU torch's fp32 vector_norm of the tiny
    model's sparse lm_head gradient is 1e-4 off (measured against float64, 1.1e-5 in the total norm), which TRL's
    clipping would carry into every step; DeepSpeed's norm agrees with float64 to 1e-8."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    torch._foreach_mul_(grads, coef)
    return total.float()


@pytest.mark.launch
def test_reference_pass_killed_midway_resumes_to_the_same_bytes(dpo_runs, many_pairs, reference_dir, tmp_path):
    """SIGKILL to the whole job (launcher and ranks) while the reference pass stores its parts; the relaunch keeps
    the parts stored intact, computes only the rest, and stores bitwise what the uninterrupted 2-rank pass stored."""
    from deepseek_ds.training.objectives.dpo_reference import REFERENCE_DIR, part_pairs
    from deepseek_ds.utils.net import free_port
    from helpers import BIN, ROOT, kill_job, launch_env, run_ranks

    out = tmp_path / "killed"
    args = ["train.py", "--config", "recipes/tiny-v3.yaml"]
    for s in SETS + PASS_SETS + [f"data.path={many_pairs}", f"preference.reference={reference_dir}",
                                 f"train.output_dir={out}"]:
        args += ["--set", s]
    folder = out / "checkpoints" / REFERENCE_DIR
    manifest = folder / "train.parts" / "manifest.json"
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    proc = subprocess.Popen(cmd + args, cwd=ROOT, env=launch_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while _parts_stored(manifest) < 3:
        assert proc.poll() is None, f"the job ended (status {proc.returncode}) before the kill"
        assert time.monotonic() < deadline, "no reference part within 300 s"
        time.sleep(0.02)
    kill_job(proc)
    kept = _parts_stored(manifest)
    pairs = len(open_dataset(many_pairs, load_run_config("recipes/tiny-v3.yaml", SETS).data))
    size = part_pairs(pairs, 2, MICRO)
    assert 3 <= kept < math.ceil(pairs / size) and not (folder / "train.bin").exists()
    run_ranks(2, args)
    log = (out / "logs" / "rank0.log").read_text()
    assert f"reference pass: resuming at pair {kept * size} of {pairs} ({kept} of" in log
    uninterrupted = dpo_runs["pass_dir"] / "checkpoints" / REFERENCE_DIR
    assert (folder / "train.bin").read_bytes() == (uninterrupted / "train.bin").read_bytes()
    assert json.loads((folder / "train.json").read_text()) == json.loads((uninterrupted / "train.json").read_text())
    assert not (folder / "train.parts").exists()  # merged into train.bin
    assert read_metrics(str(out))[0]["loss"] == dpo_runs["pass"][0]["loss"]


def _parts_stored(manifest) -> int:
    try:
        return len(json.loads(manifest.read_text())["sha256"])
    except (OSError, ValueError):
        return 0


def _shard_bytes(out: str) -> dict:
    from pathlib import Path
    return {p.name: p.read_bytes() for p in sorted(Path(out).glob("*-*.*")) if p.suffix in (".bin", ".idx", ".mask")}


@pytest.mark.unit
def test_a_json_array_of_pairs_prepares_to_the_bytes_of_its_json_lines(pairs_file, pref_data, tmp_path):
    records = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    array = tmp_path / "pairs.json"
    array.write_text(json.dumps(records, indent=2))
    out = prepare_dataset([str(array)], str(tmp_path / "ds"), vocab_size=300, valid_fraction=0.1, progress=False,
                          data_format="preference")
    assert {"train-00000.bin", "train-00000.mask", "valid-00000.idx"} <= set(_shard_bytes(pref_data))
    assert _shard_bytes(out) == _shard_bytes(pref_data)


@pytest.mark.unit
@pytest.mark.parametrize("fraction,valid", [(0.1, 4), (0.25, 10)])
def test_prepare_reports_pairs_and_warns_once_of_a_validation_split_under_8_pairs(fraction, valid, pairs_file,
                                                                                  tmp_path, capsys):
    from deepseek_ds.cli import main
    from deepseek_ds.data import dataset_info
    out = tmp_path / "ds"
    assert main(["data", "prepare", "--format", "preference", "--input", str(pairs_file), "--out", str(out),
                 "--vocab-size", "300", "--valid-fraction", str(fraction), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    splits = dataset_info(str(out))["splits"]
    pairs = len(pairs_file.read_text().splitlines())  # one pair a line
    assert splits["valid"]["num_docs"] == 2 * valid  # two samples a pair
    assert f"{pairs} pairs ({2 * pairs} samples)" in printed
    assert (f"split train {pairs - valid} pairs / {splits['train']['num_tokens']:,} tokens, valid {valid} pairs / "
            f"{splits['valid']['num_tokens']:,} tokens") in printed
    assert " docs" not in printed and " documents" not in printed
    warning = f"the validation split holds only {valid} preference pairs (fewer than 8)"
    assert printed.count(warning) == (1 if valid < 8 else 0)
    assert printed.count("validation split holds only") == printed.count(warning)


@pytest.mark.unit
def test_a_dpo_run_warns_at_its_start_of_a_validation_split_under_8_pairs(pref_data, caplog):
    import logging
    from types import SimpleNamespace

    from deepseek_ds.training.objectives import dpo_reference
    data = load_run_config("recipes/tiny-v3.yaml", [f"data.seq_len={SEQ}"]).data
    log = logging.getLogger("test_preference.small_valid")
    # A reference-free loss: ensure_reference returns before any model is needed, after its check of the split.
    run = SimpleNamespace(rank=0, log=log, loss_fn=SimpleNamespace(needs_reference=False))
    with caplog.at_level(logging.WARNING, logger=log.name):
        dpo_reference.ensure_reference(run, open_dataset(pref_data, data), "train")
        assert not caplog.records  # the training split is not what eval_reward_accuracy is measured on
        valid = open_dataset(pref_data, data, "valid")
        dpo_reference.ensure_reference(run, valid, "valid")
    assert [r.getMessage() for r in caplog.records] == [
        f"the validation split holds only {len(valid)} preference pairs (fewer than 8): its reward accuracy moves in "
        f"steps of {100 / len(valid):.0f}% and means little; prepare the data with a larger --valid-fraction"]
    assert len(valid) == 4
