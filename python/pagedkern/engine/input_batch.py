"""The running decode batch kept on the host between steps (the persistent batch of vLLM v1's
InputBatch, written for this runner): a steady decode step lays itself out without Python work
per request.

One row per request of the last steady decode step, in its order. What is fixed for a
request's lifetime (its prompt length, seed, temperature, top_p, top_k and whether its sampling
needs per-step host work) is written once, when it first takes a row; the block tables are kept
as a padded int32 matrix with a copy of each table as last written. Each step then reads the
requests' changing state with C-level passes (map over attribute getters: computed tokens,
output lists, tokens in flight, block tables), compares the block tables with the copies (list
equality: identity of the same ints, no conversion), rewrites only the rows that differ (a block
appended, a table rolled back and regrown, a new request) and computes everything else with
whole-batch numpy: slots, sequence lengths, the packed upload buffer, the sampling offsets.
Rows follow the scheduler's order; when membership or order changes (requests added, finished,
preempted, forked, reordered), the fixed columns are gathered to the new order in one numpy
take per column, and only the new requests are read field by field.

A step that is not a steady decode (a prefill chunk, a one-token chunk mid-prompt, speculation,
forks) is not laid out here (`decode_step` returns None): the runner's general path builds it
from chunks (model.layout_batch). Both give the same arrays (tests/test_input_batch.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import attrgetter, itemgetter, ne

import numpy as np

from ..model import BatchLayout
from ..model.attention_metadata import split_packed
from .request import Request


@dataclass(slots=True)
class DecodeStep:
    """A steady decode step laid out by InputBatch: every row one token that samples.
    sampling: (seeds, offsets, temperature, top_p, top_k) per row when no row needs host-side
    logits processing or logprobs (None: the runner builds them from the requests).
    fill_rows / fill_from: placeholder rows (their token is still being sampled) and the row of
    the previous step's ids that fills each."""

    requests: list[Request]
    layout: BatchLayout
    sampling: tuple[np.ndarray, ...] | None
    fill_rows: list[int]
    fill_from: list[int]


