"""The dependency locks (requirements/cpu.txt, requirements/cuda.txt, written by scripts/lock.sh) against setup.py's
ranges, each other, and the environment scripts/setup.sh installed with them: a setup.py edit without a re-lock, a
lock that pulls CUDA into the CPU set, or a .venv that drifted from its lock fails here, offline."""

from __future__ import annotations

import ast
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from helpers import ROOT

pytestmark = pytest.mark.unit

CUDA_ONLY = ("nvidia-", "cuda-", "triton")


def _setup_requirements() -> list[Requirement]:
    """install_requires plus the `test` extra, read from setup.py's literal call (setup.py is not run)."""
    tree = ast.parse((Path(ROOT) / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return [Requirement(r) for r in kw["install_requires"] + kw["extras_require"]["test"]]


def _lock(variant: str) -> dict[str, Version]:
    pins = {}
    for line in (Path(ROOT) / "requirements" / f"{variant}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version and ";" not in version, f"{variant}.txt: not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = Version(version)
    return pins


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_lock_pins_every_requirement_within_setup_py_range(variant):
    pins = _lock(variant)
    bad = []
    for req in _setup_requirements():
        pin = pins.get(canonicalize_name(req.name))
        if pin is None or not req.specifier.contains(pin, prereleases=True):
            bad.append(f"{req} -> {pin or 'not pinned'}")
    assert not bad, f"requirements/{variant}.txt is stale against setup.py (run bash scripts/lock.sh): {bad}"


def test_cpu_lock_has_the_cpu_torch_and_no_cuda_libraries():
    pins = _lock("cpu")
    assert pins["torch"] == Version("2.13.0+cpu")
    assert not [n for n in pins if n.startswith(CUDA_ONLY)]


def test_cuda_lock_has_pypi_torch_with_its_cuda_libraries():
    pins = _lock("cuda")
    assert pins["torch"] == Version("2.13.0")
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton"} <= set(pins)


def test_locks_agree_apart_from_torch_and_cuda():
    """CPU CI tests the stack the CUDA image runs: the same version of every package both need."""
    cpu, cuda = _lock("cpu"), _lock("cuda")
    cuda = {n: v for n, v in cuda.items() if not n.startswith(CUDA_ONLY) and n != "torch"}
    differ = {n: (str(cpu.get(n)), str(cuda.get(n))) for n in (set(cpu) | set(cuda)) - {"torch"} if cpu.get(n) != cuda.get(n)}
    assert not differ, f"(cpu, cuda) versions differ (re-run bash scripts/lock.sh): {differ}"


def test_environment_matches_its_lock():
    """The lock setup.sh picks for this environment's torch build, against what is installed."""
    variant = "cpu" if metadata.version("torch").endswith("+cpu") else "cuda"
    drift = []
    for name, pin in _lock(variant).items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            drift.append(f"{name}: not installed (lock {pin})")
            continue
        if installed != pin:
            drift.append(f"{name}: {installed} (lock {pin})")
    assert not drift, f"this environment drifted from requirements/{variant}.txt (run bash scripts/setup.sh): {drift}"
