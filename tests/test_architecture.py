"""The package's shape: imports run one way through the layers of pyproject.toml's import-linter contract
(utils -> launcher | models | data -> parallel -> config -> checkpoint -> training -> inference | bench -> cli), with no cycle
between the modules of any package, function-level imports included; every top-level package sits in a layer; no
module is over 400 lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from importlinter.api import read_configuration

from helpers import BIN, ROOT

pytestmark = pytest.mark.unit

PACKAGE = Path(ROOT) / "deepseek_ds"
MAX_LINES = 400


def _contracts() -> list[dict]:
    return read_configuration(str(Path(ROOT) / "pyproject.toml"))["contracts_options"]


def _chain(graph, importer: str, imported: str) -> str:
    """importer -> ... -> imported, each step with the line that imports."""
    chain = graph.find_shortest_chain(importer, imported, as_packages=True) or ()
    steps = []
    for a, b in zip(chain, chain[1:]):
        details = graph.get_import_details(importer=a, imported=b)
        where = f"{details[0]['line_number']}: {details[0]['line_contents']}" if details else "?"
        steps.append(f"    {a} -> {b}   (line {where})")
    return "\n".join(steps)


def cycles(package: str = "deepseek_ds") -> list[str]:
    """Each pair of sibling modules or packages that import each other (directly or not), both ways round."""
    graph = grimp.build_graph(package, cache_dir=None)
    found = []
    for parent in sorted(m for m in graph.modules if graph.find_children(m)):
        children = sorted(graph.find_children(parent))
        for i, a in enumerate(children):
            for b in children[i + 1:]:
                if graph.chain_exists(a, b, as_packages=True) and graph.chain_exists(b, a, as_packages=True):
                    found.append(f"{a} <-> {b}\n{_chain(graph, a, b)}\n{_chain(graph, b, a)}")
    return found


def test_imports_follow_the_layers_without_cycles():
    """import-linter prints each broken layer rule with its import chains; for a cycle it names only the import to
    drop, so both directions of every cycle are listed below it."""
    proc = subprocess.run([os.path.join(BIN, "lint-imports"), "pyproject.toml", "--no-cache", "--no-logo"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        found = "\n".join(cycles())
        pytest.fail(f"lint-imports exited {proc.returncode}:\n{proc.stdout}{proc.stderr}\n"
                    f"{'cycles:' if found else ''}\n{found}", pytrace=False)


def test_every_top_level_package_is_in_a_layer():
    """A new top-level module or package must be given a place in the layers (or its imports go unchecked)."""
    layered = set()
    for contract in _contracts():
        for layer in contract.get("layers", []):
            layered |= {name.strip().strip("()").removeprefix("deepseek_ds.") for name in layer.split("|")}
    present = {p.stem for p in PACKAGE.iterdir() if (p.suffix == ".py" and p.stem != "__init__")
               or (p.is_dir() and (p / "__init__.py").exists())}
    missing = sorted(present - layered)
    assert not missing, f"not in a layer of pyproject.toml's import-linter contract: {missing}"


def test_no_module_over_400_lines():
    counts = {str(p.relative_to(ROOT)): sum(1 for _ in open(p, encoding="utf-8")) for p in PACKAGE.rglob("*.py")}
    over = sorted((n, name) for name, n in counts.items() if n > MAX_LINES)
    assert not over, f"modules over {MAX_LINES} lines: " + ", ".join(f"{name} ({n})" for n, name in reversed(over))


def test_the_contract_catches_a_cycle_and_an_import_against_the_layers(tmp_path):
    """The check can fail: in a toy package of two layers, `utils` importing `config` breaks both contracts."""
    pkg = tmp_path / "toy"
    for name in ("utils", "config"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "a.py").write_text("from ..utils import b\n")
    (pkg / "utils" / "b.py").write_text("def f():\n    from ..config import a  # a function-level import counts too\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.importlinter]\nroot_packages = ["toy"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "layers"\ntype = "layers"\nlayers = ["toy.config", "toy.utils"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "acyclic"\ntype = "acyclic_siblings"\nancestors = ["toy"]\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([os.path.join(BIN, "lint-imports"), "pyproject.toml", "--no-cache"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 broken" in proc.stdout and "toy.utils.b -> toy.config.a" in proc.stdout, proc.stdout


@pytest.mark.unit
def test_the_console_script_module_is_light():
    """Spawned processes (data prepare's workers) re-import the `deepseek-ds` script's module: it must not pull in
    the CLI's deepspeed and transformers (seconds of CPU per worker)."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "deepseek-ds"]
    code = f"import sys, {script.module}; print(sorted({{'deepspeed', 'transformers'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def objective_branches(source: str, names) -> list[str]:
    """The lines of a module's source that name an objective or its pieces: a branch on the objective."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b|preference|is_dpo|train\.objective",
                         re.IGNORECASE)
    return [line.strip() for line in source.splitlines() if pattern.search(line)]


def test_the_training_loop_never_branches_on_the_objective():
    """Objectives are objects (training/objectives/): the loop names none of them, only run.objective, and the
    registry holds every train.objective the config accepts. The check can fail: the loop before the objectives
    branched on DPO."""
    from deepseek_ds.config.schema import OBJECTIVES as ACCEPTED
    from deepseek_ds.training.objectives import OBJECTIVES

    assert sorted(OBJECTIVES) == sorted(ACCEPTED)
    names = [*OBJECTIVES, *(o.__name__ for o in OBJECTIVES.values())]
    loop = (PACKAGE / "training" / "loop.py").read_text(encoding="utf-8")
    assert objective_branches(loop, names) == []
    assert objective_branches("    if preference.is_dpo(run):\n        return 1\n", names)
    assert objective_branches('    dpo = run.cfg.train.objective == "dpo"\n', names)


def test_the_run_is_not_changed_once_built():
    """training.run.Run is frozen: what an objective keeps across steps is the objective's own (Run.objective), so
    setting a field after build_run raises. The check can fail: DPO and GRPO set run.reference before."""
    import dataclasses

    from deepseek_ds.training.run import Run

    fields = {f.name for f in dataclasses.fields(Run)}
    assert Run.__dataclass_params__.frozen
    assert not fields & {"reference", "valid_reference", "base_buffers"}
