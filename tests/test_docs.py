"""The documentation: the generated reference pages are fresh and cover the code, the mkdocs site builds with
--strict, every relative link in README.md and docs/ resolves, and the README stays a front door (its Quick start
commands unchanged, at most 300 lines)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = pytest.mark.unit

ROOT_PATH = Path(ROOT)
# [text](target) and ![alt](target), the target up to a space (a title) or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


@pytest.fixture(scope="module")
def gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT_PATH / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_are_fresh(gen_docs):
    stale = gen_docs.stale_pages()
    assert not stale, f"{', '.join(stale)} differ from the code: run `python scripts/gen_docs.py` and commit them"


def test_reference_covers_every_field_command_and_refusal(gen_docs):
    """Checked against the code itself, not the generator's own walk: each run-YAML field, each sub-command path and
    each validate() message fragment must appear in the pages."""
    from deepseek_ds import cli
    from deepseek_ds.config import schema

    pages = {path.name: text for path, text in gen_docs.pages().items()}
    hints = typing.get_type_hints(schema.RunConfig)
    for f in dataclasses.fields(schema.RunConfig):
        cls = hints[f.name]
        names = [f"{f.name}.{schema.yaml_key(s)}" for s in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else [f.name]
        for name in names:
            assert f"`{name}`" in pages["config.md"], name
    assert "| `train.lr` | `float` | `0.003` | Peak learning rate, after the warm-up. |" in pages["config.md"]

    help_text = subprocess.run([sys.executable, "-m", "deepseek_ds", "--help"], capture_output=True, text=True,
                               cwd=ROOT, check=True).stdout
    commands = re.findall(r"^    ([a-z][a-z-]*)", help_text.split("COMMAND\n", 1)[1], re.M)
    assert {"train", "plan", "export", "bench"} <= set(commands), help_text
    for command in commands:
        assert f"## `deepseek-ds {command}`" in pages["cli.md"], command
    parser = cli.build_parser()
    plan = next(a for a in parser._actions if a.choices and "plan" in a.choices).choices["plan"]
    for action in plan._actions:
        for flag in action.option_strings if not isinstance(action, argparse._HelpAction) else []:
            assert f"`{flag}`" in pages["cli.md"], flag

    source = "".join((ROOT_PATH / "deepseek_ds" / "config" / name).read_text() for name in ("validate.py",
                                                                                              "model_rules.py"))
    for fragment in ("cannot be combined", "fp16 needs a CUDA GPU", "holds only PyTorch pickle weights",
                     "is never scored with eval.interval 0", "needs an MoE layer on every pipeline stage"):
        assert fragment in source and fragment in pages["refusals.md"], fragment


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr  # no bound on its wall time: that is the host's
    index = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "train.global_batch_size" in index


def broken_links(path: Path) -> list[str]:
    """The relative link targets in a markdown file that name no existing file or folder (#anchors are ignored)."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        relative = target.split("#", 1)[0]
        if relative.startswith("/") or not (path.parent / relative).exists():
            broken.append(target)
    return broken


def _markdown_files() -> list[Path]:
    return [ROOT_PATH / "README.md", *sorted((ROOT_PATH / "docs").rglob("*.md"))]


def test_every_relative_link_resolves():
    files = _markdown_files()
    assert len(files) > 20
    broken = {str(f.relative_to(ROOT_PATH)): links for f in files if (links := broken_links(f))}
    assert not broken, f"links to files that do not exist: {broken}"


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#part) [gone](missing.md) ![img](gone.png) [web](https://example.org) [a](#x)\n"
                    "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n[abs](/etc/passwd)\n")
    assert broken_links(page) == ["missing.md", "gone.png", "/etc/passwd"]


