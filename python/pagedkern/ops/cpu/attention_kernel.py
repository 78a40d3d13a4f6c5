"""The CPU backend's attention kernel (csrc/cpu/attention.{h,cpp}): query rows over the paged
cache in one C++ call, prefill chunks and decode rows alike, reading fp32 pages in place (bf16,
fp16 and fp8 E4M3 pages converted exactly, a block's keys at a time; no gathered copy), its
(block, KV head) tasks over torch's threads.

A row's result depends only on its own q, keys and position (one fixed order of fp32
operations, see attention.h), so batch invariance holds by construction whatever the BLAS: the
tiled bmm path (attention.py) keeps it only by padding every GEMM to rows and keys a BLAS rounds
alike. The kernel is not the reference's function bit for bit (it sums in another order, and
e^x by a polynomial): it is tested against it with a tolerance, and its paths (AVX-512, AVX2,
plain C++) against each other bit for bit.

Variant `cpu_attention`: `kernel` (the default where pagedkern._cpu is built) or `tiles`
(attention.py's BLAS tiles, which also run head sizes that are not a multiple of 8). Either runs
every row of a model (the choice depends on the head size, never on the batch), so a row
computes alike in every step.
"""

from __future__ import annotations

import torch

from .. import variants
from . import quant_gemv

# csrc/cpu/quant_gemv.h's Path values the kernel runs (avx512: its avx512_vnni CPUs)
PATHS = {"portable": 0, "avx2": 1, "avx512": 3}
# cache dtypes the kernel reads (converted to fp32 exactly), by csrc/cpu/attention.h's code
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}


def score_scale(head_size: int, scale: float | None, k_scale: float | None) -> float:
    """The scores' scale as the ops define it: `scale` (default head_size ** -0.5) times an
    fp8 cache's k_scale (default 1)."""
    return (head_size**-0.5 if scale is None else scale) * (1.0 if k_scale is None else k_scale)


def path_code(path: str | None) -> int:
    """-1 (the best) for None, else the code of a path in PATHS."""
    if path is None:
        return -1
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)} or None, got {path!r}")
    return PATHS[path]


def path_supported(path: str) -> bool:
    """Whether this CPU and build run `path` (one of PATHS)."""
    return quant_gemv.available() and quant_gemv.cpu_module().attention_path_supported(
        path_code(path)
    )


def applies(k_cache: torch.Tensor, head_size: int) -> bool:
    """Whether the kernel runs attention over this cache (the variant selected, the module
    built, a cache dtype it reads, a head size a multiple of 8): the same answer for every step
    of a model."""
    return (
        variants.selected("cpu_attention") == "kernel"
        and k_cache.dtype in CACHE_DTYPES
        and head_size % 8 == 0
        and quant_gemv.available()
    )


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    out_scale: float = 1.0,
    lse: torch.Tensor | None = None,
    path: str | None = None,
    want_call: bool = False,
):
    """Attention of q [T, Hq, D] (any float dtype) into out [T, Hq, D] (any float dtype): row t
    sees keys [lo, row_pos[t]] of sequence row_seq[t] (block_tables' row), lo 0 or the window's
    first; row_pos -1: no key (out 0, lse the sink or -inf). scale: of the scores (k_scale in
    it); out_scale: of the output (v_scale). lse: [T, Hq] fp32 or None. Returns out, or with
    want_call the module call's arguments when a call with the same layouts may repeat them
    with only the q, out and cache addresses changed (None where q or out was converted)."""
    t, hq, d = q.shape
    hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache must both be float32, bfloat16, float16 or float8_e4m3fn, got "
            f"{k_cache.dtype} and {v_cache.dtype}"
        )
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one "
            "shape and strides"
        )
    if k_cache.dim() != 4 or k_cache.shape[3] != d or k_cache.stride(3) != 1:
        raise ValueError(
            f"k_cache must be [blocks, Hkv, block_size, {d}] with the head size dense, got "
            f"{tuple(k_cache.shape)} strides {k_cache.stride()}"
        )
    if row_seq.shape != (t,) or row_pos.shape != (t,):
        raise ValueError(
            f"row_seq {tuple(row_seq.shape)} and row_pos {tuple(row_pos.shape)} must be [{t}]"
        )
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if lse is not None and (lse.shape != (t, hq) or lse.dtype != torch.float32):
        raise ValueError(f"lse must be float32 [{t}, {hq}], got {lse.dtype} {tuple(lse.shape)}")
    if sinks is not None and sinks.numel() != hq:
        raise ValueError(f"sinks must hold {hq} logits, got shape {tuple(sinks.shape)}")
    q32 = q if dense_fp32_heads(q) else q.float().contiguous()
    result = out if dense_fp32_heads(out) else torch.empty(t, hq, d)
    tables = as_int32(block_tables)
    seqs, positions = as_int32(row_seq), as_int32(row_pos)
    sink_logits = None if sinks is None else sinks.detach().float().contiguous()
    if lse is not None and not lse.is_contiguous():
        raise ValueError("lse must be contiguous")
    call = dict(
        q=q32.data_ptr(), q_row_stride=q32.stride(0), out=result.data_ptr(),
        out_row_stride=result.stride(0), lse=0 if lse is None else lse.data_ptr(),
        k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        cache_dtype=CACHE_DTYPES[k_cache.dtype], block_stride=k_cache.stride(0),
        head_stride=k_cache.stride(1), slot_stride=k_cache.stride(2),
        num_blocks=k_cache.shape[0], hq=hq, hkv=hkv, block_size=block_size, d=d,
        block_tables=tables.data_ptr(), table_stride=tables.stride(0),
        num_seqs=tables.shape[0], table_width=tables.shape[1], row_seq=seqs.data_ptr(),
        row_pos=positions.data_ptr(), rows=t, scale=float(scale),
        soft_cap=0.0 if soft_cap is None else float(soft_cap),
        window=0 if sliding_window is None else int(sliding_window),
        sinks=0 if sink_logits is None else sink_logits.data_ptr(), out_scale=float(out_scale),
        threads=torch.get_num_threads(), path=path_code(path),
    )  # fmt: skip
    quant_gemv.cpu_module().attention(**call)
    if result is not out:
        out.copy_(result)
    if want_call:
        pairs = zip(
            (q32, result, tables, seqs, positions), (q, out, block_tables, row_seq, row_pos)
        )
        kept = all(made is given for made, given in pairs)
        same_sinks = sinks is None or sink_logits.data_ptr() == sinks.data_ptr()
        return call if kept and same_sinks else None  # (no temporary's address kept)
    return out


