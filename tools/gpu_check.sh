#!/usr/bin/env bash
# The GPU check: build the extension for this GPU only, run the GPU tests (flash prefill first
# and alone), then, only if they passed, the benchmarks; every stage bounded in time; summary.md,
# summary.json and roofline.png at the end. The stages are listed in tools/gpu_stages.txt;
# docs/GPU_CHECK.md says what each one runs, how long it should take and what comes back.
#
#   tools/gpu_check.sh [options] RESULTS_DIR
#   tools/gpu_check.sh --print-plan [--e2e] [--stages LIST]
#
#   --dry-run       CPU only, for CI: no install or build (the package on PYTHONPATH or installed
#                   is used), GPU tests skip, benchmarks in smoke mode (tiny sizes, CPU).
#   --e2e           also the end-to-end serving benchmarks (bench/test_bench_e2e.py).
#   --compile       also the torch.compile baselines (cold inductor builds: minutes).
#   --stages LIST   only these stages of gpu_stages.txt (comma-separated names); benchmarks
#                   wait for the test stages that run, so --stages benchmarks reruns them alone.
#   --budget S      total seconds for the whole run (default 560 on a GPU, 1800 with --dry-run):
#                   each stage gets the smaller of its own budget and what is left.
#   --print-plan    print the stages that would run (name, kind, budget, per-test timeout,
#                   pytest arguments; tab-separated) and exit.
#
# RESULTS_DIR gets at most 8 files, each written as the run goes, so a killed run still leaves
# its logs: run.log (everything printed), stages.tsv (one line per finished stage), junit.xml
# (every pytest stage), bench.json (benchmark rows), summary.md, summary.json, roofline.png.
# Offline machines: what the image lacks comes from .carry/ (tools/pack_carry.sh makes it).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dry_run=0
e2e=0
compile=0
print_plan=0
only=""
budget=""
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --e2e) e2e=1 ;;
    --compile) compile=1 ;;
    --print-plan) print_plan=1 ;;
    --stages) only="$2"; shift ;;
    --budget) budget="$2"; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) out="$1" ;;
  esac
  shift
done

# The plan: gpu_stages.txt (or $PAGEDKERN_GPU_STAGES), less e2e without --e2e, less what
# --stages leaves out.
plan=()
while read -r name kind stage_budget per_test args; do
  case "$name" in ''|'#'*) continue ;; esac
  if [ -n "$only" ]; then
    case ",$only," in *",$name,"*) ;; *) continue ;; esac
  elif [ "$kind" = e2e ] && [ "$e2e" = 0 ]; then
    continue
  fi
  plan+=("$name"$'\t'"$kind"$'\t'"$stage_budget"$'\t'"$per_test"$'\t'"$args")
done <"${PAGEDKERN_GPU_STAGES:-$root/tools/gpu_stages.txt}"  # another plan: tests of this script
if [ "$print_plan" = 1 ]; then
  printf '%s\n' "${plan[@]}"
  exit 0
fi
[ -n "$out" ] || { echo "usage: tools/gpu_check.sh [options] RESULTS_DIR (--help)" >&2; exit 2; }

mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root" || exit 1
for f in run.log stages.tsv junit.xml bench.json summary.md summary.json roofline.png; do
  rm -f "$out/$f"
done
work=$(mktemp -d)  # per-stage JUnit files before merging: not in RESULTS_DIR (8-file limit)
trap 'rm -rf "$work"' EXIT
exec > >(tee -a "$out/run.log") 2>&1
tee_pid=$!
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
budget=${budget:-$([ "$dry_run" = 1 ] && echo 1800 || echo 560)}
started=$(date +%s)
deadline=$((started + budget))
reserve=40  # seconds kept for the summary (matplotlib's first import builds its font cache)
status=0
tests_failed=0

