"""The CPU backend's attention over the paged cache: flash-style, tiles of keys merged by an
online softmax, so no call holds more than one tile's scores (queries of a block x KEY_TILE keys)
instead of the reference's whole score matrix (a 2048-token prefill: 2048 x 2048 x heads fp32
a layer, ~70% of its time in bmm + softmax + masked_fill).

Design. A group of sequences is gathered once (keys [S * Hkv, D, W], values [S * Hkv, W, D],
float32, W their longest length in whole tiles) and its query rows cut into blocks of
QUERY_BLOCK positions (x the GQA group: one GEMM row per query head of a KV head). A block walks
the key tiles [j * T, (j + 1) * T) that its last query reaches, every tile whole; per tile:
scores by bmm, scale, soft-cap, mask, then a row softmax and its bmm with the values, merged
into the running output:

    m' = max(m, m_j)   L' = L * e^(m - m') + r_j   with r_j = e^(m_j - m') / max(p_j)
    o' = o * (L * e^(m - m') / L') + o_j * (r_j / L')

where m_j is the tile's row max, p_j its softmax (max(p_j) = 1 / its sum of exponentials) and o_j
= p_j V_j the tile's own attention. The output stays normalised, so a row whose keys fit in one
tile gets o_j itself (r / r = 1): the reference's function there. A tile a row sees nothing of
(causal, past its length) leaves it exactly as it was (r = 0, e^0 = 1, L / L = 1), so a row's
result never depends on how many tiles its block walked. With the fixed tile boundaries, whole
tiles (each GEMM reduces over the same keys whatever the chunk) and the GEMMs' minimum of
MIN_GEMM_ROWS rows (the reference's rule), a query row's bits do not depend on its chunk, its
block, its neighbours, or whether it is a decode row (paged_attention is flash_prefill over
one-token chunks). Sinks start the merge as a key of their own: m = sink, L = 1, o = 0.

The sliding window runs the reference (explicitly, per call): a window's first key block moves
with each query, which the fixed tiles do not follow yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ... import reference
from ...reference.key_blocks import MIN_GEMM_ROWS
from . import attention_kernel

# Keys a tile (rounded to whole blocks). Every tile is whole: keys are padded (hidden, values
# zero) to a whole number of tiles, so each GEMM reduces over exactly one tile's keys. A BLAS
# splits a long reduction into blocks of its own choosing (MKL: over 384 keys on a Sapphire
# Rapids Xeon, over 192 on an AMD EPYC), so a row's p . V over 256 keys, some masked (weight 0),
# can round apart from the same row over fewer keys; over the same keys it cannot.
KEY_TILE = 256
QUERY_BLOCK = 256  # query positions a block (each times the GQA group as GEMM rows)
_GROUP_BUDGET = 1 << 25  # elements of a group's gathered keys and values together

Hide = Callable[[torch.Tensor, int, int], None]  # masks scores of keys [c0, c1) in place


def key_tile(block_size: int) -> int:
    """KEY_TILE rounded to whole blocks (tiles never end inside a block)."""
    return block_size * max(1, KEY_TILE // block_size)


def whole_tiles(keys: int, tile: int) -> int:
    """`keys` rounded up to whole tiles (at least one)."""
    return max(1, -(-keys // tile)) * tile


def table_columns(block_tables: torch.Tensor, n: int) -> torch.Tensor:
    """The first n columns of block tables [S, >= 0] as int64, padded with block 0 where the
    tables are narrower (whole tiles can reach past a table's last block: the padding's keys
    are hidden and its values zeroed)."""
    tables = block_tables[:, :n].long()
    if tables.shape[1] < n:
        tables = torch.nn.functional.pad(tables, (0, n - tables.shape[1]))
    return tables


def tiled_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None,
    hide: Hide | None,
    reach: int,
    tile: int,
    soft_cap: float | None = None,
    sink: torch.Tensor | None = None,
    need_lse: bool = False,
    open_until: int = 0,
    alive_until: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q [B, M, D] fp32 over keys [B, D, W] and values [B, W, D] fp32 (any
    strides), in tiles of `tile` keys up to `reach`, a whole number of tiles (later keys
    hidden from every row).
    scale None: q already carries it. hide(scores, c0, c1): sets the hidden scores of keys
    c0..c1-1 to -inf in place (scores [B, M, c1 - c0]), called only for tiles that end past
    `open_until` (keys below it are visible to every row). alive_until: every row sees a key
    below it (None: below reach), so tiles starting there or before hide no row entirely.
    sink: [B, M] fp32 logits or None.
    Returns (out [B, M, D] fp32, lse [B, M] or None); rows that see no key: out 0, lse -inf
    (with a sink: out 0, lse the sink)."""
    b, m_rows, d = q.shape
    if reach % tile:
        raise ValueError(f"reach ({reach}) must be a whole number of tiles of {tile} keys")
    if reach <= tile and sink is None and not need_lse and alive_until != 0:
        # one tile that every row sees a key of: the merge below would return its own
        # attention unchanged (the decode step's common case: ~9 small ops a layer saved)
        scores = torch.bmm(q, keys[:, :, :reach])
        if scale is not None:
            scores.mul_(scale)
        if soft_cap is not None:
            scores.div_(soft_cap).tanh_().mul_(soft_cap)
        if hide is not None and reach > open_until:
            hide(scores, 0, reach)
        return torch.bmm(torch.softmax(scores, dim=-1), values[:, :reach]), None
    out = torch.zeros(b, m_rows, d)
    if sink is None:
        m = torch.full((b, m_rows), float("-inf"))
        total = torch.zeros(b, m_rows)
    else:
        m, total = sink.clone(), torch.ones(b, m_rows)
    # Every row has seen a key after the first tile (key 0 visible to all, or a sink): m stays
    # finite and L positive, so the guards below would pass every value through unchanged.
    live = open_until >= 1 or sink is not None
    for c0 in range(0, reach, tile):
        c1 = c0 + tile
        scores = torch.bmm(q, keys[:, :, c0:c1])
        if scale is not None:
            scores.mul_(scale)
        if soft_cap is not None:  # HF's order: divide, tanh, multiply
            scores.div_(soft_cap).tanh_().mul_(soft_cap)
        if hide is not None and c1 > open_until:
            hide(scores, c0, c1)
        tile_max = scores.amax(-1)
        dead = None  # rows this tile shows nothing (none where every row sees key c0)
        if (alive_until is None or c0 >= alive_until) and c0 >= open_until:
            dead = torch.isneginf(tile_max)
            scores.masked_fill_(dead[..., None], 0.0)  # (finite scores: a no-op)
        p = torch.softmax(scores, dim=-1)
        o_tile = torch.bmm(p, values[:, c0:c1])
        if c0 == 0 and sink is None:  # the first tile: the merge below reduces to this
            m = tile_max
            if dead is None:
                out, total = o_tile, p.amax(-1).reciprocal_()
            else:
                out = torch.where(dead[..., None], out, o_tile)
                total = torch.where(dead, 0.0, p.amax(-1).reciprocal_())
            continue
        m_new = torch.maximum(m, tile_max)
        m_safe = m_new if live else torch.where(torch.isneginf(m_new), 0.0, m_new)
        kept = total * torch.exp(m - m_safe)
        r = torch.exp(tile_max - m_safe) / p.amax(-1)  # (a dead row: e^-inf = 0)
        if dead is not None and not live:
            r = torch.where(dead, 0.0, r)
        total_new = kept + r
        if live:
            old, new = kept / total_new, r / total_new
        else:
            seen = total_new > 0
            old = torch.where(seen, kept / total_new, 1.0)
            new = torch.where(seen, r / total_new, 0.0)
        out = out * old[..., None] + o_tile * new[..., None]
        m, total = m_new, total_new
    lse = (m + torch.log(total)) if need_lse else None
    return out, lse


