"""Static checks of the built extension's machine code (no GPU needed, run in CI): both target
architectures for every kernel, zero spills, and the 16-byte global accesses the kernels are
designed around."""

from __future__ import annotations

import re

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
    # tensor-core variant: pages by 16-byte cp.async, K and V^T fragments by ldmatrix (16-byte
    # rows, plain and transposed), out with STG.128.
    "paged_attention_mma_kernel": (
        "LDGSTS.E.BYPASS.128",
        "LDSM.16.M88.4",
        "LDSM.16.MT88.4",
        "STG.E.128",
    ),
    "rope_and_cache_kernelI13__nv_bfloat16Li8": ("LDG.E.128", "STG.E.128"),
    "rope_and_cache_kernelI6__halfLi8": ("LDG.E.128", "STG.E.128"),
    "rope_and_cache_kernelIfLi4": ("LDG.E.128", "STG.E.128"),
    "sample_kernelI13__nv_bfloat16Li8": ("LDG.E.128",),
    "sample_kernelIfLi4": ("LDG.E.128",),
    "sample_fused_kernelI13__nv_bfloat16Li8": ("LDG.E.128",),
    "sample_fused_kernelIfLi4": ("LDG.E.128",),
    # logits processing stage: 16-byte logits in, 16-byte fp32 workspace out
    "process_kernelI13__nv_bfloat16Li8": ("LDG.E.128", "STG.E.128"),
    "process_kernelIfLi4": ("LDG.E.128", "STG.E.128"),
    # speculative verification: 16-byte probability rows in (the outputs are a few ints)
    "rejection_sample_kernelILi4": ("LDG.E.128",),
    # flash_prefill: K/V pages by 16-byte cp.async (path 1) or TMA (path 2), out with STG.128.
    "flash_prefill_sm80_kernel": ("LDGSTS.E.BYPASS", "STG.E.128"),
    "flash_prefill_sm90_kernel": ("UTMALDG.3D", "STG.E.128"),
    "flash_prefill_sm90_options_kernel": ("UTMALDG.3D", "STG.E.128"),
    "moe_gemm_sm90_kernel": ("UTMALDG.3D",),  # MoE experts on Hopper: weights by TMA
}
# Every operator's kernels (substring of the mangled name) must be in the binary.
KERNELS = (
    "rms_norm_vec_kernel",
    "rms_norm_scalar_kernel",
    "silu_and_mul_vec_kernel",
    "silu_and_mul_scalar_kernel",
    "paged_attention_kernel",
    "paged_attention_merge_kernel",
    "paged_attention_mma_kernel",
    "rope_and_cache_kernel",
    "rope_norm_and_cache_kernel",  # QK-norm fused
    "sample_kernel",
    "sample_fused_kernel",
    "process_kernel",
    "rejection_sample_kernel",
    "flash_prefill_schedule_kernel",
    "flash_prefill_sm80_kernel",
    "flash_prefill_sm80_options_kernel",  # window, soft-cap, sinks
    "flash_prefill_sm90_kernel",
    "flash_prefill_sm90_options_kernel",  # path 2's options (variant flash_prefill:sm90_options)
    "moe_route_kernel",
    "moe_align_kernel",
    "moe_gemm_kernel",
    "moe_reduce_gate_up_kernel",  # gate_up's split-K sum (float and quantized experts)
    "moe_combine_kernel",  # (float and quantized experts)
    "moe_gemm_quant_kernel",  # W4A16 / W8A16 experts
    "moe_gemm_sm90_kernel",  # the experts on wgmma + TMA (variant moe_gemm:sm90_wgmma)
    "quant_gemm_marlin_kernel",
)
# Kernel -> tensor-core instruction its design needs, per architecture: flash_prefill's path 1
# is mma.sync (HMMA) everywhere, path 2 wgmma (HGMMA) on sm_90a; path 2's sm_80 build is an
# empty stub (never launched there), present only so every cubin has the same kernels.
TENSOR_CORE_OPS = (
    ("flash_prefill_sm80_kernel", "sm_80", "HMMA.16816"),
    ("flash_prefill_sm80_kernel", "sm_90a", "HMMA.16816"),
    ("flash_prefill_sm90_kernel", "sm_90a", "HGMMA"),
    ("flash_prefill_sm90_options_kernel", "sm_90a", "HGMMA"),
    ("paged_attention_mma_kernel", "sm_80", "HMMA.16816"),
    ("paged_attention_mma_kernel", "sm_90a", "HMMA.16816"),
    # the MoE grouped GEMMs (gate_up + activation, down): every variant on mma.sync
    ("moe_gemm_kernel", "sm_80", "HMMA.16816"),
    ("moe_gemm_kernel", "sm_90a", "HMMA.16816"),
    ("moe_gemm_quant_kernel", "sm_80", "HMMA.16816"),
    ("moe_gemm_quant_kernel", "sm_90a", "HMMA.16816"),
    ("moe_gemm_sm90_kernel", "sm_90a", "HGMMA.64x128x16.F32"),  # (sm_80: an empty stub)
    # W4A16 over tile-ordered int4 weights (quant_gemm:marlin)
    ("quant_gemm_marlin_kernel", "sm_80", "HMMA.16816"),
    ("quant_gemm_marlin_kernel", "sm_90a", "HMMA.16816"),
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


# ---- speed guards: SASS patterns the kernels' schedules depend on -------------------
# Variants in the mangled names: flash_prefill_sm80_kernel<Traits, kPrefetchPages>,
# flash_prefill_sm90_kernel<Traits, kV2>, rms_norm_vec_kernel<T, kIters, kFused, kPrefetchWeight>,
# rope_and_cache_kernel<T, kVec, kHeads, kFp8>; "Lb1EEEv" = last template argument true.
FLASH_KERNELS = (
    ("flash_prefill_sm80_kernel", "sm_80"),
    ("flash_prefill_sm80_kernel", "sm_90a"),
    ("flash_prefill_sm90_kernel", "sm_90a"),
    ("flash_prefill_sm90_options_kernel", "sm_90a"),
)


def _listings(cuda_binary, arch: str, *parts: str) -> dict[str, str]:
    found = {n: s for n, s in cuda_binary.sass(arch).items() if all(p in n for p in parts)}
    assert found, f"no kernel named with {parts} in the {arch} code"
    return found


def _instructions(sass: str) -> list[str]:
    return [
        line.split(";")[0] for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)
    ]


