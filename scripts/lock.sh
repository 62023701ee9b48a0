#!/usr/bin/env bash
# Regenerates the dependency locks that scripts/setup.sh installs with (as pip constraints): setup.py's
# install_requires plus its `test` extra, resolved by `uv pip compile` from PyPI for CPython 3.11 on Linux x86_64
# (glibc >= 2.28), once per torch build:
#   requirements/cpu.txt   torch 2.13.0+cpu, a wheel PyPI does not serve: pip and uv find it through find-links
#                          ($FIND_LINKS, default $PIP_FIND_LINKS, else /opt/wheels); no nvidia-* packages
#   requirements/cuda.txt  PyPI's default torch 2.13.0 (a CUDA 13 build) with its nvidia-*/cuda-* libraries; it is
#                          also checked to resolve the same for CPython 3.12, the Python of the Docker image
# Usage: bash scripts/lock.sh                 keep every pin that still satisfies setup.py (after editing it)
#        bash scripts/lock.sh --upgrade       move every package to the newest release setup.py allows
#        bash scripts/lock.sh --upgrade-package NAME   move one (other `uv pip compile` options pass through too)
# uv: $UV, else the one on PATH, else uv==$UV_VERSION installed into .cache/uv-venv (git- and docker-ignored).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TORCH=2.13.0
UV_VERSION=0.13.9
FIND_LINKS=${FIND_LINKS:-${PIP_FIND_LINKS:-/opt/wheels}}

die() { echo "lock.sh: error: $*" >&2; exit 1; }
uv=${UV:-$(command -v uv || true)}
if [[ -z $uv ]]; then
  if [[ ! -x .cache/uv-venv/bin/uv ]]; then
    "${PYTHON:-python3}" -m venv .cache/uv-venv
    .cache/uv-venv/bin/python -m pip install -q "uv==$UV_VERSION"
  fi
  uv=.cache/uv-venv/bin/uv
fi
# A folder that lacks the CPU wheel would otherwise surface as uv's "no solution" for torch.
if [[ -d $FIND_LINKS ]] && ! compgen -G "$FIND_LINKS/torch-$TORCH+cpu-cp311-*.whl" >/dev/null; then
  die "no torch-$TORCH+cpu cp311 wheel in $FIND_LINKS: set FIND_LINKS to a folder (or page) that has it"
fi

# compile VARIANT TORCH_REQUIREMENT PYTHON OUT [uv options]: an existing OUT is read first as the preferred
# versions, so a re-run changes only what setup.py's edits (or --upgrade) force.
compile() {
  local variant=$1 torch=$2 python=$3 out=$4
  shift 4
  echo "$torch" | "$uv" pip compile --quiet setup.py - --extra test \
    --python-version "$python" --python-platform x86_64-manylinux_2_28 \
    --custom-compile-command "bash scripts/lock.sh" -o "$out" "$@"
  # One line under uv's header saying what the file is, and how setup.sh uses it.
  sed -i "2a # deepseek-ds $variant lock: CPython $python, Linux x86_64, $torch. Used as constraints by\\
# scripts/setup.sh: pip install -c requirements/$variant.txt -e \".[test]\"" "$out"
}

mkdir -p requirements
compile cpu "torch==$TORCH+cpu" 3.11 requirements/cpu.txt --find-links "$FIND_LINKS" "$@"
compile cuda "torch==$TORCH" 3.11 requirements/cuda.txt "$@"

# The CPU build must not drag CUDA libraries in; the CUDA lock must carry them.
! grep -Eq '^(nvidia|cuda|triton)' requirements/cpu.txt || die "requirements/cpu.txt pins CUDA packages"
grep -q '^nvidia-' requirements/cuda.txt || die "requirements/cuda.txt pins no nvidia-* package"
# The Docker image runs Ubuntu 24.04's CPython 3.12: the CUDA lock must hold there unchanged.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp requirements/cuda.txt "$tmp/cuda312.txt"
compile cuda "torch==$TORCH" 3.12 "$tmp/cuda312.txt"
diff <(grep -E '^[a-z0-9]' requirements/cuda.txt) <(grep -E '^[a-z0-9]' "$tmp/cuda312.txt") >&2 \
  || die "requirements/cuda.txt resolves differently for CPython 3.12 (the Docker image's): see the diff above"
for f in requirements/cpu.txt requirements/cuda.txt; do
  echo "$f: $(grep -cE '^[a-z0-9]' "$f") pinned packages"
done
