#!/usr/bin/env bash
# Fills .carry/ (git-ignored) with what the offline GPU machine lacks, for the device tool's
# `carry`: the CUTLASS/CuTe headers as a tarball, and wheels for its Python (default 3.12) of the
# pure-Python test tools and the model-loading packages. Run it here, where PyPI is reachable.
#
#   tools/pack_carry.sh [PYTHON_VERSION]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pyver=${1:-3.12}
cd "$root"
mkdir -p .carry/wheels

include=${PAGEDKERN_CUTLASS_INCLUDE:-$(python3 -c "
import importlib.util, pathlib
spec = importlib.util.find_spec('cutlass_library')
print(pathlib.Path(next(iter(spec.submodule_search_locations))) / 'source' / 'include')")}
tar -czf .carry/cutlass-include.tar.gz -C "$include" cute cutlass

python3 -m pip download -q --dest .carry/wheels --only-binary=:all: \
  --python-version "$pyver" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any \
  pytest pytest-benchmark hypothesis gguf tokenizers safetensors jinja2 tqdm pyyaml requests \
  fastapi uvicorn pydantic transformers
du -sh .carry/cutlass-include.tar.gz .carry/wheels