@pytest.mark.parametrize("kernel,arch", FLASH_KERNELS)
def test_flash_softmax_exp_is_one_mufu(cuda_binary, kernel, arch):
    # exp2f without fast-math adds FSETP.GEU x, -126 and two predicated FMULs to every MUFU.EX2
    # (134 such checks in the sm_90a kernel before); ex2.approx.ftz is the MUFU alone.
    for name, sass in _listings(cuda_binary, arch, kernel).items():
        if arch == "sm_80" and "sm90" in kernel:
            continue
        assert "MUFU.EX2" in sass, name
        fixups = re.findall(r"FSETP\.GEU\.AND [^;]*, -126, ", sass)
        assert not fixups, f"{name}: {len(fixups)} exp2f denormal fix-ups"


@pytest.mark.parametrize("arch", ARCHS)
def test_flash_options_kernel_is_tensor_core_work_without_exp_fixups(cuda_binary, arch):
    # the soft-cap's tanh and the sinks' exps are ex2.approx (one MUFU.EX2 each), like the rest
    for name, sass in _listings(cuda_binary, arch, "flash_prefill_sm80_options_kernel").items():
        assert "HMMA.16816" in sass and "MUFU.EX2" in sass, name
        assert not re.findall(r"FSETP\.GEU\.AND [^;]*, -126, ", sass), name


@pytest.mark.parametrize("arch", ARCHS)
def test_flash_head_dim_256_runs_path_1_on_tensor_cores(cuda_binary, arch):
    # D = 256 (64-row work items): both schedules and the options kernel, both dtypes, 16-bit
    # caches only (no fp8 instance), on mma.sync with 16-byte cp.async pages; none spills
    # (test_no_spills covers every kernel).
    plain = _listings(cuda_binary, arch, "flash_prefill_sm80_kernel", "Li256E")
    options = _listings(cuda_binary, arch, "flash_prefill_sm80_options_kernel", "Li256E")
    assert len(plain) == 4 and len(options) == 2, sorted(plain) + sorted(options)
    for name, sass in {**plain, **options}.items():
        assert "float_e4m3" not in name, name
        assert "HMMA.16816" in sass and "STG.E.128" in sass, name
        # 16-byte cp.async around L1 (ptxas may add an L2 prefetch hint: .LTC128B)
        assert re.search(r"LDGSTS\.E\.BYPASS(\.LTC128B)?\.128", sass), name