class InputBatch:
    """The persistent rows (see the module docstring); `decode_step` lays out a step. Columns
    grow by doubling from `rows` x `width` blocks."""

    def __init__(self, block_size: int, rows: int = 16, width: int = 8):
        self.block_size = block_size
        self._shift = block_size.bit_length() - 1  # log2(block_size) when a power of two
        self.requests: list[Request] = []  # row order of the last decode step
        self._row_of: dict[Request, int] = {}
        self._tables: list[list[int] | None] = []  # each row's block table as last written
        self._num_plain = 0  # rows of `requests` whose sampling is plain
        self._rows = 0
        self._width = 0
        self.table = np.zeros((0, 0), np.int32)  # [rows, width] block ids, 0-padded
        self.capacity = np.zeros(0, np.int64)  # tokens each row's table holds
        self.last_prompt = np.zeros(0, np.int64)  # position of the prompt's last token
        self.seed = np.zeros(0, np.int64)
        self.temperature = np.zeros(0, np.float32)
        self.top_p = np.zeros(0, np.float32)
        self.top_k = np.zeros(0, np.int32)
        self.plain = np.zeros(0, bool)  # sampling without logits processing or logprobs
        self._reserve(rows, width)

    _COLUMNS = (
        "table",
        "capacity",
        "last_prompt",
        "seed",
        "temperature",
        "top_p",
        "top_k",
        "plain",
    )

    def decode_step(
        self, entries: Sequence[tuple[Request, int]], pending: Mapping[Request, int] | None
    ) -> DecodeStep | None:
        """The step for `entries` if every one is a single token that samples; else None.
        `pending`: as ModelRunner.prepare's (rows whose token a step in flight samples).
        Few numpy calls, on purpose: each costs microseconds once a step has left the caches
        cold (as in layout_batch)."""
        b = len(entries)
        if not b or list(map(_count, entries)).count(1) != b:
            return None
        requests = list(map(_request, entries))
        self._sync_rows(requests)
        outputs = list(map(_output_ids, requests))
        fill_rows: list[int] = []
        fill_from: list[int] = []
        if pending or any(map(_num_pending, requests)):
            # computed tokens, tokens in flight, output lengths (+ in flight: the sampling
            # offsets), the row of the step in flight's ids that fills each placeholder
            state = np.fromiter(
                chain(
                    map(_num_computed, requests),
                    map(_num_pending, requests),
                    map(len, outputs),
                    map((pending or {}).get, requests, repeat(-1)),
                ),
                _I64,
                4 * b,
            )
            computed, in_flight, offsets, source = (
                state[:b],
                state[b : 2 * b],
                state[2 * b : 3 * b],
                state[3 * b :],
            )
            offsets += in_flight
            placeholder = source >= 0
            if np.count_nonzero(placeholder != (in_flight > 0)):
                return None  # a token in flight that no row fills, ...: the general path raises
            ids = np.zeros(b, np.int32)
            if np.count_nonzero(placeholder) == b:  # the steady state: every row in flight
                fill_rows, fill_from = self._arange[:b].tolist(), source.tolist()
            else:
                known = np.flatnonzero(~placeholder).tolist()
                ids[known] = [_last_token(requests[i]) for i in known]
                fill_rows = np.flatnonzero(placeholder).tolist()
                fill_from = source[placeholder].tolist()
        else:
            try:  # computed tokens, output lengths (the sampling offsets), input tokens
                state = np.fromiter(
                    chain(map(_num_computed, requests), map(len, outputs), map(_last, outputs)),
                    _I64,
                    3 * b,
                )
            except IndexError:  # a row whose token is its prompt's last (no output yet)
                state = np.fromiter(
                    chain(
                        map(_num_computed, requests),
                        map(len, outputs),
                        map(_last_token, requests),
                    ),
                    _I64,
                    3 * b,
                )
            computed, offsets, ids = state[:b], state[b : 2 * b], state[2 * b :]
        # every row samples: its one token is the last of prompt + output (+ in flight)
        if np.count_nonzero(computed - offsets - self.last_prompt[:b]):
            return None  # a one-token chunk mid-prompt
        tables = list(map(_block_table, requests))
        changed = list(compress(range(b), map(ne, tables, self._tables)))
        if changed:
            self._write_tables(changed, tables)
        capacity = self.capacity[:b]
        if np.count_nonzero(computed >= capacity):
            return None  # the general path names the bad sequence
        bs = self.block_size
        width = -(-int(capacity.max()) // bs)
        if bs & (bs - 1):
            block, offset = np.divmod(computed, bs)
        else:  # a power of two (the usual block size): a shift and a mask, cheaper than divmod
            block, offset = computed >> self._shift, computed & (bs - 1)
        block += self._row_start[:b]
        slots = self.table.take(block)  # table[row, position // bs] of the flattened table
        slots *= bs
        slots += offset
        arange = self._arange
        parts = (ids, computed, slots, arange[: b + 1], self.table[:b, :width], computed + 1)
        packed = np.concatenate((*parts, arange[:b]), axis=None, dtype=np.int32)
        sizes = [b, b, b, b + 1, b * width, b, b]
        ids, positions, slots, cu, tables, seq_lens, logits = split_packed(packed, sizes)
        layout = BatchLayout(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            cu_seqlens=cu,
            block_tables=tables,
            width=width,
            seq_lens=seq_lens,
            logits_indices=logits,
            num_prefills=0,
            max_query_len=1,
            _packed=packed,
        )
        sampling = None
        if self._num_plain == b:
            sampling = (
                self.seed[:b],
                offsets,
                self.temperature[:b],
                self.top_p[:b],
                self.top_k[:b],
            )
        return DecodeStep(requests, layout, sampling, fill_rows, fill_from)

    def _sync_rows(self, requests: list[Request]) -> None:
        """Put the rows in `requests`' order: kept rows gathered, new requests written."""
        if requests == self.requests:  # identity comparison (Request has no __eq__)
            return
        b = len(requests)
        self._reserve(b, self._width)
        old = np.fromiter(map(self._row_of.get, requests, repeat(-1)), np.int64, b)
        for name in self._COLUMNS:  # a new row (-1) takes some row's values, rewritten below
            column = getattr(self, name)
            column[:b] = column[old]
        previous = [*self._tables, None]  # index -1: a new row, no table written yet
        self._tables = list(map(previous.__getitem__, old.tolist()))
        for i in np.flatnonzero(old < 0).tolist():
            self._admit(i, requests[i])
        self.requests = requests.copy()  # (the step's own list goes to its caller)
        self._row_of = dict(zip(requests, range(b)))
        self._num_plain = int(np.count_nonzero(self.plain[:b]))

    def _admit(self, row: int, request: Request) -> None:
        """Write a request's fixed columns (read once: they do not change while it lives)."""
        p = request.params
        state = request.logits_state
        # (an empty prompt gets -2: no row matches it, the general path refuses it)
        self.last_prompt[row] = len(request.prompt_ids) - 1 if request.prompt_ids else -2
        self.seed[row] = request.seed
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.plain[row] = (
            (state is None or not state.active and state.mask is None)
            and request.grammar is None
            and p.logprobs is None
        )

    def _write_tables(self, changed: list[int], tables: list[list[int]]) -> None:
        """Rewrite the rows whose block table differs from the copy last written: the new
        entries of a table that grew (blocks appended, the common change), the whole row of
        any other (a new row, a table rolled back and regrown)."""
        stored = self._tables
        lens = list(map(len, map(tables.__getitem__, changed)))
        if max(lens) > self._width:
            self._reserve(self._rows, max(lens))
        matrix, width, capacity, bs = self.table, self._width, self.capacity, self.block_size
        whole = []
        for i, n in zip(changed, lens, strict=True):
            capacity[i] = n * bs
            table, old = tables[i], stored[i]
            k = 0 if old is None else len(old)
            if 0 < k < n and table[:k] == old:
                if n == k + 1:
                    matrix[i, k] = table[k]
                else:
                    matrix[i, k:n] = table[k:]
                old += table[k:]
            else:
                whole.append(i)
                stored[i] = list(table)
        if whole:
            matrix[whole] = [stored[i] + [0] * (width - len(stored[i])) for i in whole]

    def _reserve(self, rows: int, width: int) -> None:
        """Grow the columns to hold `rows` rows and tables of `width` blocks (doubling)."""
        if rows <= self._rows and width <= self._width:
            return
        new_rows = max(rows, 2 * self._rows) if rows > self._rows else self._rows
        new_width = max(width, 2 * self._width) if width > self._width else self._width
        for name in self._COLUMNS:
            old = getattr(self, name)
            if name == "table":
                grown = np.zeros((new_rows, new_width), old.dtype)
                grown[: old.shape[0], : old.shape[1]] = old
            else:
                grown = np.zeros(new_rows, old.dtype)
                grown[: len(old)] = old
            setattr(self, name, grown)
        self._rows, self._width = new_rows, new_width
        self._arange = np.arange(new_rows + 1, dtype=np.int32)
        self._row_start = self._arange[:new_rows] * np.int32(new_width)  # flat index of row r


def _last_token(request: Request) -> int:
    """The last token of prompt + output (a decode row's input without a token in flight);
    -1 for an empty sequence (its row fails the sampling check: the general path refuses it)."""
    ids = request.output_ids or request.prompt_ids
    return ids[-1] if ids else -1


_I64 = np.int64
_request = itemgetter(0)
_count = itemgetter(1)
_last = itemgetter(-1)
_num_computed = attrgetter("num_computed_tokens")
_output_ids = attrgetter("output_ids")
_num_pending = attrgetter("num_pending")
_block_table = attrgetter("block_table")
