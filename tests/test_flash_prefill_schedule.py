"""CPU checks of flash_prefill's index math, on Python mirrors of the kernel code (no GPU needed):

- the scheduler (csrc/flash_prefill.cu): every (sequence, query tile, head) exactly once, longest
  first, and a balanced makespan for skewed batches under the kernels' atomic work counter;
- the causal KV-tile bounds and the per-element mask (csrc/flash_prefill_common.cuh) against
  brute force;
- the page -> tile address math of both paths: path 1's per-row gather, the key / block_size
  magic division, path 2's TMA boxes into 128-byte-swizzled tiles (and the V rows it zeroes),
  compared with the reference's gather;
- the CuTe layout assumptions themselves, by building and running tests/flash_prefill_layouts.cu
  on the host (needs nvcc and the CUTLASS headers).
"""

from __future__ import annotations

import heapq
import random

import pytest
import torch
from support.host_layouts import run_layout_check

from pagedkern.reference.key_blocks import gather_sequence

BLOCK_M = 128  # flash::kBlockM
BLOCK_N = {"sm80 D=64": 128, "sm80 D=128": 64, "sm80 D=256": 64, "sm90": 128}
ITEM_ROWS = {"sm80 D=256": 64}  # Sm80Traits::kBlockM where it is not BLOCK_M: split list tiles
COST_BINS, KEYS_PER_BIN = 2048, 64  # flash_prefill.cu
HEADER = 4  # flash::kWorkListHeader


# ---- mirrors of the kernel code ----------------------------------------------------------------


def max_tiles(total_q: int, batch: int) -> int:
    return total_q // BLOCK_M + batch + 1