def test_flash_sm90_options_kernel_overlaps_softmax_with_pv(cuda_binary):
    # The options' soft-cap and mask sit inside the arms of the mask branch with the softmax,
    # so the exps still run while P V is in flight (as v2's).
    for name, sass in _listings(cuda_binary, "sm_90a", "flash_prefill_sm90_options_kernel").items():
        inside, between = False, 0
        for ins in _instructions(sass):
            if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in ins:
                inside = True
            elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in ins:
                inside = False
            elif "MUFU.EX2" in ins and inside:
                between += 1
        assert between >= 66, f"{name}: only {between} MUFU.EX2 overlap the P V product"


def test_flash_sm90_v2_overlaps_softmax_with_pv(cuda_binary):
    # Main loop: S_i = Q K_i^T and P_{i-1} V_{i-1} in flight, wait for S_i (gsb0, 0x1), softmax,
    # wait for P V (0x0). A tile's exps (64 per thread, + 2 rescale factors) must sit between.
    for name, sass in _listings(
        cuda_binary, "sm_90a", "flash_prefill_sm90_kernel", "Lb1EEEv"
    ).items():
        inside, between = False, 0
        for ins in _instructions(sass):
            if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in ins:
                inside = True
            elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in ins:
                inside = False
            elif "MUFU.EX2" in ins and inside:
                between += 1
        assert between >= 66, f"{name}: only {between} MUFU.EX2 overlap the P V product"


def test_flash_sm90_v2_zeroes_v_tail_once_behind_a_barrier(cuda_binary):
    # Warpgroup 0 zeroes; warpgroup 1 waits through the turn barrier, or (one-tile items) both
    # sync on named barrier 5 (256 threads).
    for name, sass in _listings(
        cuda_binary, "sm_90a", "flash_prefill_sm90_kernel", "Lb1EEEv"
    ).items():
        assert len(re.findall(r"BAR\.SYNC(\.DEFER_BLOCKING)? 0x5, 0x100", sass)) >= 2, name


@pytest.mark.parametrize("arch", ARCHS)
def test_flash_sm80_v2_no_table_load_between_barrier_and_mma(cuda_binary, arch):
    # Block-table LDGs after a __syncthreads put an L2 round trip before the next HMMA; v2 takes
    # the page ids from the shared ring its cp.async groups filled a tile ahead.
    for name, sass in _listings(cuda_binary, arch, "flash_prefill_sm80_kernel", "Lb1EEEv").items():
        pending, exposed = None, 0
        for ins in _instructions(sass):
            if "BAR.SYNC" in ins:
                pending = 0
            elif "HMMA" in ins and pending is not None:
                exposed, pending = exposed + pending, None
            elif pending is not None and re.search(r"\bLDG\.E(\.\w+)*\s", ins):
                pending += 1
        assert exposed == 0, f"{name}: {exposed} global loads between a barrier and the MMAs"


@pytest.mark.parametrize("arch", ARCHS)
def test_rms_norm_v3_loads_weights_before_the_barrier(cuda_binary, arch):
    for iters in ("Li1E", "Li2E"):  # v3 prefetches where registers allow (1 or 2 vectors)
        for name, sass in _listings(
            cuda_binary, arch, "rms_norm_vec_kernel", iters, "Lb1EEEv"
        ).items():
            tail = sass.split("BAR.SYNC", 1)[1]
            assert "BAR.SYNC" not in tail, f"{name}: one barrier expected"
            assert not re.search(r"\bLDG\.E", tail), f"{name}: a load after the reduction barrier"


@pytest.mark.parametrize("arch", ARCHS)
def test_rope_v2_loads_cos_sin_once_per_four_heads(cuda_binary, arch):
    # cos/sin come through the read-only path (LDG...CONSTANT), q/k/v through plain LDG.128:
    # v2 rotates 4 heads (8 chunk loads) per cos/sin pair, v1 one head (2 loads).
    for name, sass in _listings(cuda_binary, arch, "rope_and_cache_kernel", "ELi4ELb").items():
        if "Li1ELi4E" in name:  # the scalar path
            continue
        table = len(re.findall(r"LDG\.E\.128\.CONSTANT", sass))
        data = len(re.findall(r"LDG\.E\.128(?!\.CONSTANT)", sass))
        assert table and data >= 2 * table, f"{name}: {data} data loads per {table} cos/sin loads"