elapsed() { echo $(($(date +%s) - started)); }
stage() { echo; echo "== $1 (at $(elapsed) s of $budget)"; }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$out/stages.tsv"; }
# seconds a stage may take: its own budget, or what is left before the reserve
allowed() {
  local left=$((deadline - $(date +%s) - reserve))
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
# bounded NAME KIND BUDGET CMD...: runs CMD under timeout, records the outcome
bounded() {
  local name=$1 kind=$2 limit t0 rc note=""
  limit=$(allowed "$3")
  if [ "$limit" -lt "$3" ] && [ "$limit" -lt 20 ]; then  # too little of its budget is left
    echo "skipped: no time left (budget $budget s)"
    record "$name" "$kind" skipped 0 "no time left"
    return 99
  fi
  # A benchmark stage cut short is rerun whole (--stages NAME): started only with its bound left.
  if [ "$kind" != test ] && [ "$kind" != setup ] && [ "$limit" -lt "$3" ]; then
    echo "skipped: ${limit} s left, its bound is $3 s (rerun: --stages $name)"
    record "$name" "$kind" skipped 0 "less than its $3 s bound left"
    return 99
  fi
  shift 3
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@"
  rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && note="killed at its ${limit} s budget"
  record "$name" "$kind" "$rc" $(($(date +%s) - t0)) "$note"
  echo "-- $name: exit $rc after $(($(date +%s) - t0)) s ${note:+($note)}"
  return "$rc"
}

stage "machine"
echo "commit $(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
"$python" - <<'EOF'
import importlib.util, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
import os, sysconfig
include = sysconfig.get_paths()["include"]
print("Python.h", "found" if os.path.isfile(f"{include}/Python.h") else "MISSING", "in", include)
for name in ("pytest_timeout", "cupy", "matplotlib", "fastapi", "uvicorn", "pydantic", "gguf", "openai"):
    print(f"  {name}: {'yes' if importlib.util.find_spec(name) else 'no'}")
EOF
command -v nvcc >/dev/null && nvcc --version | tail -2

if [ "$dry_run" = 0 ]; then
  stage "install from .carry (offline)"
  site="$work/site"
  if [ -d .carry/wheels ] && ls .carry/wheels/*.whl >/dev/null 2>&1; then
    # Into a folder of our own, no dependency resolution: the image's packages stay as they are.
    bounded install setup 60 "$python" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --disable-pip-version-check --target "$site" .carry/wheels/*.whl \
      && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "no .carry/wheels: the HTTP-stack and gguf tests will skip"
  fi
  if [ -z "${PAGEDKERN_CUTLASS_INCLUDE:-}" ] && [ -f .carry/cutlass-include.tar.gz ]; then
    mkdir -p build/cutlass-include
    tar -xzf .carry/cutlass-include.tar.gz -C build/cutlass-include
    export PAGEDKERN_CUTLASS_INCLUDE="$root/build/cutlass-include"
  fi

  # This GPU's architecture only (sm_90a on Hopper); both are checked statically in CI.
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  archs=${PAGEDKERN_CUDA_ARCHS:-$([ "$cap" = 90 ] && echo 90a-real || echo "${cap:-90a}-real")}
  stage "build (PAGEDKERN_CUDA_ARCHS=$archs, MAX_JOBS=$(nproc))"
  if ! PAGEDKERN_CUDA_ARCHS="$archs" MAX_JOBS=$(nproc) PAGEDKERN_REQUIRE_CUDA=1 \
      bounded build setup 240 "$python" setup.py -q build_ext --inplace; then
    echo "build failed: no test can run"
    status=1
  fi
  export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
  if [ "$status" = 0 ] && ! "$python" -c "import pagedkern as p; assert p.cuda_available(), p.cuda_unavailable_reason()"; then
    record import setup 1 0 "pagedkern.cuda_available() is False"
    status=1
  fi
  bench_flags=()
else
  export PAGEDKERN_BENCH_SMOKE=1
  bench_flags=(--benchmark-disable)
fi
[ "$compile" = 1 ] && export PAGEDKERN_BENCH_COMPILE=1

timeout_flags=()
if "$python" -c "import pytest_timeout" 2>/dev/null; then
  timeout_flags=(--timeout-method=thread)  # a hung CUDA call never returns to Python's signals
fi

if [ "$status" = 0 ]; then
  for line in "${plan[@]}"; do
    IFS=$'\t' read -r name kind stage_budget per_test args <<<"$line"
    read -ra pytest_args <<<"$args"
    stage "$name: pytest $args"
    extra=()
    [ ${#timeout_flags[@]} -gt 0 ] && extra=("${timeout_flags[@]}" "--timeout=$per_test")
    if [ "$kind" = test ]; then
      bounded "$name" "$kind" "$stage_budget" "$python" -m pytest -q -p no:cacheprovider \
        -o junit_suite_name="$name" --junitxml="$work/$name.xml" "${extra[@]}" "${pytest_args[@]}" \
        || { tests_failed=1; status=1; }
    elif [ "$tests_failed" = 1 ]; then
      echo "skipped: a test stage failed (rerun with --stages $name to time it anyway)"
      record "$name" "$kind" skipped 0 "a test stage failed"
      continue
    else
      PAGEDKERN_BENCH_JSON="$out/bench.json" bounded "$name" "$kind" "$stage_budget" \
        "$python" -m pytest -q -p no:cacheprovider -o junit_suite_name="$name" \
        --junitxml="$work/$name.xml" "${extra[@]}" "${bench_flags[@]}" "${pytest_args[@]}" \
        || status=1
    fi
    [ -f "$work/$name.xml" ] && "$python" tools/gpu_report.py --merge-junit "$work/$name.xml" "$out/junit.xml"
  done
else
  for line in "${plan[@]}"; do record "${line%%$'\t'*}" - skipped 0 "set-up failed"; done
fi

stage "summary"
timeout -k 5 "$reserve" "$python" tools/gpu_report.py "$out" || status=1
stage "done, status $status"
exec >&- 2>&-
wait "$tee_pid"  # run.log complete before the caller reads it
exit $status