def flash_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """reference.flash_prefill's function (same arguments and results), flash-style."""
    if attention_kernel.applies(k_cache, q.shape[2]):
        _check_chunks(cu_seqlens_q, seq_lens)
        rows = attention_kernel.chunk_rows(cu_seqlens_q, seq_lens, q.shape[0])
        return _kernel(
            q, k_cache, v_cache, block_tables, rows, scale, out, return_lse, k_scale, v_scale,
            sliding_window, soft_cap, sinks,
        )  # fmt: skip
    if sliding_window is not None:  # explicitly: the reference runs windowed calls
        return reference.flash_prefill(
            q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale, out, return_lse,
            k_scale=k_scale, v_scale=v_scale, soft_cap=soft_cap, sinks=sinks,
            sliding_window=sliding_window,
        )  # fmt: skip
    bounds, lengths = _check_chunks(cu_seqlens_q, seq_lens)
    chunks = [bounds[i + 1] - bounds[i] for i in range(len(lengths))]
    return _attention(
        q, k_cache, v_cache, bounds[:-1], chunks, lengths, block_tables, scale, out,
        return_lse, k_scale, v_scale, soft_cap, sinks,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    k_scale: float | None = None,
    v_scale: float | None = None,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """reference.paged_attention's function: flash_prefill over one-token chunks (so a decode
    row and the same row of a prefill chunk are computed alike, bit for bit)."""
    if attention_kernel.applies(k_cache, q.shape[2]):
        rows = (torch.arange(seq_lens.numel(), dtype=torch.int32), (seq_lens - 1).int())
        return _kernel(
            q, k_cache, v_cache, block_tables, rows, scale, out, return_lse, k_scale, v_scale,
            sliding_window, soft_cap, sinks,
        )  # fmt: skip
    if sliding_window is not None:  # explicitly: the reference runs windowed calls
        return reference.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out, return_lse, k_scale,
            v_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        )  # fmt: skip
    lengths = seq_lens.tolist()
    chunks = [1 if n > 0 else 0 for n in lengths]
    return _attention(
        q, k_cache, v_cache, list(range(len(lengths))), chunks, lengths, block_tables, scale,
        out, return_lse, k_scale, v_scale, soft_cap, sinks,
    )  # fmt: skip