def dense_fp32_heads(x: torch.Tensor) -> bool:
    """Whether x [T, H, D] is float32 with heads and D dense (rows of any stride): the rows
    csrc/cpu/ reads and writes in place."""
    return x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def as_int32(x: torch.Tensor) -> torch.Tensor:
    """x as int32 with a unit last stride (x itself where it already is)."""
    if x.dtype == torch.int32 and x.stride(-1) == 1:
        return x
    return x.to(torch.int32).contiguous()


def chunk_rows(cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, rows: int) -> tuple:
    """(row_seq, row_pos) int32 [rows] for query chunks: sequence b's rows cu_seqlens[b] ..
    cu_seqlens[b + 1] - 1 are the last positions before seq_lens[b] (a decode row: seq_lens[b]
    - 1); rows past cu_seqlens[-1] see no key (-1). csrc/cpu/attention.h's, as the one-call
    decoder makes them (ValueError unless cu_seqlens rises from 0 within the rows)."""
    cu, lens = as_int32(cu_seqlens), as_int32(seq_lens)
    if cu.dim() != 1 or cu.shape[0] < 1 or lens.shape[0] < cu.shape[0] - 1:
        raise ValueError(
            f"cu_seqlens {tuple(cu.shape)}, seq_lens {tuple(lens.shape)}: [B + 1], [B]"
        )
    seq, pos = torch.empty(rows, dtype=torch.int32), torch.empty(rows, dtype=torch.int32)
    quant_gemv.cpu_module().chunk_rows(
        cu_seqlens=cu.data_ptr(), seq_lens=lens.data_ptr(), num_chunks=cu.shape[0] - 1,
        rows=rows, row_seq=seq.data_ptr(), row_pos=pos.data_ptr(),
    )  # fmt: skip
    return seq, pos


class StepKernelAttention:
    """One step's attention for one kind of layer through the kernel: every row (prefill chunks
    and decode rows) in one call a layer. The rows' sequences and positions are made once, and
    again only when the metadata tensors changed since (a CUDA-graph bucket's static buffers,
    refilled in place each step, keep one plan): by their version counters, or by value for
    inference-mode tensors, which keep none."""

    def __init__(self, cu_seqlens, seq_lens, block_tables, rows: int, options: dict) -> None:
        self._sources = (cu_seqlens, seq_lens, block_tables)
        self._seen: tuple | None = None  # the sources' versions (or copies) the rows were made of
        self._made = 0  # rows made so far (a call layout is valid for one making)
        self._checked: tuple | None = None  # the layout attend() last checked, and its call
        self._call: dict | None = None
        self._rows = rows
        self.options = options
        v_scale = options.get("v_scale")
        self._out_scale = 1.0 if v_scale is None else v_scale

    def _refresh(self) -> None:
        sources = self._sources
        if any(t.is_inference() for t in sources):
            seen = self._seen
            if seen is not None and all(map(torch.equal, sources, seen)):
                return
            seen = tuple(t.clone() for t in sources)
        else:
            seen = tuple(t._version for t in sources)
            if seen == self._seen:
                return
        cu_seqlens, seq_lens, block_tables = sources
        self.row_seq, self.row_pos = chunk_rows(cu_seqlens, seq_lens, self._rows)
        self.tables = as_int32(block_tables)
        self._seen, self._made = seen, self._made + 1

    def run(self, q, k_cache, v_cache, out) -> None:
        self._refresh()
        layout = (_layout(q), _layout(out), _layout(k_cache), _layout(v_cache), self._made)
        if layout == self._checked:  # as the last layer's, which attend() checked: the call
            call = self._call
            call.update(
                q=q.data_ptr(), out=out.data_ptr(), k_cache=k_cache.data_ptr(),
                v_cache=v_cache.data_ptr(), threads=torch.get_num_threads(),
            )  # fmt: skip
            quant_gemv.cpu_module().attention(**call)
            return
        o = self.options
        scale = score_scale(q.shape[2], o["scale"], o["k_scale"])
        self._call = attend(
            q, k_cache, v_cache, self.tables, self.row_seq, self.row_pos, out, scale=scale,
            soft_cap=o["soft_cap"], sliding_window=o["sliding_window"], sinks=o["sinks"],
            out_scale=self._out_scale, want_call=True,
        )  # fmt: skip
        self._checked = layout if self._call is not None else None


def _layout(t: torch.Tensor) -> tuple:
    return t.dtype, t.shape, t.stride()
