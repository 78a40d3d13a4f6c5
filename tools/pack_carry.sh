#!/usr/bin/env bash
# Fills .carry/ (git-ignored) with what the GPU machine's image lacks and tools/gpu_check.sh needs
# there: the CUTLASS/CuTe headers as a tarball, and wheels for its Python (3.12, x86-64) of the
# packages below plus those of their dependencies the image does not hold
# (tools/gpu_image_packages.txt). Run it where PyPI is reachable; it prints the carry's size,
# which must stay well under the 64 MiB the working tree may take to the device.
#
#   tools/pack_carry.sh [PYTHON_VERSION]
#
# Versions: those installed here (the ones the tests pass with), else the newest.
# openai is left out: no test of the GPU check needs it (the HTTP tests skip without it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pyver=${1:-3.12}
wanted=(gguf fastapi starlette uvicorn pydantic pydantic-core)
cd "$root"
rm -rf .carry
mkdir -p .carry/wheels
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT

include=${PAGEDKERN_CUTLASS_INCLUDE:-$(python3 -c "
import importlib.util, pathlib
spec = importlib.util.find_spec('cutlass_library')
print(pathlib.Path(next(iter(spec.submodule_search_locations))) / 'source' / 'include')")}
tar -czf .carry/cutlass-include.tar.gz -C "$include" cute cutlass

pins=()
for name in "${wanted[@]}"; do
  version=$(python3 -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name")
  pins+=("$name${version:+==$version}")
done
echo "carrying ${pins[*]} and their dependencies missing from the image"
# With dependencies (pip resolves them for the target Python), then only the missing ones kept.
python3 -m pip download -q --disable-pip-version-check --dest "$download" --only-binary=:all: \
  --python-version "$pyver" --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${pins[@]}"
for wheel in "$download"/*.whl; do
  # project name as the wheel spells it (before the first '-'), normalised like the list
  project=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
  if grep -qx "$project" <(grep -v '^#' tools/gpu_image_packages.txt); then
    echo "  on the image already: $(basename "$wheel")"
  else
    cp "$wheel" .carry/wheels/
  fi
done
ls .carry/wheels
du -sh .carry/cutlass-include.tar.gz .carry/wheels
du -sh .carry  # the total: must stay far under 64 MiB with the working tree