def _check_chunks(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> tuple[list, list]:
    bounds, lengths = cu_seqlens_q.tolist(), seq_lens.tolist()
    for i, length in enumerate(lengths):
        if length < bounds[i + 1] - bounds[i]:
            n = bounds[i + 1] - bounds[i]
            raise ValueError(f"seq_lens[{i}]={length} is shorter than its query chunk ({n})")
    return bounds, lengths


def _kernel(
    q, k_cache, v_cache, block_tables, rows, scale, out, return_lse, k_scale, v_scale,
    sliding_window, soft_cap, sinks,
):  # fmt: skip
    """Both ops through attention_kernel: rows = (row_seq, row_pos)."""
    total, hq, d = q.shape
    scale = attention_kernel.score_scale(d, scale, k_scale)
    lse = torch.empty(total, hq) if return_lse else None
    if out is None:
        out = torch.empty_like(q)
    attention_kernel.attend(
        q, k_cache, v_cache, block_tables, *rows, out, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, sinks=sinks,
        out_scale=1.0 if v_scale is None else v_scale, lse=lse,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _attention(
    q, k_cache, v_cache, starts, chunks, lengths, block_tables, scale, out, return_lse,
    k_scale, v_scale, soft_cap, sinks,
):  # fmt: skip
    """Both ops: the chunks' rows (sequence i: q rows starts[i] .. + chunks[i], the last chunk
    positions before lengths[i]) in groups, written into out / lse."""
    total, hq, d = q.shape
    scale = attention_kernel.score_scale(d, scale, k_scale)
    result = torch.zeros(total, hq, d)
    lse = torch.full((total, hq), float("-inf")) if return_lse else None
    hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    for group in _groups(chunks, lengths, block_size, hkv * d):
        rows, o, s = _group_attention(
            q, k_cache, v_cache, block_tables[group], [starts[i] for i in group],
            [chunks[i] for i in group], [lengths[i] for i in group], scale, soft_cap, sinks,
            return_lse,
        )  # fmt: skip
        result[rows] = o
        if lse is not None:
            lse[rows] = s
    if v_scale is not None and v_scale != 1.0:
        result.mul_(v_scale)
    if out is None:
        out = result.to(q.dtype)
    else:
        out.copy_(result)
    return (out, lse) if return_lse else out


def _groups(chunks: list[int], lengths: list[int], block_size: int, per_key: int) -> list[list]:
    """Sequences with a query chunk, by chunk length, in groups gathered together: padded query
    rows at most twice the real ones, gathered keys and values within _GROUP_BUDGET."""
    groups: list[list[int]] = []
    group: list[int] = []
    rows = width = 0
    tile = key_tile(block_size)
    for i in sorted((i for i, n in enumerate(chunks) if n > 0), key=chunks.__getitem__):
        own = whole_tiles(lengths[i], tile)  # its keys in whole tiles
        w = max(width, own)
        padded = (len(group) + 1) * chunks[i]  # by chunk length: i's is the longest
        if group and (
            padded > 2 * (rows + chunks[i]) or (len(group) + 1) * w * per_key * 2 > _GROUP_BUDGET
        ):
            groups.append(group)
            group, rows, w = [], 0, own
        group.append(i)
        rows += chunks[i]
        width = w
    return groups + [group] if group else groups


def _gather(cache: torch.Tensor, pages: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Pages [S, n] of a cache [blocks, Hkv, bs, D] as a fresh float32 [S, Hkv, ...] tensor,
    the rest in `dims` order (1: page, 3: slot, 4: D), as the reference gathers them."""
    group, n = pages.shape
    pages_of = cache.index_select(0, pages.reshape(-1)).view(group, n, *cache.shape[1:])
    dense = pages_of.permute(0, 2, *dims)
    return torch.empty(dense.shape).copy_(dense)


def _group_attention(
    q, k_cache, v_cache, tables, starts, chunks, lengths, scale, soft_cap, sinks, need_lse
):
    """One group of S sequences: chunks padded to the longest (T steps, at least
    MIN_GEMM_ROWS GEMM rows), keys to the longest length in whole tiles, W. -> (q rows, out,
    lse) of the real rows back to back."""
    hq, d = q.shape[1:]
    hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    s_count = len(chunks)
    min_steps = -(-MIN_GEMM_ROWS // g)
    t_max = max(max(chunks), min_steps)
    n, lens, first = (torch.tensor(x) for x in (chunks, lengths, starts))
    step = torch.arange(t_max)
    real = step[None, :] < n[:, None]  # [S, T]
    rows = torch.where(real, first[:, None] + step[None, :], first[:, None])
    positions = (lens - n)[:, None] + step[None, :]  # [S, T]
    tile = key_tile(block_size)
    width = whole_tiles(max(lengths), tile)
    nblk = width // block_size
    cols = torch.arange(nblk)
    in_seq = cols[None, :] < (-(-lens // block_size))[:, None]
    pages = torch.where(in_seq, table_columns(tables, nblk), 0)
    slots = torch.arange(width)
    past = slots[None, :] >= lens[:, None]  # [S, W]: keys past a length (never read)
    keys = _gather(k_cache, pages, (4, 1, 3)).view(s_count * hkv, d, width)
    values = _gather(v_cache, pages, (1, 3, 4)).view(s_count, hkv, width, d)
    values.masked_fill_(past[:, None, :, None], 0.0)  # (unwritten slots may hold NaN)
    values = values.view(s_count * hkv, width, d)
    qg = q.index_select(0, rows.view(-1)).float().view(s_count, t_max, hkv, g, d)
    qg = qg.permute(0, 2, 1, 3, 4)  # [S, Hkv, T, G, D]
    if soft_cap is None and math.frexp(scale)[0] == 0.5:
        # a power of two (D = 64, 256: 2^-3, 2^-4) commutes with every rounding: folded into
        # q, the GEMM yields the scaled scores bit for bit, without a pass over each tile
        qg, scale = qg * scale, None
    sink_rows = None if sinks is None else sinks.float().view(1, hkv, 1, g)
    out = torch.empty(s_count, hkv, t_max, g, d)
    lse = torch.empty(s_count, hkv, t_max, g) if need_lse else None
    blocks = list(range(0, t_max, QUERY_BLOCK))
    if len(blocks) > 1 and t_max - blocks[-1] < min_steps:
        blocks.pop()  # the last block would have too few GEMM rows: the one before takes it
    for bi, t0 in enumerate(blocks):
        t1 = blocks[bi + 1] if bi + 1 < len(blocks) else t_max
        steps = t1 - t0
        pos = positions[:, t0:t1]  # [S, t]
        visible_end = torch.minimum(pos, (lens - 1)[:, None])  # padded rows: within the length
        reach = whole_tiles(int(visible_end.max()) + 1, tile)
        hidden = slots[None, None, :reach] > visible_end[:, :, None]  # [S, t, reach]
        nearest = int(visible_end.min()) + 1  # keys below it: visible to every row

        def hide(scores, c0, c1, hidden=hidden, steps=steps):
            view = scores.view(s_count, hkv, steps, g, c1 - c0)
            view.masked_fill_(hidden[:, None, :, None, c0:c1], float("-inf"))

        qb = qg[:, :, t0:t1].reshape(s_count * hkv, steps * g, d)
        sink = None
        if sink_rows is not None:
            sink = sink_rows.expand(s_count, hkv, steps, g).reshape(s_count * hkv, steps * g)
        o, s = tiled_attention(
            qb, keys, values, scale, hide, reach, tile, soft_cap, sink, need_lse,
            open_until=nearest, alive_until=nearest,
        )  # fmt: skip
        out[:, :, t0:t1] = o.view(s_count, hkv, steps, g, d)
        if lse is not None:
            lse[:, :, t0:t1] = s.view(s_count, hkv, steps, g)
    out = out.permute(0, 2, 1, 3, 4)[real].reshape(-1, hq, d)
    if lse is not None:
        lse = lse.permute(0, 2, 1, 3)[real].reshape(-1, hq)
    return rows[real], out, lse
