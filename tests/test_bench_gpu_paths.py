"""The benchmark suites' GPU-only branches, run on the CPU (tools/rehearsal/gpu_paths.py): the GPU
check's benchmark stage, as tools/gpu_stages.txt names it, with smoke sizes, a pretended Hopper
and the built extension stubbed with its real pybind signatures. The first GPU run lost every
flash_prefill benchmark to a positional call of the keyword-only flash_prefill_workspace_ints,
in a branch smoke mode never took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from build_env import cuda_build_required

from pagedkern._extension import extension_module

ROOT = Path(__file__).resolve().parents[1]
REHEARSAL = ROOT / "tools" / "rehearsal"


def _extension():
    module = extension_module()
    if module is None:
        if cuda_build_required():
            pytest.fail("the CUDA extension is required here but does not import")
        pytest.skip("the stub takes its signatures from the built extension")
    return module


def bench_stage_files() -> list[str]:
    files = []
    for line in (ROOT / "tools" / "gpu_stages.txt").read_text().splitlines():
        fields = line.split()
        if fields and not line.startswith("#") and fields[1] == "bench":
            files += [a for a in fields[4:] if a.endswith(".py")]
    return files


def run_rehearsal(tmp_path, files: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKERN_BENCH_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REHEARSAL), str(ROOT / "python"), str(ROOT / "bench")]),
        PAGEDKERN_BENCH_SMOKE="1",
        PAGEDKERN_BENCH_GPU_PATHS="1",
        PAGEDKERN_BENCH_JSON=str(tmp_path / "bench.json"),
        PAGEDKERN_GPU_PATHS_LOG=str(tmp_path / "calls.json"),
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "--benchmark-disable", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*cmd, "-p", "gpu_paths", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # every benchmark suite of the stage in a pytest process; the stub: the rest
def test_the_benchmark_stage_runs_its_gpu_branches_on_the_cpu(tmp_path):
    _extension()
    files = bench_stage_files()
    assert "bench/test_bench_flash_prefill.py" in files
    proc = run_rehearsal(tmp_path, files)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    calls = [c["name"] for c in json.loads((tmp_path / "calls.json").read_text())]
    # The branches ran: flash prefill sized its workspace through the extension for each
    # pagedkern row and asked which path an fp8 cache takes ...
    assert calls.count("flash_prefill_workspace_ints") >= 3, calls
    assert "flash_prefill_path" in calls
    rows = json.loads((tmp_path / "bench.json").read_text())["results"]
    # ... paged attention planned its splits for the pretended SM count, v4 sampling its slices.
    planned = [r for r in rows if r["op"] == "paged_attention" and r["impl"] == "pagedkern"]
    assert planned and all("kernel" in r["extra"] and "splits" in r["extra"] for r in planned)
    assert any("slices" in r["extra"] for r in rows if r["op"] == "sample small batch")
    # ... and the GPU-only suites ran: MoE split-K (its splits) and the moe_gemm variants, the
    # Marlin int4 GEMM rows.
    split_k = [r for r in rows if r["op"] == "fused_moe split-K"]
    assert split_k and all("splits" in r["extra"] for r in split_k)
    variants = {r["impl"] for r in rows if r["op"] == "fused_moe moe_gemm variants"}
    assert {"pagedkern split_k", "pagedkern no_split_k", "pagedkern sm90_wgmma"} <= variants
    assert any(r["impl"].endswith("marlin") for r in rows if r["op"] == "quant_gemm")


def test_the_rehearsal_fails_a_call_that_breaks_the_signature(tmp_path):
    # The first GPU run's call, in a suite of its own: the rehearsal must refuse it.
    _extension()
    suite = tmp_path / "test_bench_positional.py"
    suite.write_text(
        "from measure import gpu_paths\n"
        "from pagedkern._extension import require\n\n"
        "def test_positional():\n"
        "    assert gpu_paths()\n"
        "    require().flash_prefill_workspace_ints(16384, 1)\n"
    )
    proc = run_rehearsal(tmp_path, [str(suite)])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    assert "flash_prefill_workspace_ints(): incompatible function arguments" in output


def test_the_stub_has_the_real_signatures_and_refuses_launches(monkeypatch):
    real = _extension()
    monkeypatch.setenv("PAGEDKERN_BENCH_SMOKE", "1")
    monkeypatch.setenv("PAGEDKERN_BENCH_GPU_PATHS", "1")
    import pagedkern._extension as extension

    monkeypatch.setattr(extension, "require", extension.require)  # the import replaces it
    sys.modules.pop("gpu_paths", None)
    monkeypatch.syspath_prepend(str(REHEARSAL))
    import torch

    for name in ("get_device_capability", "get_device_properties", "current_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    import gpu_paths

    try:
        stub = gpu_paths.ExtensionStub(real)  # every entry point of the real module classified
        assert stub.flash_prefill_workspace_ints(total_q=4096, batch=4) == (
            real.flash_prefill_workspace_ints(total_q=4096, batch=4)
        )
        with pytest.raises(TypeError, match="incompatible function arguments"):
            stub.flash_prefill_workspace_ints(4096, 4)
        with pytest.raises(TypeError, match="incompatible function arguments"):
            stub.flash_prefill_workspace_ints(total_q=4096, batches=4)
        assert stub.multiprocessor_count(device=0) == gpu_paths.SMS
        with pytest.raises(TypeError):
            stub.multiprocessor_count(0)
        with pytest.raises(gpu_paths.RehearsalError, match="kernel launch"):
            stub.rms_norm(**{p: 0 for p in gpu_paths.pybind_signature(real.rms_norm).parameters})
        assert stub.DTYPE_CODES == real.DTYPE_CODES
    finally:
        sys.modules.pop("gpu_paths", None)
