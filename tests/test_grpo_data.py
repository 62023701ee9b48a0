"""What train.objective grpo is built on, in process: prompts datasets (`data prepare --format prompts`) rendered as
transformers' apply_chat_template renders them, the reward functions (built-in and a user's file) with their one-line
failures, and the grpo section's checks and validate()'s refusals before launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from math_verify import parse, verify
from transformers import AutoTokenizer

from deepseek_ds.config import ConfigError, load_ds_config, load_run_config, run_config_from_dict, validate
from deepseek_ds.data import (
    ChatDataset,
    DataError,
    PromptDataset,
    load_tokenizer,
    open_training_data,
    prepare_dataset,
    sample_count,
)
from deepseek_ds.rewards import RewardError, resolve_rewards
from helpers import cli, refused

pytestmark = pytest.mark.unit

# Chat turns in both record forms; the third has an earlier exchange, the fourth no answer.
RECORDS = [
    {"prompt": "What is 1/2 as a decimal?", "answer": "0.5"},
    {"messages": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2 + 2?"}],
     "answer": "4"},
    {"messages": [{"role": "user", "content": "3 + 3?"}, {"role": "assistant", "content": "6"},
                  {"role": "user", "content": "and 4 + 4?"}], "answer": "8"},
    {"prompt": "Name a prime number."},
] + [{"prompt": f"What is {k} + {k}?", "answer": str(2 * k)} for k in range(5, 17)]
# A ChatML-like template: a tokenizer with a chat_template renders prompts through it.
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def _messages(record: dict) -> list[dict]:
    return record.get("messages") or [{"role": "user", "content": record["prompt"]}]


def _write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", RECORDS)


@pytest.fixture(scope="module")
def prompts_dir(prompts_file, deepseek_tokenizer_dir, tmp_path_factory) -> str:
    return prepare_dataset([str(prompts_file)], str(tmp_path_factory.mktemp("pds") / "ds"), data_format="prompts",
                           tokenizer_dir=deepseek_tokenizer_dir, valid_fraction=0.25, progress=False)


def _by_text(dataset: PromptDataset) -> dict[str, int]:
    return {dataset.prompt_text(i): i for i in range(len(dataset))}


def test_prompts_are_deepseek_chat_prompts_with_their_answers(prompts_dir, deepseek_tokenizer_dir, capsys):
    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)
    assert not tok.chat_template  # DeepSeek-V3's own format: BOS, system, <｜User｜> turns, <｜Assistant｜>
    bos, eos = tok.bos_token_id, tok.eos_token_id
    user, assistant = tok.convert_tokens_to_ids(["<｜User｜>", "<｜Assistant｜>"])

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    def reference(messages: list[dict]) -> list[int]:
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        out = [bos] + ids(system)
        for m in messages:
            out += [user] + ids(m["content"]) if m["role"] == "user" else \
                [assistant] + ids(m["content"]) + [eos] if m["role"] == "assistant" else []
        return out + [assistant]

    splits = [PromptDataset(prompts_dir, split) for split in ("train", "valid")]
    assert [len(d) for d in splits] == [12, 4]
    found = {}
    for d in splits:
        for i in range(len(d)):
            found[tuple(d.prompt_ids(i))] = (d.prompt_text(i), d.answer(i))
    expected = {tuple(reference(_messages(r))): r.get("answer") for r in RECORDS}
    assert {k: answer for k, (_, answer) in found.items()} == expected
    for key, (text, _) in found.items():
        assert text == tok.decode(list(key), skip_special_tokens=False)
    # The run's view of it: open_training_data dispatches on the format, sample_count counts prompts, and the
    # tokenizer the coordinator decodes completions with is the dataset's own.
    cfg = load_run_config("recipes/tiny-v3.yaml", [f"data.path={prompts_dir}"])
    train = open_training_data(cfg.data, prompts_dir, 0, True, "train")
    assert isinstance(train, PromptDataset) and sample_count(train) == 12
    assert load_tokenizer(prompts_dir).convert_ids_to_tokens(train.prompt_ids(0))[-1] == "<｜Assistant｜>"
    with pytest.raises(DataError, match="is not a chat dataset"):
        ChatDataset(prompts_dir, 64)
    # `data dump` prints a prompt's ids, text and answer.
    assert cli(["data", "dump", "--data", prompts_dir, "--seq-len", "64", "--count", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == {"prompt_ids": train.prompt_ids(0),
                                                   "prompt_text": train.prompt_text(0), "answer": train.answer(0)}


def test_prompts_render_through_a_chat_template_as_apply_chat_template(tmp_path, prompts_file, deepseek_tokenizer_dir):
    templated = tmp_path / "tok"
    shutil.copytree(deepseek_tokenizer_dir, templated)
    config = json.loads((templated / "tokenizer_config.json").read_text())
    (templated / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    tok = AutoTokenizer.from_pretrained(str(templated))
    out = prepare_dataset([str(prompts_file)], str(tmp_path / "ds"), data_format="prompts",
                          tokenizer_dir=str(templated), valid_fraction=0.0, progress=False)
    dataset = PromptDataset(out)
    assert len(dataset) == len(RECORDS)
    by_text = _by_text(dataset)
    for record in RECORDS:
        want = tok.apply_chat_template(_messages(record), add_generation_prompt=True, tokenize=True, return_dict=False)
        text = tok.apply_chat_template(_messages(record), add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|assistant|>")
        i = by_text[text]
        assert dataset.prompt_ids(i) == list(want)
        assert dataset.answer(i) == record.get("answer")


@pytest.mark.parametrize("record, problem", [
    ({"messages": [{"role": "system", "content": "Be brief."}]}, "no user turn"),
    ({"prompt": "   "}, "empty prompt"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
     "ends with an assistant turn"),
    ({"prompt": "2 + 2?", "answer": 4}, "'answer' must be a string"),
    ({"response": "no prompt"}, "needs exactly one of 'prompt'"),
])
def test_a_bad_prompt_line_is_refused_naming_its_line(tmp_path, deepseek_tokenizer_dir, capsys, record, problem):
    path = _write(tmp_path / "bad.jsonl", [RECORDS[0], record])
    argv = ["data", "prepare", "--input", str(path), "--out", str(tmp_path / "ds"), "--format", "prompts",
            "--tokenizer", deepseek_tokenizer_dir, "--no-progress"]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:2: " in err and problem in err, err
    assert not (tmp_path / "ds" / "meta.json").exists()
    if problem == "no user turn":  # --skip-bad: skipped and counted instead
        out = prepare_dataset([str(path)], str(tmp_path / "skipped"), data_format="prompts", skip_bad=True,
                              tokenizer_dir=deepseek_tokenizer_dir, valid_fraction=0.0, progress=False)
        meta = json.loads((Path(out) / "meta.json").read_text())
        assert meta["bad_lines"] == 1 and problem in meta["bad_line_errors"][0] and len(PromptDataset(out)) == 1


def _reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text("def length(prompts, completions, answers):\n    return [len(c) for c in completions]\n\n"
                    "def boom(prompts, completions, answers):\n    raise KeyError('no such thing')\n\n"
                    "def short(prompts, completions, answers):\n    return [1.0]\n\n"
                    "def words(prompts, completions, answers):\n    return ['high' for c in completions]\n\n"
                    "def nan(prompts, completions, answers):\n    return [float('nan') for c in completions]\n")
    return path


def test_rewards_built_in_and_a_users_own_weighted(tmp_path):
    completions = [" 0.5\n", "\\frac{1}{2}", "1/3", "0.50"]
    answers = ["0.5"] * 4
    prompts = ["p"] * 4
    path = _reward_file(tmp_path)
    rewards = resolve_rewards(["exact_match", "math", f"{path}:length"], [2.0, 1.0, 0.5])
    assert rewards.names == ["exact_match", "math", "length"] and rewards.weights == [2.0, 1.0, 0.5]
    total, each = rewards.score(prompts, completions, answers)
    exact = [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]
    math = [float(verify(parse(a), parse(c))) for c, a in zip(completions, answers)]
    assert each == {"exact_match": exact, "math": math, "length": [float(len(c)) for c in completions]}
    assert exact == [1.0, 0.0, 0.0, 0.0] and math == [1.0, 1.0, 0.0, 1.0]  # \frac{1}{2} and 0.50 equal 0.5
    assert total == [2 * e + m + 0.5 * len(c) for e, m, c in zip(exact, math, completions)]
    assert resolve_rewards(["exact_match"], None).weights == [1.0]


@pytest.mark.parametrize("spec, match", [
    ("boom", r"^reward function boom failed: KeyError: 'no such thing'$"),
    ("short", r"^reward function short returned 1 rewards for 2 completions"),
    ("words", r"^reward function words returned 'high' for completion 0, not a finite number"),
    ("nan", r"^reward function nan returned nan for completion 0, not a finite number"),
])
def test_a_failing_reward_function_is_one_line_naming_it(tmp_path, spec, match):
    rewards = resolve_rewards([f"{_reward_file(tmp_path)}:{spec}"], None)
    with pytest.raises(RewardError, match=match) as e:
        rewards.score(["p", "q"], ["a", "b"], ["a", None])
    assert "\n" not in str(e.value)
    with pytest.raises(RewardError, match=r"^reward function exact_match failed: ValueError: 1 of 2 prompts have no "
                                          r"answer"):
        resolve_rewards(["exact_match"], None).score(["p", "q"], ["a", "b"], ["a", None])


def test_reward_specs_that_do_not_resolve_are_refused(tmp_path):
    path = _reward_file(tmp_path)
    for specs, weights, match in [
        (["nope"], None, r"'nope' is not a built-in reward: use exact_match, math or path/to/file.py:function"),
        ([f"{tmp_path}/missing.py:length"], None, r"no such file"),
        ([f"{path}:absent"], None, r"defines no 'absent' \(its functions: boom, length, nan, short, words\)"),
        (["exact_match", "math"], [1.0], r"grpo.reward_weights has 1 weights for 2 reward functions"),
        (["math", "math"], None, r"lists 'math' more than once"),
    ]:
        with pytest.raises(RewardError, match=match):
            resolve_rewards(specs, weights)


def test_grpo_section_fields_are_checked_and_unknown_keys_refused():
    g = run_config_from_dict({"train": {"objective": "grpo"}}).grpo
    assert (g.num_generations, g.max_completion_length, g.temperature, g.top_p, g.beta, g.epsilon, g.epsilon_high,
            g.loss_type, g.importance_sampling_level, g.num_iterations, g.scale_rewards, g.reward, g.reward_weights,
            g.router_replay, g.rollouts) == (8, 512, 1.0, 1.0, 0.0, 0.2, None, "dapo", "token", 1, "group",
                                             ["exact_match"], None, False, "rollouts.jsonl")
    for values, match in [({"colour": 1}, r"unknown key 'grpo.colour'"),
                          ({"num_generations": 1}, r"grpo.num_generations = 1 must be >= 2"),
                          ({"loss_type": "bnpo"}, r"grpo.loss_type = 'bnpo': use 'grpo', 'dapo' or 'dr_grpo'"),
                          ({"importance_sampling_level": "seq"}, r"use 'token' or 'sequence'"),
                          ({"scale_rewards": True}, r"grpo.scale_rewards = True has the wrong type"),
                          ({"reward": ["math"], "reward_weights": [1.0, 2.0]}, r"has 2 weights for 1 reward"),
                          ({"top_p": 0}, r"grpo.top_p = 0.0 must be in \(0, 1\]"),
                          ({"rollouts": "a/b.jsonl"}, r"must be a file name")]:
        with pytest.raises(ConfigError, match=match):
            run_config_from_dict({"grpo": values})


def test_grpo_is_refused_before_launch_where_it_cannot_run(tmp_path, prompts_dir, prompts_file, deepseek_tokenizer_dir):
    messages = []

    def refuse(*args, **kwargs):  # each refusal one listed line of validate's message
        messages.append(refused(*args, **kwargs))

    reward = _reward_file(tmp_path)

    def config(*sets):
        cfg = load_run_config("recipes/tiny-v3.yaml", ["model.overrides.vocab_size=129280", "eval.interval=0",
                                                       *sets])
        return cfg, load_ds_config(cfg.deepspeed_config)

    grpo = (f"data.path={prompts_dir}", "train.objective=grpo", "grpo.num_generations=4",
            "train.global_batch_size=16", "train.micro_batch_size=4")
    answered = (*grpo, f"grpo.reward=[{reward}:length]")  # one prompt has no answer: a function of one's own
    validate(*config(*answered), 2, cuda_available=False)  # 4 prompts a step, 2 for each of 2 ranks
    refuse(*config(*grpo), world=2, match=r"grpo.reward exact_match compares each completion with its prompt's "
                                           r"answer, but 1 prompts of data.path .* \(train split\) have none")
    refuse(*config(*answered, "grpo.num_generations=3"), world=2,
            match=r"train.global_batch_size = 16 counts completions and must be divisible by grpo.num_generations = 3")
    refuse(*config(*answered, "grpo.num_generations=8"), world=4,
            match=r"= 2 prompts a step do not divide over the 4 data-parallel ranks")
    validate(*config(*answered, "grpo.num_iterations=2", "train.steps=10", "checkpoint.interval=4"), 2,
             cuda_available=False)
    for field in ("train.steps", "checkpoint.interval"):  # a checkpoint falls between generations
        refuse(*config(*answered, "grpo.num_iterations=2", "train.steps=10", "checkpoint.interval=4", f"{field}=5"),
               world=2, match=rf"{field} = 5 with grpo.num_iterations = 2: checkpoints are taken between generations "
                              r"\(each has 2 updates\), so it must be a multiple of 2")
    longest = max(PromptDataset(prompts_dir, split).longest() for split in ("train", "valid"))
    assert longest == max(len(PromptDataset(prompts_dir, split).prompt_ids(i)) for split in ("train", "valid")
                          for i in range(len(PromptDataset(prompts_dir, split))))
    fits = 1024 - longest  # tiny-v3's max_position_embeddings
    validate(*config(*answered, f"grpo.max_completion_length={fits}"), 2, cuda_available=False)
    refuse(*config(*answered, f"grpo.max_completion_length={fits + 1}"), world=2,
           match=rf"grpo.max_completion_length \({fits + 1}\) after data.path's longest prompt \({longest} tokens\) "
                 rf"makes rows of 1025 tokens, past the model's max_position_embeddings \(1024\): lower "
                 rf"grpo.max_completion_length to {fits} or less")
    refuse(*config(*answered, "parallel.pipeline_stages=2"), world=2,
            match=r"generates its rollouts with the whole model on every rank, but parallel.pipeline_stages = 2")
    validate(*config(*answered, "parallel.expert_parallel=2"), 2, cuda_available=False)
    refuse(*config(*answered, "parallel.expert_parallel=2", "lora.r=4"), world=2,
           match=r"grpo with lora.r = 4 and parallel.expert_parallel = 2: the rollouts' model is gathered")
    refuse(*config(*grpo, f"grpo.reward=[{reward}:absent]"), world=2, match=r"defines no 'absent'")
    refuse(*config(*grpo, f"grpo.reward=[{tmp_path}/gone.py:f]"), world=2, match=r"no such file")
    refuse(*config(f"data.path={prompts_dir}"), world=2, match=r"is a prompts dataset \(RL prompts, nothing to "
                                                                r"train on\): set train.objective: grpo")
    refuse(*config(f"data.path={prompts_dir}", "train.objective=dpo"), world=2, match=r"is not a preference dataset")
    chat = tmp_path / "chat.jsonl"
    _write(chat, [{"prompt": r["prompt"], "response": r.get("answer", "2")} for r in RECORDS if "prompt" in r])
    chat_dir = prepare_dataset([str(chat)], str(tmp_path / "chat"), data_format="chat",
                               tokenizer_dir=deepseek_tokenizer_dir, valid_fraction=0.0, progress=False)
    refuse(*config(*answered, f"data.path={chat_dir}"), world=2,
            match=r"train.objective is grpo but data.path .* is a chat dataset, not a prompts dataset")
    refuse(*config("train.objective=grpo"), world=1, match=r"train.objective grpo needs data.path")
    refuse(*config(f"data.blend={{{prompts_dir}: 1.0}}"), world=1, match=r"data.blend of prompts datasets")
    assert len(messages) == 15 and all(m.startswith("invalid configuration:\n  - ") for m in messages)
