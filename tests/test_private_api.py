"""The seam to private DeepSpeed/torch/transformers names (deepseek_ds/utils/private_api.py): every name in its
table exists in the installed versions, and a name that does not is reported with its owner, the package version
and why the project uses it. The rest of the package reaches them only through the seam."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

from deepseek_ds.utils import private_api
from deepseek_ds.utils.private_api import PRIVATE
from helpers import ROOT

pytestmark = pytest.mark.unit

SEAM = "deepseek_ds/utils/private_api.py"
SEAM_MODULES = (SEAM, "deepseek_ds/utils/private_pipeline.py",  # the seam's modules (PRIVATE is in the first)
                "deepseek_ds/utils/private_optimizer.py")


def _version(owner: str) -> str:
    package = owner.split(".")[0]
    names = {"deepspeed": "DeepSpeed", "torch": "torch", "transformers": "transformers"}
    return f"{names.get(package, package)} {getattr(importlib.import_module(package), '__version__', '?')}"


def _in_class_source(cls: type, attr: str) -> bool:
    """An instance attribute: set or named in the source of the class or a base (name-mangled ones as written)."""
    mangled = re.match(r"^_(\w+?)(__\w+)$", attr)
    spelled = mangled.group(2) if mangled and mangled.group(1) == cls.__name__ else attr
    pattern = re.compile(rf"(self\.{re.escape(spelled)}\b|['\"]{re.escape(spelled)}['\"])")
    for base in cls.__mro__[:-1]:
        try:
            if pattern.search(inspect.getsource(base)):
                return True
        except (OSError, TypeError):  # a class defined in C
            continue
    return False


def _has(owner: object, owner_path: str, attr: str) -> bool:
    if hasattr(owner, attr):
        return True
    if inspect.ismodule(owner):  # a submodule not imported yet
        try:
            importlib.import_module(f"{owner_path}.{attr}")
            return True
        except ImportError:
            return False
    if inspect.isfunction(owner):  # a keyword parameter
        return attr in inspect.signature(owner).parameters
    return inspect.isclass(owner) and _in_class_source(owner, attr)


def missing(entries) -> list[str]:
    """One line per entry the installed packages lack."""
    out = []
    for owner_path, attr, reason in entries:
        try:
            owner = pkgutil.resolve_name(owner_path)
        except (ImportError, AttributeError, ValueError):
            out.append(f"{_version(owner_path)} no longer has {owner_path} (used for {reason}): see {SEAM}")
            continue
        if not _has(owner, owner_path, attr):
            out.append(f"{_version(owner_path)} no longer has {owner_path}.{attr} (used for {reason}): see {SEAM}")
    return out


@pytest.mark.parametrize("entry", PRIVATE, ids=[f"{o.rsplit('.', 1)[-1]}.{a}" for o, a, _ in PRIVATE])
def test_every_private_name_exists(entry):
    problems = missing([entry])
    assert not problems, problems[0]


@pytest.mark.parametrize("entry", [("torch.nn.Module", "_no_such_buffers", "a reason"),
                                   ("deepspeed.runtime.engine.DeepSpeedEngine", "_no_such_step", "a reason"),
                                   ("deepspeed.utils.groups", "_no_such_rank", "a reason"),
                                   ("deepspeed.no_such_module.Thing", "_x", "a reason")])
def test_a_missing_name_is_reported_with_where_and_why(entry):
    owner, attr, _ = entry
    (problem,) = missing([entry])
    package = "DeepSpeed" if owner.startswith("deepspeed") else "torch"
    assert re.match(rf"^{package} \S+ no longer has {re.escape(owner)}(\.{attr})? \(used for a reason\): see "
                    rf"{re.escape(SEAM)}$", problem), problem


def test_the_table_names_every_private_name_the_seam_uses():
    """Each private attribute the seam's code touches is an entry of PRIVATE (so the test above covers it)."""
    source = Path(private_api.__file__).read_text()
    code = source[source.index("\ndef all_process_groups"):]
    used = set(re.findall(r"\.(_[A-Za-z]\w*)\b", code)) | set(re.findall(r"^\w+ = \"(_\w+)\"", code, re.M))
    used |= set(re.findall(r"attr\([^,]+,\s*\"(_\w+)\"", code))  # getattr(obj, "_name", ...)
    used |= {"_SeqAllToAll"}  # imported by name
    assert used <= {attr for _, attr, _ in PRIVATE}, used - {attr for _, attr, _ in PRIVATE}


OWNED = ("deepseek_ds",)  # the whole package: only the seam itself reaches private names
# obj._name (self's too: a subclass reading its base's), an imported private name, getattr(obj, "_name"), ...
_PRIVATE_ACCESS = re.compile(r"(?<![\w.])[A-Za-z_][\w.]*\.(_[A-Za-z]\w*)|import[^#\n]*\b(_[A-Za-z]\w*)"
                             r"|(?:get|set|has|del)attr\([^,]+,\s*['\"](_[A-Za-z]\w*)['\"]")