def test_flash_sm90_v2_producer_has_no_table_load_after_its_waits(cuda_binary):
    # v1 looked a tile's page ids up after waiting for its empty buffer, a dependent L2 round
    # trip before each TMA; v2 loads them (and decodes the next work item) before the waits.
    for name, sass in _listings(
        cuda_binary, "sm_90a", "flash_prefill_sm90_kernel", "Lb1EEEv"
    ).items():
        since_wait, exposed = 0, 0
        for ins in _instructions(sass):
            if "SYNCS.PHASECHK" in ins:
                since_wait = 0
            elif "UTMALDG" in ins:
                exposed += since_wait
                since_wait = 0
            elif re.search(r"\bLDG\.E(\.\w+)*\s", ins):
                since_wait += 1
        assert exposed == 0, f"{name}: {exposed} global loads between a barrier wait and a TMA"


@pytest.mark.parametrize("arch", ARCHS)
def test_sample_v3_aggregates_histogram_updates_per_warp(cuda_binary, arch):
    # v3 groups the lanes that hit one bin (MATCH.ANY), sums their masses (REDUX.SUM) and lets
    # one lane per group do the shared atomics; v2 does 3 ATOMS per element (kept for A/B).
    for name, sass in _listings(cuda_binary, arch, "sample_fused_kernel").items():
        assert "MATCH.ANY" in sass, f"{name}: no __match_any_sync"
        assert "REDUX.SUM" in sass, f"{name}: no __reduce_add_sync"


def _loops(sass: str) -> list[list[str]]:
    """Instruction lists of the loops (a backward branch and everything from its target)."""
    ins = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for address, text in ins:
        target = re.search(r"BRA\s+(?:\S+,\s*)?0x([0-9a-f]+)", text)
        if target and int(target[1], 16) < address:
            loops.append([t for a, t in ins if int(target[1], 16) <= a <= address])
    return loops


