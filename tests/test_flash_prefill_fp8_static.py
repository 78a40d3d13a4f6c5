"""Static checks of flash_prefill's fp8-cache kernels (path 1, Sm80Traits<T, D, float_e4m3_t>) in
the built extension's machine code, both architectures (no GPU needed): every instantiation is
there, spill-free, copies the fp8 pages with 16-byte cp.async, keeps its mma.sync, and on sm_90a
converts E4M3 with the hardware unpack (sm_80 has none: cuda_fp8.h's software path there)."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.static

ARCHS = ("sm_80", "sm_90a")
FP8_KERNEL = ("flash_prefill_sm80_kernel", "float_e4m3")
# 2 dtypes (q) x 2 head dims x 2 schedules (v2, v1)
INSTANTIATIONS = 8
E4M3_UNPACK = r"F2FP\.F16\.E4M3\.UNPACK_B"  # e4m3x2 -> f16x2, sm_89+


def _fp8_listings(cuda_binary, arch: str) -> dict[str, str]:
    return {n: s for n, s in cuda_binary.sass(arch).items() if all(p in n for p in FP8_KERNEL)}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_fp8_instantiation_is_built_without_spills(cuda_binary, arch):
    resources = {
        n: r for n, r in cuda_binary.resources(arch).items() if all(p in n for p in FP8_KERNEL)
    }
    assert len(resources) == INSTANTIATIONS, sorted(resources)
    spilling = {n: r for n, r in resources.items() if r.local or r.stack}
    assert not spilling, f"fp8 kernels using local memory or stack on {arch}: {spilling}"


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_pages_by_16_byte_cp_async_and_mma_sync(cuda_binary, arch):
    listings = _fp8_listings(cuda_binary, arch)
    assert len(listings) == INSTANTIATIONS
    for name, sass in listings.items():
        assert re.search(r"LDGSTS\.E\.BYPASS(\.\w+)*\.128", sass), f"{name}: no 16-byte cp.async"
        assert "HMMA.16816" in sass, f"{name}: no mma.sync"


def test_fp8_conversion_is_the_hardware_unpack_on_hopper(cuda_binary):
    for name, sass in _fp8_listings(cuda_binary, "sm_90a").items():
        unpacks = len(re.findall(E4M3_UNPACK, sass))
        # K and V: one 16-byte chunk (8 e4m3 pairs) per iteration of each conversion loop.
        assert unpacks >= 2 * 8, f"{name}: {unpacks} E4M3 unpacks"


def test_fp8_conversion_is_software_on_ampere(cuda_binary):
    for name, sass in _fp8_listings(cuda_binary, "sm_80").items():
        assert not re.search(E4M3_UNPACK, sass), f"{name}: sm_80 has no E4M3 unpack"
