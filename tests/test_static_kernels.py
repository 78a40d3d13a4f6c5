"""Static checks of the built extension's machine code (no GPU needed, run in CI): both target
architectures for every kernel, zero spills, and the 16-byte global accesses the kernels are
designed around."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.static

ARCHS = ("sm_80", "sm_90a")

# Kernel (substring of its mangled name) -> SASS opcodes its vectorized design needs.
VECTOR_ACCESS = {
    "rms_norm_vec_kernel": ("LDG.E.128", "STG.E.128"),
    "silu_and_mul_vec_kernel": ("LDG.E.128", "STG.E.128"),
    # q in with LDG.128, K/V pages by 16-byte cp.async (L1 bypass), out with STG.128.
    "paged_attention_kernel": ("LDG.E.128", "LDGSTS.E.BYPASS.128", "STG.E.128"),
    "paged_attention_merge_kernel": ("LDG.E.128",),  # float4 partials
    "rope_and_cache_kernelI13__nv_bfloat16Li8": ("LDG.E.128", "STG.E.128"),
    "rope_and_cache_kernelI6__halfLi8": ("LDG.E.128", "STG.E.128"),
    "rope_and_cache_kernelIfLi4": ("LDG.E.128", "STG.E.128"),
    "sample_kernelI13__nv_bfloat16Li8": ("LDG.E.128",),
    "sample_kernelIfLi4": ("LDG.E.128",),
    # logits processing stage: 16-byte logits in, 16-byte fp32 workspace out
    "process_kernelI13__nv_bfloat16Li8": ("LDG.E.128", "STG.E.128"),
    "process_kernelIfLi4": ("LDG.E.128", "STG.E.128"),
    # flash_prefill: K/V pages by 16-byte cp.async (path 1) or TMA (path 2), out with STG.128.
    "flash_prefill_sm80_kernel": ("LDGSTS.E.BYPASS", "STG.E.128"),
    "flash_prefill_sm90_kernel": ("UTMALDG.3D", "STG.E.128"),
}
# Every operator's kernels (substring of the mangled name) must be in the binary.
KERNELS = (
    "rms_norm_vec_kernel",
    "rms_norm_scalar_kernel",
    "silu_and_mul_vec_kernel",
    "silu_and_mul_scalar_kernel",
    "paged_attention_kernel",
    "paged_attention_merge_kernel",
    "rope_and_cache_kernel",
    "sample_kernel",
    "process_kernel",
    "flash_prefill_schedule_kernel",
    "flash_prefill_sm80_kernel",
    "flash_prefill_sm90_kernel",
)
# Kernel -> tensor-core instruction its design needs, per architecture: flash_prefill's path 1
# is mma.sync (HMMA) everywhere, path 2 wgmma (HGMMA) on sm_90a; path 2's sm_80 build is an
# empty stub (never launched there), present only so every cubin has the same kernels.
TENSOR_CORE_OPS = (
    ("flash_prefill_sm80_kernel", "sm_80", "HMMA.16816"),
    ("flash_prefill_sm80_kernel", "sm_90a", "HMMA.16816"),
    ("flash_prefill_sm90_kernel", "sm_90a", "HGMMA"),
)


def test_machine_code_for_ampere_and_hopper_plus_ptx(cuda_binary):
    assert set(ARCHS) <= cuda_binary.elf_archs
    assert "sm_80" in cuda_binary.ptx_archs  # compute_80 PTX: newer GPUs JIT from it


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiled_for_arch(cuda_binary, arch, kernel):
    assert any(kernel in name for name in cuda_binary.resources(arch)), f"{kernel} missing ({arch})"


def test_same_kernels_in_every_arch(cuda_binary):
    assert set(cuda_binary.resources("sm_80")) == set(cuda_binary.resources("sm_90a"))


@pytest.mark.parametrize("arch", ARCHS)
def test_no_spills(cuda_binary, arch):
    resources = cuda_binary.resources(arch)
    assert resources, f"no kernels found for {arch}"
    spilling = {name: r for name, r in resources.items() if r.local or r.stack}
    assert not spilling, f"kernels using local memory or stack (spills) on {arch}: {spilling}"


@pytest.mark.parametrize("kernel,opcodes", sorted(VECTOR_ACCESS.items()))
def test_sixteen_byte_accesses_on_hopper(cuda_binary, kernel, opcodes):
    listings = {n: s for n, s in cuda_binary.sass("sm_90a").items() if kernel in n}
    assert listings, f"{kernel} not found in the sm_90a code"
    for name, sass in listings.items():
        for opcode in opcodes:
            assert opcode in sass, f"{name} has no {opcode}"


@pytest.mark.parametrize("kernel,arch,opcode", TENSOR_CORE_OPS)
def test_tensor_core_instructions(cuda_binary, kernel, arch, opcode):
    listings = {n: s for n, s in cuda_binary.sass(arch).items() if kernel in n}
    assert listings, f"{kernel} not found in the {arch} code"
    for name, sass in listings.items():
        assert opcode in sass, f"{name} has no {opcode} ({arch})"