def kv_tile_bounds(q_pos0: int, rows: int, seq_len: int, block_n: int) -> tuple[int, int]:
    """flash::kv_tile_bounds: (n_tiles, n_unmasked), C++ integer division (truncating)."""
    kv_end = min(q_pos0 + rows, seq_len)
    n_tiles = (kv_end + block_n - 1) // block_n if kv_end > 0 else 0
    n_unmasked = min((q_pos0 + 1) // block_n, n_tiles) if q_pos0 + 1 > 0 else 0
    return n_tiles, n_unmasked


def cost_bin(kv_end: int) -> int:
    keys = min(max((kv_end + KEYS_PER_BIN - 1) // KEYS_PER_BIN, 0), COST_BINS - 1)
    return COST_BINS - 1 - keys


def tiles_of(cu_seqlens: list[int], seq_lens: list[int]):
    """for_each_tile: (b, m, bin) in the kernel's enumeration order (warp per sequence)."""
    for b, seq_len in enumerate(seq_lens):
        n = cu_seqlens[b + 1] - cu_seqlens[b]
        for m in range(-(-n // BLOCK_M) if n > 0 else 0):
            kv_end = min(seq_len - n + min((m + 1) * BLOCK_M, n), seq_len)
            yield b, m, cost_bin(kv_end)


def schedule(cu_seqlens: list[int], seq_lens: list[int], total_q: int, shuffle=None) -> list[int]:
    """flash_prefill_schedule_kernel: the workspace it writes (counting sort by decreasing cost;
    `shuffle` permutes the enumeration, as the atomics may within a bin)."""
    capacity = max_tiles(total_q, len(seq_lens))
    tiles = list(tiles_of(cu_seqlens, seq_lens))
    if shuffle is not None:
        shuffle(tiles)
    bins = [0] * COST_BINS
    for _, _, k in tiles:
        bins[k] += 1
    starts, running = [], 0
    for count in bins:
        starts.append(running)
        running += count
    workspace = [0, min(running, capacity), 0, 0] + [-1] * (2 * capacity)
    for b, m, k in tiles:
        slot = starts[k]
        starts[k] += 1
        if slot < capacity:
            workspace[HEADER + 2 * slot : HEADER + 2 * slot + 2] = [b, m]
    return workspace


def decode_work(
    workspace, cu_seqlens, seq_lens, num_heads, num_kv_heads, block_n, work, item_rows=BLOCK_M
):
    """flash::decode_work (item_rows < BLOCK_M: each list tile is BLOCK_M / item_rows items,
    heads innermost; a part past the chunk is empty: rows <= 0, no KV tile)."""
    split = BLOCK_M // item_rows
    entry, rest = divmod(work, num_heads * split)
    part, head = divmod(rest, num_heads)
    b, m = workspace[HEADER + 2 * entry : HEADER + 2 * entry + 2]
    n = cu_seqlens[b + 1] - cu_seqlens[b]
    row0 = m * BLOCK_M + part * item_rows
    q_pos0 = seq_lens[b] - n + row0
    rows = min(item_rows, n - row0)
    n_tiles, n_unmasked = kv_tile_bounds(q_pos0, rows, seq_lens[b], block_n)
    if rows <= 0:
        n_tiles = n_unmasked = 0
    return dict(
        seq=b,
        head=head,
        kv_head=head // (num_heads // num_kv_heads),
        q_row0=cu_seqlens[b] + row0,
        rows=rows,
        q_pos0=q_pos0,
        n_tiles=n_tiles,
        n_unmasked=n_unmasked,
    )


def page_magic(block_size: int) -> tuple[int, int]:
    """make_kernel_params: (page_mul, page_shift); page = umulhi(key, mul) >> shift."""
    if block_size <= 1:
        return 0, 0
    log2 = (block_size - 1).bit_length()  # ceil(log2(block_size))
    return ((1 << (31 + log2)) + block_size - 1) // block_size, log2 - 1


def page_of(key: int, block_size: int) -> tuple[int, int]:
    mul, shift = page_magic(block_size)
    page = ((key * mul) >> 32) >> shift if mul else key
    return page, key - page * block_size


def random_batch(rng: random.Random, batch: int, max_chunk: int, max_prefix: int):
    chunks = [rng.randint(0, max_chunk) for _ in range(batch)]
    seq_lens = [c + rng.randint(0, max_prefix) for c in chunks]
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + c)
    return cu, seq_lens


# ---- scheduler -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_schedule_covers_every_query_row_and_head_once(seed):
    rng = random.Random(seed)
    batch = rng.randint(1, 12)
    cu, seq_lens = random_batch(rng, batch, rng.choice([1, 7, 130, 700]), rng.choice([0, 50, 999]))
    num_kv_heads = rng.choice([1, 2])
    num_heads = num_kv_heads * rng.choice([1, 3, 4])
    kernel = list(BLOCK_N)[seed % len(BLOCK_N)]
    block_n, item_rows = BLOCK_N[kernel], ITEM_ROWS.get(kernel, BLOCK_M)
    ws = schedule(cu, seq_lens, cu[-1], shuffle=rng.shuffle)
    assert ws[0] == 0 and ws[1] <= max_tiles(cu[-1], batch)
    seen = {}
    for work in range(ws[1] * num_heads * (BLOCK_M // item_rows)):
        t = decode_work(ws, cu, seq_lens, num_heads, num_kv_heads, block_n, work, item_rows)
        assert t["rows"] <= item_rows and t["kv_head"] < num_kv_heads
        if t["rows"] <= 0:  # the empty second half of a short tile: no work
            assert item_rows < BLOCK_M and t["n_tiles"] == 0
            continue
        for row in range(t["q_row0"], t["q_row0"] + t["rows"]):
            key = (row, t["head"])
            assert key not in seen, f"query row {row} head {t['head']} scheduled twice"
            seen[key] = t["seq"]
    assert len(seen) == cu[-1] * num_heads  # every row of every head
    for (row, _), b in seen.items():
        assert cu[b] <= row < cu[b + 1]


def test_schedule_orders_tiles_longest_first():
    rng = random.Random(7)
    cu, seq_lens = random_batch(rng, 30, 900, 3000)
    ws = schedule(cu, seq_lens, cu[-1], shuffle=rng.shuffle)
    costs = []
    for e in range(ws[1]):
        t = decode_work(ws, cu, seq_lens, 1, 1, 64, e)
        costs.append(min(t["q_pos0"] + t["rows"], seq_lens[t["seq"]]))
    bins = [-(-c // KEYS_PER_BIN) for c in costs]
    assert bins == sorted(bins, reverse=True)


def makespan(costs: list[float], workers: int) -> float:
    """The kernels' atomic counter: each CTA takes the next item when it finishes its last."""
    finish = [0.0] * workers
    for cost in costs:
        heapq.heapreplace(finish, finish[0] + cost)
    return max(finish)


def work_costs(order, cu, seq_lens, num_heads, block_n, overhead=2.0):
    """Cost of each item in `order` ((b, m) tiles x heads): KV tiles visited + a fixed cost."""
    costs = []
    for b, m in order:
        n = cu[b + 1] - cu[b]
        rows = min(BLOCK_M, n - m * BLOCK_M)
        n_tiles, _ = kv_tile_bounds(seq_lens[b] - n + m * BLOCK_M, rows, seq_lens[b], block_n)
        costs += [overhead + n_tiles] * num_heads
    return costs


@pytest.mark.parametrize(
    "name,chunks,prefixes",
    [
        ("one long + 64 short", [12288] + [64] * 64, [0] * 65),
        ("one long prefix hit + short", [2048] + [100] * 100, [30000] + [0] * 100),
        ("uniform", [1024] * 16, [0] * 16),
        ("single 16k", [16384], [0]),
    ],
)
@pytest.mark.parametrize("workers", [132, 264])
def test_schedule_is_balanced_for_skewed_batches(name, chunks, prefixes, workers):
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + c)
    seq_lens = [c + p for c, p in zip(chunks, prefixes, strict=True)]
    num_heads, block_n = 32, 128
    ws = schedule(cu, seq_lens, cu[-1])
    order = [tuple(ws[HEADER + 2 * e : HEADER + 2 * e + 2]) for e in range(ws[1])]
    costs = work_costs(order, cu, seq_lens, num_heads, block_n)
    lower_bound = max(sum(costs) / workers, max(costs))
    ours = makespan(costs, workers)
    # Longest-first list scheduling is within 4/3 of optimal (Graham); with thousands of items
    # it lands within about 1% of the lower bound (max of the mean load and the longest item).
    assert ours <= 1.05 * lower_bound, (ours, lower_bound)
    # A plain grid (query tile fastest, as a non-persistent launch) runs the long sequence's
    # expensive tiles whenever they come up; longest-first never does worse here.
    grid = [(b, m) for b in range(len(chunks)) for m in range(-(-chunks[b] // BLOCK_M))]
    assert ours <= makespan(work_costs(grid, cu, seq_lens, num_heads, block_n), workers) + 1e-9


# ---- causal bounds and mask ----------------------------------------------------------------------


def test_kv_tile_bounds_match_brute_force():
    # Exhaustive over small tiles (the formulas are generic in block_n), sampled for real ones.
    cases = [(bn, range(3 * bn + 3), (1, 2, 3, 7, 8, 9, 16, 17, 40)) for bn in (8, 16)]
    cases += [
        (bn, (0, 1, bn - 1, bn, bn + 1, 2 * bn + 7, 3 * bn), (1, 65, 128)) for bn in (64, 128)
    ]
    for block_n, seq_lens, row_counts in cases:
        keys = torch.arange(4 * block_n)
        for seq_len in seq_lens:
            for rows in row_counts:
                # q_pos0 = seq_len - n + m * 128, so q_pos0 + rows <= seq_len by construction;
                # q_pos0 < 0 only for invalid input (seq_len < chunk): those rows see nothing.
                for q_pos0 in range(-2, seq_len - rows + 1):
                    n_tiles, n_unmasked = kv_tile_bounds(q_pos0, rows, seq_len, block_n)
                    pos = q_pos0 + torch.arange(rows)
                    visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] < seq_len)
                    seen = keys[visible.any(0)]
                    assert n_tiles == (int(seen.max()) // block_n + 1 if len(seen) else 0)
                    full = visible.reshape(rows, -1, block_n).all(2).all(0)
                    assert full[:n_tiles].tolist() == [j < n_unmasked for j in range(n_tiles)]


def window_visits(q_pos0: int, n_tiles: int, block_n: int, window: int) -> tuple[int, int]:
    """flash::decode_work's options part: (key_lo, n_visits) for a window > 0."""
    key_lo = max(0, q_pos0 + 1 - window)
    return key_lo, max(0, n_tiles - key_lo // block_n)


@pytest.mark.parametrize("item_rows,block_n", [(128, 64), (128, 128), (64, 64)])
def test_window_tile_range_matches_brute_force(item_rows, block_n):
    # Every key some row of the item sees lies in the visited tiles and at or after key_lo;
    # keys before key_lo are seen by no row; the oldest visited tile holds a seen key.
    rng = random.Random(item_rows + block_n)
    for _ in range(300):
        n = rng.randint(1, 400)
        seq_len = n + rng.choice([0, 1, 63, 64, 65, 1000])
        window = rng.choice([1, 2, 63, 64, 65, 100, 129, 5000])
        for row0 in range(0, n, item_rows):
            rows, q_pos0 = min(item_rows, n - row0), seq_len - n + row0
            n_tiles, _ = kv_tile_bounds(q_pos0, rows, seq_len, block_n)
            key_lo, visits = window_visits(q_pos0, n_tiles, block_n, window)
            seen = {
                k
                for pos in range(q_pos0, q_pos0 + rows)
                for k in range(max(0, pos + 1 - window), min(pos, seq_len - 1) + 1)
            }
            first_tile = n_tiles - visits
            assert all(first_tile * block_n <= k < n_tiles * block_n for k in seen)
            assert min(seen) == key_lo  # the first row's window starts there
            assert any(first_tile * block_n <= k < (first_tile + 1) * block_n for k in seen)


def test_causal_mask_matches_reference_visibility():
    block_n = 64
    for seq_len, n in [(1, 1), (70, 7), (200, 113), (1000, 1000), (135, 15)]:
        prefix = seq_len - n
        for m in range(-(-n // BLOCK_M)):
            q_pos0 = prefix + m * BLOCK_M
            rows = min(BLOCK_M, n - m * BLOCK_M)
            n_tiles, _ = kv_tile_bounds(q_pos0, rows, seq_len, block_n)
            for tile in range(n_tiles):
                key0 = tile * block_n
                for r in range(BLOCK_M):  # padding rows too: they must stay finite
                    limit = min(q_pos0 + r, seq_len - 1) - key0  # flash::causal_mask
                    for c in range(block_n):
                        kept = c <= limit
                        if r < rows:
                            assert kept == (key0 + c <= q_pos0 + r), (seq_len, n, m, tile, r, c)
                        else:
                            assert not kept or key0 + c < seq_len


# ---- page -> tile address math -------------------------------------------------------------------


def test_page_magic_division():
    for block_size in [*range(1, 70), 96, 128, 255, 256, 1000, 4096]:
        keys = list(range(0, 5000)) + [2**31 - 1, 2**31 - block_size, 123456789]
        for key in keys:
            assert page_of(key, block_size) == divmod(key, block_size), (block_size, key)


def random_cache(rng: torch.Generator, num_blocks, num_kv_heads, block_size, head_dim):
    return torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=rng)


@pytest.mark.parametrize("block_size", [1, 5, 16, 32, 64, 128])
@pytest.mark.parametrize("head_dim,block_n", [(64, 128), (128, 64)])
def test_path1_row_gather_matches_reference(block_size, head_dim, block_n):
    g = torch.Generator().manual_seed(block_size)
    num_kv_heads, seq_len = 2, 300
    pages = -(-seq_len // block_size)
    cache = random_cache(g, pages + 7, num_kv_heads, block_size, head_dim)
    table = torch.randperm(pages + 7, generator=g)[:pages].int()
    flat = cache.reshape(-1)
    page_stride = num_kv_heads * block_size * head_dim
    for kv_head in range(num_kv_heads):
        want = gather_sequence(cache, table, seq_len)[kv_head]
        for tile in range(-(-seq_len // block_n)):
            got = torch.zeros(block_n, head_dim)
            for row in range(block_n):  # load_kv: one table lookup per row, zero past seq_len
                key = tile * block_n + row
                if key < seq_len:
                    page, slot = page_of(key, block_size)
                    base = kv_head * block_size * head_dim + int(table[page]) * page_stride
                    got[row] = flat[base + slot * head_dim : base + (slot + 1) * head_dim]
            ref = torch.zeros(block_n, head_dim)
            keys = want[tile * block_n : (tile + 1) * block_n]
            ref[: keys.shape[0]] = keys
            assert torch.equal(got, ref)


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
@pytest.mark.parametrize("head_dim,block_n", [(64, 128), (128, 64)])
def test_path1_fp8_chunks_gather_the_tile(block_size, head_dim, block_n):
    """load_kv's fp8 branch: thread t copies the 16-element chunk t % (D / 16) of rows
    t / (D / 16) + (128 / (D / 16)) * m, each row's page from the page-id ring (ids[row]),
    zero-filled past seq_len; the chunks rebuild the gathered tile (flash_prefill_sm80.cuh
    fp8_chunk_row / fp8_chunk_col; the conversion pass is checked by flash_prefill_layouts.cu)."""
    g = torch.Generator().manual_seed(block_size + head_dim)
    threads, num_kv_heads, seq_len = 128, 2, 211
    chunks_per_row = head_dim // 16
    rows_per_pass = threads // chunks_per_row
    pages = -(-seq_len // block_size)
    cache = random_cache(g, pages + 3, num_kv_heads, block_size, head_dim)
    table = torch.randperm(pages + 3, generator=g)[:pages].int()
    flat = cache.reshape(-1)
    page_stride = num_kv_heads * block_size * head_dim
    for kv_head in range(num_kv_heads):
        want = gather_sequence(cache, table, seq_len)[kv_head]
        for tile in range(-(-seq_len // block_n)):
            ring = [  # fetch_pages: the page of each key row of the tile (0 past seq_len)
                int(table[page_of(tile * block_n + r, block_size)[0]])
                if tile * block_n + r < seq_len
                else 0
                for r in range(block_n)
            ]
            got = torch.full((block_n, head_dim), float("nan"))
            for t in range(threads):
                for m in range(block_n // rows_per_pass):
                    row = t // chunks_per_row + rows_per_pass * m
                    col = t % chunks_per_row * 16
                    key = tile * block_n + row
                    if key < seq_len:
                        slot = page_of(key, block_size)[1]
                        base = kv_head * block_size * head_dim + ring[row] * page_stride
                        base += slot * head_dim + col
                        got[row, col : col + 16] = flat[base : base + 16]
                    else:
                        got[row, col : col + 16] = 0.0  # cp.async src-size 0
            ref = torch.zeros(block_n, head_dim)
            keys = want[tile * block_n : (tile + 1) * block_n]
            ref[: keys.shape[0]] = keys
            assert torch.equal(got, ref)


def sw128_offset(row: int, col: int, rows: int) -> int:
    """Element offset of (row, col) in a [rows, D] tile of 128-byte-swizzled 64-column slabs (the
    layout TMA SWIZZLE_128B writes and wgmma reads; checked against CuTe's by the host check)."""
    return (col // 64) * rows * 64 + row * 64 + (((col % 64) // 8) ^ (row % 8)) * 8 + col % 8


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_path2_tma_boxes_fill_the_tile(block_size, head_dim):
    g = torch.Generator().manual_seed(block_size + head_dim)
    block_n, num_kv_heads, seq_len = 128, 3, 333
    pages = -(-seq_len // block_size)
    cache = random_cache(g, pages + 3, num_kv_heads, block_size, head_dim)
    table = torch.randperm(pages + 3, generator=g)[:pages].int()
    # The tensor map: (D, block_size, num_blocks * Hkv) planes; a box is (64, box_rows, 1).
    planes = cache.reshape(-1, block_size, head_dim)
    box_rows = min(block_size, block_n)
    stale = float("nan")  # what a buffer holds before: any value, NaN the worst
    for kv_head in range(num_kv_heads):
        want = gather_sequence(cache, table, seq_len)[kv_head]
        for j in range(-(-seq_len // block_n)):
            smem = torch.full((block_n * head_dim,), stale)
            key0 = j * block_n
            boxes = -(-min(block_n, seq_len - key0) // box_rows)
            assert boxes <= block_n // box_rows <= 32  # one producer lane per box
            for lane in range(boxes):
                page, slot = page_of(key0 + lane * box_rows, block_size)
                plane = int(table[page]) * num_kv_heads + kv_head
                for slab in range(head_dim // 64):
                    dst = slab * block_n * 64 + lane * box_rows * 64  # element offset of the box
                    box = planes[plane, slot : slot + box_rows, slab * 64 : (slab + 1) * 64]
                    for r in range(box_rows):  # TMA swizzles by address: chunk ^ (row % 8)
                        for c in range(64):
                            off = dst + r * 64 + ((c // 8) ^ ((lane * box_rows + r) % 8)) * 8
                            smem[off + c % 8] = box[r, c]
            # Rows past seq_len: not loaded (K: masked to -inf; V: zeroed by the consumers).
            first_past = seq_len - key0
            for r in range(max(first_past, 0), block_n):
                for c in range(head_dim):
                    smem[sw128_offset(r, c, block_n)] = 0.0
            tile = torch.stack(
                [
                    torch.stack([smem[sw128_offset(r, c, block_n)] for c in range(head_dim)])
                    for r in range(block_n)
                ]
            )
            ref = torch.zeros(block_n, head_dim)
            keys = want[key0 : key0 + block_n]
            ref[: keys.shape[0]] = keys
            assert torch.equal(tile, ref), (block_size, head_dim, kv_head, j)


# ---- the CuTe layouts themselves -----------------------------------------------------------------


@pytest.mark.slow  # a 15-25 s nvcc build of a host program; CI runs it
def test_cute_layouts_on_the_host(tmp_path):
    """tests/flash_prefill_layouts.cu: accumulator coordinates, the P operand, the quads of the
    row reductions, the hand-written and TMA shared-memory addresses (about 20 s of nvcc)."""
    run_layout_check("flash_prefill_layouts.cu", tmp_path)