# The project's own marks on tensors (models/layers.py: what document_attention knows of a stage's position ids).
TENSOR_TAGS = {"_one_document", "_document_attention"}
# Underscored names the standard library documents: os._exit (a forked child's or a dying rank's exit without
# cleanup), argparse's sub-parser and mutually exclusive group classes (type hints only).
DOCUMENTED = {"_exit", "_SubParsersAction", "_MutuallyExclusiveGroup"}


def _project_names(files) -> set[str]:
    """Private names these files define (a module's own helpers, an object's own fields)."""
    # def/class _x, _x = / _x: T =, _x, _y = (a module's tuple of constants), import ... as _x
    defined = re.compile(r"^\s*(?:def|class)\s+(_\w+)|^\s*(_\w+)\s*[:=,]|^\s*_\w+\s*,\s*(_\w+)\s*=|\bas\s+(_\w+)",
                         re.M)
    targets = re.compile(r"^\s*((?:[\w.]+\s*,\s*)*[\w.]+)\s*(?::[^=\n]*)?=(?!=)", re.M)  # a = / a, b = / a: T =
    names = set()
    for f in files:
        text = f.read_text()
        names |= {next(g for g in m.groups() if g) for m in defined.finditer(text)}
        names |= {n for m in targets.finditer(text) for n in re.findall(r"\bself\.(_\w+)", m.group(1))}
    return names


def _files(paths, root) -> list[Path]:
    return sorted(f for top in paths for f in ([Path(root) / top] if (Path(root) / top).is_file()
                                                else (Path(root) / top).rglob("*.py")))


def private_accesses(paths, root=ROOT) -> list[str]:
    """`file:line: access` for each private name of DeepSpeed, torch or transformers that `paths` (files or folders
    under `root`) name: any private name that neither the package (the seam aside) nor these files define."""
    files = [f for f in _files(paths, root) if f not in {Path(root) / m for m in SEAM_MODULES}]
    package = [f for f in _files(["deepseek_ds"], ROOT) if f not in {Path(ROOT) / m for m in SEAM_MODULES}]
    foreign = {attr for _, attr, _ in PRIVATE}  # defining one (an override, a field of a subclass) is using it
    ours, found = (_project_names(package + files) | TENSOR_TAGS | DOCUMENTED) - foreign, []
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#")[0]
            for m in _PRIVATE_ACCESS.finditer(code):
                name = next(g for g in m.groups() if g)
                if not name.startswith("__") and name not in ours:
                    found.append(f"{f.relative_to(root)}:{i}: {m.group(0)}")
            found += [f"{f.relative_to(root)}:{i}: {m.group(0)}" for m in re.finditer(r"\bdef (_\w+)", code)
                      if m.group(1) in foreign]
    return found


def test_private_names_are_reached_through_the_seam_only():
    """No module of these packages names a private attribute of DeepSpeed, torch or transformers (the project's own
    private helpers and fields aside)."""
    found = private_accesses(OWNED)
    assert not found, "private names outside " + SEAM + ":\n" + "\n".join(found)


@pytest.mark.parametrize(("line", "access"), [
    ("stage = self._topo.get_coord(self.global_rank).pipe", "self._topo"),
    ("def _partition_layers(self, method='fixed'): pass", "def _partition_layers"),
    ("config._experts_implementation = name", "config._experts_implementation"),
    ("from torch.utils.cpp_extension import _get_build_directory",
     "import _get_build_directory"),
    ('keep = getattr(model, "_keep_in_fp32_modules_strict", None)', 'getattr(model, "_keep_in_fp32_modules_strict"'),
    ('log = logging.getLogger("torch.onnx._internal.exporter._registration")',
     "torch.onnx._internal.exporter._registration"),
])
def test_a_private_access_outside_the_seam_is_found(line, access, tmp_path):
    """Each kind of access the seam took over, written in a module again, is reported; the module's own private
    field (self._parts, set in a tuple assignment) and the project's tensor tags are not."""
    (tmp_path / "stage.py").write_text(
        "class Stage:\n    def __init__(self):\n        self._parts, self.n = [], 0\n\n"
        "    def run(self, model, config, name, ids):\n        ids._one_document = self._parts\n"
        f"        {line}\n")
    assert private_accesses(["stage.py"], root=tmp_path) == [f"stage.py:7: {access}"]


def test_instance_and_class_replacements_are_undone():
    class Engine:
        def step(self):
            return "class"

    e = Engine()
    with private_api.instance_method_replaced(e, "step", lambda: "patched") as original:
        assert e.step() == "patched" and original() == "class" and Engine().step() == "class"
    assert e.step() == "class" and "step" not in vars(e)
    with private_api.attribute_replaced(Engine, "step", lambda self: "all"):
        assert Engine().step() == "all"
    assert Engine().step() == "class"
