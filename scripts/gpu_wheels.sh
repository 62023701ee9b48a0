#!/usr/bin/env bash
# Run here, with network, before a session on a lent GPU machine: that machine has no network and its python3
# (3.12, x86_64) has torch and transformers but not DeepSpeed, pydantic or hjson. Collects into .whl/ (git-ignored)
# the wheels it lacks, at the versions this .venv runs (transformers too: the code uses its internals), and
# .whl/COMMIT, the commit the report names (the tree copied there has no .git). Carry ".whl" there and install
# with `pip install --no-index --no-deps --target` (README, "GPU check"); the carry limit is 64 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
out=.whl
version() { "$py" -c "from importlib.metadata import version; print(version('$1'))"; }
rm -rf "$out"
mkdir -p "$out"

# DeepSpeed is an sdist on PyPI. Built with DS_BUILD_OPS=0 its wheel is pure Python (ops JIT-build where used),
# and its setup needs torch importable, hence this .venv without build isolation; pip's cache may hold it already.
ds=$(version deepspeed)
cached=$(find "$("$py" -m pip cache dir)/wheels" -name "deepspeed-$ds-py3-none-any.whl" 2>/dev/null | head -1)
if [[ -n $cached ]]; then
  cp "$cached" "$out/"
else
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "deepspeed==$ds"
fi

# DeepSpeed's and pydantic's dependencies the machine lacks (einops, msgpack: imported by DeepSpeed's engine;
# py-cpuinfo: its op builders), and transformers.
pins=()
for p in pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson einops msgpack py-cpuinfo \
         transformers; do
  pins+=("$p==$(version "$p")")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$out" "${pins[@]}"

commit=$(git rev-parse HEAD)
[[ -z $(git status --porcelain) ]] || commit+=" + uncommitted changes"
echo "$commit" > "$out/COMMIT"
ls -l "$out"
bytes=$(du -cb "$out" | tail -1 | cut -f1)
echo "$out: $(( bytes / 1024 / 1024 )) MiB ($bytes bytes) of the 64 MiB carry limit"
(( bytes < 48 * 1024 * 1024 )) || { echo "gpu_wheels.sh: $out is too large to carry with the tree" >&2; exit 1; }
