#!/usr/bin/env bash
# One command for a CUDA machine without network access: build the extension with all cores, run
# the `gpu` tests and the benchmarks, and write summary.md + summary.json (plus raw logs, JUnit
# XML and benchmark JSON) into RESULTS_DIR. Budget: under 8 minutes on one H200.
#
#   tools/gpu_check.sh [--dry-run] [--e2e] RESULTS_DIR
#
#   --dry-run   CPU only, for CI: no build (the installed package is used), gpu tests skip,
#               benchmarks in smoke mode (tiny sizes, reference ops). Keeps this script from rotting.
#   --e2e       also the end-to-end serving benchmarks (bench/test_bench_e2e.py: default model and
#               the 8B shape; offline, online, batch-1 roofline, reference backend, HF).
#
# Needs python with torch, pybind11, cmake, ninja, setuptools and nvcc. What the machine lacks
# comes from .carry/ (tools/pack_carry.sh makes it): CUTLASS headers as a tarball (unless
# PAGEDKERN_CUTLASS_INCLUDE is set) and pure-Python wheels (pytest, pytest-benchmark, ...).
set -uo pipefail

dry_run=0
e2e=0
out=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --e2e) e2e=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) out="$arg" ;;
  esac
done
[ -n "$out" ] || { echo "usage: tools/gpu_check.sh [--dry-run] [--e2e] RESULTS_DIR" >&2; exit 2; }

root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root" || exit 1
python=${PYTHON:-python3}
status=0
started=$(date +%s)
stage() { echo "== $1 ($(( $(date +%s) - started ))s)"; }

if [ "$dry_run" = 0 ]; then
  stage "offline installs"
  # Already-installed packages are left as they are; only missing ones come from .carry/wheels.
  if [ -d .carry/wheels ]; then
    "$python" -m pip install -q --no-index --find-links .carry/wheels pytest pytest-benchmark \
      hypothesis gguf tokenizers safetensors jinja2 tqdm fastapi uvicorn pydantic transformers \
      >"$out/pip.log" 2>&1 \
      || { echo "offline pip install failed (see pip.log)"; exit 1; }
  fi
  if [ -z "${PAGEDKERN_CUTLASS_INCLUDE:-}" ] && [ -f .carry/cutlass-include.tar.gz ]; then
    mkdir -p build/cutlass-include
    tar -xzf .carry/cutlass-include.tar.gz -C build/cutlass-include
    export PAGEDKERN_CUTLASS_INCLUDE="$root/build/cutlass-include"
  fi

  stage "build (MAX_JOBS=$(nproc))"
  t0=$(date +%s)
  if ! MAX_JOBS=$(nproc) PAGEDKERN_REQUIRE_CUDA=1 "$python" setup.py -q build_ext --inplace \
      >"$out/build.log" 2>&1; then
    tail -30 "$out/build.log"
    echo "build failed (see build.log)"
    exit 1
  fi
  echo "build_seconds=$(( $(date +%s) - t0 ))" >"$out/build.env"
  export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
  "$python" -c "import pagedkern; assert pagedkern.cuda_available(), pagedkern.cuda_unavailable_reason()" \
    || exit 1
  bench_flags=()
else
  export PAGEDKERN_BENCH_SMOKE=1
  bench_flags=(--benchmark-disable)
fi

stage "gpu tests"
"$python" -m pytest tests -m gpu -q -p no:cacheprovider --junitxml="$out/tests.xml" \
  >"$out/tests.log" 2>&1 || status=1
tail -3 "$out/tests.log"

[ "$e2e" = 1 ] || bench_flags+=(--ignore=bench/test_bench_e2e.py)

stage "benchmarks"
PAGEDKERN_BENCH_JSON="$out/bench.json" "$python" -m pytest bench -q -p no:cacheprovider \
  "${bench_flags[@]}" --benchmark-json="$out/benchmark.json" >"$out/bench.log" 2>&1 || status=1
tail -3 "$out/bench.log"

stage "summary"
"$python" tools/gpu_report.py "$out" || status=1
stage "done, status $status"
exit $status