def test_readme_is_a_front_door():
    text = (ROOT_PATH / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    quick = text.split("## Quick start", 1)[1]
    assert quick.lstrip().startswith("```bash\nbash scripts/demo.sh\nbash scripts/test.sh\n```")
    assert "The second command runs the whole test suite (" in quick.split("\n## ", 1)[0]
    assert "## Repository layout" in text


def documented_runs() -> list[tuple[str, str, str]]:
    """(file, command, printed output) of every fenced block in the docs that starts with `$ deepseek-ds ...`
    (backslash-continued lines joined) followed by what the command prints."""
    runs = []
    for path in _markdown_files():
        for block in re.findall(r"^```[a-z]*\n(\$ deepseek-ds .*?)^```", path.read_text(), re.S | re.M):
            lines = block.splitlines()
            command = lines.pop(0)[2:]
            while command.endswith("\\"):
                command = command[:-1] + " " + lines.pop(0).strip()
            runs.append((str(path.relative_to(ROOT_PATH)), command, "\n".join(lines)))
    return runs


def test_documented_outputs_are_what_the_commands_print(monkeypatch):
    """The plan and partition tables quoted in the docs, re-run: a planner change that moves a number fails here
    until the page is updated."""
    from deepseek_ds import cli

    runs = documented_runs()
    assert len(runs) >= 6, runs
    monkeypatch.chdir(ROOT)
    for where, command, expected in runs:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            status = cli.main(shlex.split(command)[1:])
        assert status in (0, 1), (where, command, printed.getvalue())
        assert printed.getvalue().rstrip("\n").splitlines() == expected.splitlines(), \
            f"{where}: `{command}` prints something else now: update the page with its output"


_V3_LORA = ("deepseek-ds plan --config recipes/deepseek-v3.yaml --set lora.r=16 --set model.overrides.num_nextn_predict_layers=0"
            " --set lora.routed_experts=")
_V2_LITE_128K = ("deepseek-ds plan --config recipes/sft-deepseek-v2-lite-128k.yaml --set model.path=null "
                 "--set model.preset=deepseek-v2-lite --gpus 8 --gpu h100")
# Plan figures quoted outside a `$ deepseek-ds plan` block: (page, the text quoted, the plan that prints its figures).
QUOTED_PLANS = [
    ("README.md", "78.94 GiB (99%)",
     _V3_LORA + "true --deepspeed_config ds_configs/zero1_bf16.json --gpus 32 --gpu h100 --layout pp=1,ep=32,zero=1"),
    ("README.md", "119.30 GiB (85%)",
     _V3_LORA + "true --deepspeed_config ds_configs/zero1_bf16.json --gpus 16 --gpu h200 --layout pp=1,ep=16,zero=1"),
    ("README.md", "64.55 GiB (81%)",
     _V3_LORA + "true --deepspeed_config ds_configs/zero3_bf16.json --gpus 24 --gpu h100 --layout pp=1,ep=1,zero=3"),
    ("docs/guides/plan.md", "EP=16 on 32 GPUs needs 117.57 GiB",
     _V3_LORA + "true --deepspeed_config ds_configs/zero1_bf16.json --gpus 32 --gpu h100 --layout pp=1,ep=16,zero=1"),
    ("docs/guides/plan.md", "64 GPUs with EP=64: 58.76 GiB, 73%",
     _V3_LORA + "true --deepspeed_config ds_configs/zero1_bf16.json --gpus 64 --gpu h100 --layout pp=1,ep=64,zero=1"),
    ("docs/guides/plan.md", "EP=8 needs 196.56 GiB",
     _V3_LORA + "true --deepspeed_config ds_configs/zero1_bf16.json --gpus 16 --gpu h200 --layout pp=1,ep=8,zero=1"),
    ("docs/guides/plan.md", "76.67 GiB on 32 H100s",
     _V3_LORA + "false --deepspeed_config ds_configs/zero1_bf16.json --gpus 32 --gpu h100 --layout pp=1,ep=32,zero=1"),
    ("docs/guides/plan.md", "114.77 GiB on 16 H200s",
     _V3_LORA + "false --deepspeed_config ds_configs/zero1_bf16.json --gpus 16 --gpu h200 --layout pp=1,ep=16,zero=1"),
    ("docs/guides/long-context.md", "needs 144.45 GiB per GPU, 115.01 GiB of it activations",
     _V2_LITE_128K + " --layout sp=1"),
    ("docs/guides/plan.md", "1F1B's bubble is 32% (14.71 s/step, fullest rank 22.53 GiB)",
     "deepseek-ds plan --config recipes/deepseek-v3.yaml --gpus 2048 --gpu-memory 80GB "
     "--layout pp=16,ep=64,tp=1,zero=1,micro=1 --set train.global_batch_size=4096"),
]
PLAN_FIGURE = re.compile(r"\d+\.\d\d GiB|\d+%")


def test_plan_figures_quoted_in_prose_are_what_plan_prints(monkeypatch):
    """Outside the re-run blocks: every GiB figure with two decimals in the prose of the pages that quote plans, and
    every row of the README's LoRA table, is one of QUOTED_PLANS, whose plan must print each of its figures."""
    from deepseek_ds import cli

    monkeypatch.chdir(ROOT)
    pages = {page: " ".join(FENCE.sub("", (ROOT_PATH / page).read_text()).split()) for page, _, _ in QUOTED_PLANS}
    quoted = {(page, figure) for page, text, _ in QUOTED_PLANS for figure in PLAN_FIGURE.findall(text)}
    for page in ("docs/guides/plan.md", "docs/guides/long-context.md"):
        for figure in re.findall(r"\d+\.\d\d GiB", pages[page]):
            assert (page, figure) in quoted, f"{page} quotes {figure} of no plan: add it to QUOTED_PLANS"
    table_rows = re.findall(r"^\|[^|\n]*\| EP=[^|\n]*\| ([0-9.]+ GiB \(\d+%\)) \|$", (ROOT_PATH / "README.md").read_text(),
                            re.M)
    assert table_rows and all(("README.md", row.split(" (")[0]) in quoted for row in table_rows), table_rows
    for page, text, command in QUOTED_PLANS:
        assert text in pages[page], f"{page} no longer says {text!r}: update QUOTED_PLANS"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            status = cli.main(shlex.split(command)[1:])
        assert status in (0, 1), (command, printed.getvalue())
        for figure in PLAN_FIGURE.findall(text):
            assert figure in printed.getvalue(), f"{page}: {text!r}, but `{command}` prints\n{printed.getvalue()}"