_LOOP_OPS = ("HMMA", "LDSM", "MOVM", "STS", "FFMA", "F2FP", "PRMT")
FP8 = "13__nv_fp8_e4m3"  # the cache element of the fp8 (E4M3) instantiations (csrc/fp8.cuh)


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_attention_mma_loop_is_tensor_core_work(cuda_binary, arch):
    # Per tile each warp: D/16 HMMA for K Q^T and D/16 for V^T P^T, one ldmatrix each, P to the B
    # fragment by 2 movmatrix (no round trip through shared memory), no fp32 dot products.
    # fp8 pages: one ldmatrix per 2 HMMA; on sm_90a each register pair widened by one F2FP
    # (E4M3 -> f16x2: D/2 per tile) and V^T's bytes regrouped by D/16 PRMT.
    for name, sass in _listings(cuda_binary, arch, "paged_attention_mma_kernel").items():
        d, soft_cap = re.search(r"Li(\d+)ELb([01])EEEv", name).groups()
        d = int(d)
        if soft_cap == "1":  # the soft-cap's tanh adds FFMAs by design: checked for the rest
            continue
        loop = max((body for body in _loops(sass) if any("HMMA" in t for t in body)), key=len)
        count = {op: sum(1 for t in loop if re.search(rf"\b{op}\b", t)) for op in _LOOP_OPS}
        fp8 = FP8 in name
        assert count["HMMA"] == 2 * d // 16, f"{name}: {count}"
        assert count["LDSM"] == (d // 16 if fp8 else 2 * d // 16), f"{name}: {count}"
        assert count["MOVM"] == 2, f"{name}: {count}"
        assert count["STS"] == 0 and count["FFMA"] <= 4, f"{name}: {count}"
        if fp8 and arch == "sm_90a":
            assert count["F2FP"] >= d // 2 and count["PRMT"] >= d // 16, f"{name}: {count}"


# ---- fp8 (E4M3) KV cache -------------------------------------------------------------
# rope_and_cache_kernel<T, kVec, kHeads, true> writes E4M3, the attention kernels' <T, Fp8, ...>
# read it: 16-byte cp.async of the pages (16 elements each), the conversions in hardware on
# sm_90a (F2FP ... E4M3); sm_80 has no such instruction and cuda_fp8.h converts in software there.
FP8_KERNELS = (
    ("paged_attention_kernel", FP8, "E4M3"),
    ("paged_attention_mma_kernel", FP8, "E4M3"),
    ("rope_and_cache_kernel", "Lb1EEEv", "E4M3"),
)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel,marker,_", FP8_KERNELS)
def test_fp8_cache_paths_compiled(cuda_binary, arch, kernel, marker, _):
    found = _listings(cuda_binary, arch, kernel, marker)
    # SIMT: D 64 / 128 / 256 x kHeads 1 / 2 x two dtypes; mma: D 64 / 128 x two dtypes; rope:
    # vector and scalar paths x v1 / v2 x two dtypes
    assert len(found) >= {"paged_attention_kernel": 12, "paged_attention_mma_kernel": 4}.get(
        kernel, 8
    ), sorted(found)


@pytest.mark.parametrize("kernel", ["paged_attention_kernel", "paged_attention_mma_kernel"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_attention_loads_pages_with_sixteen_byte_copies(cuda_binary, arch, kernel):
    for name, sass in _listings(cuda_binary, arch, kernel, FP8).items():
        assert "LDGSTS.E.BYPASS.128" in sass, name
        assert not re.search(r"LDGSTS\.E(\.BYPASS)?(\.64|\.32)?\s", sass), f"{name}: narrow copies"


@pytest.mark.parametrize("kernel,marker,_", FP8_KERNELS)
def test_fp8_conversions_are_hardware_on_hopper_software_on_ampere(cuda_binary, kernel, marker, _):
    for name, sass in _listings(cuda_binary, "sm_90a", kernel, marker).items():
        if kernel.startswith("rope"):
            assert re.search(r"F2FP\.SATFINITE\.E4M3\.F32\.PACK_AB", sass), name
        else:
            assert re.search(r"F2FP\.F16\.E4M3\.UNPACK_B", sass), name
    for name, sass in _listings(cuda_binary, "sm_80", kernel, marker).items():
        assert "E4M3" not in sass, f"{name}: an E4M3 instruction in the sm_80 code"


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_gemm_vector_variants_stage_tiles_with_sixteen_byte_copies(cuda_binary, arch):
    # moe_gemm_kernel<T, kBM, kGated, kVec, Act>: "ELb1EN" = kVec true, then the activation's
    # nested name; 2 dtypes x 2 row tiles x (silu, gelu_tanh, clamped SwiGLU gate_up; down);
    # tiles by 16-byte cp.async
    vec = _listings(cuda_binary, arch, "moe_gemm_kernel", "ELb1EN")
    assert len(vec) == 16, sorted(vec)
    for name, sass in vec.items():
        assert "LDGSTS.E.BYPASS.128" in sass, f"{name}: tiles not staged by 16-byte cp.async"


@pytest.mark.parametrize("arch", ARCHS)
def test_quant_gemm_marlin_loop_has_no_division_routine(cuda_binary, arch):
    # The v1 kernel's 64-bit division per 16-byte chunk is a call into a division subroutine,
    # which ends in RET (sm_80 also spells a loop exit CALL.REL.NOINC, with no subroutine).
    listings = _listings(cuda_binary, arch, "quant_gemm_marlin")
    assert len(listings) == 16, sorted(listings)  # 2 dtypes x 4 m16 tile counts x 2 group sizes
    for name, sass in listings.items():
        assert not re.search(r"\bRET\b", sass), f"{name}: calls a subroutine (a division?)"


def test_moe_gemm_sm90_gathers_gate_up_rows_and_keeps_one_wgmma_batch_in_flight(cuda_binary):
    # moe_gemm_sm90_kernel<Traits<T, consumers>, kGated>: "Lb1EEEv" = gate_up. Both GEMMs
    # release a stage when the batch before the one just issued completes (a wait for all but
    # one); gate_up gathers hidden's rows by 16-byte cp.async arriving on the stage's mbarrier,
    # down loads h's rows by TMA (no cp.async).
    listings = _listings(cuda_binary, "sm_90a", "moe_gemm_sm90_kernel")
    assert len(listings) == 8, sorted(listings)  # 2 dtypes x 1 or 2 consumers x 2 GEMMs
    for name, sass in listings.items():
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass, f"{name}: no wgmma batch left in flight"
        gathers = "LDGSTS.E.BYPASS.128" in sass and "LDGSTSBAR.64.ARVCNT" in sass
        assert gathers == ("Lb1EEEv" in name), f"{name}: gather by cp.async {gathers}"
