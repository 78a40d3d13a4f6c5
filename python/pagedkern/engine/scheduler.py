"""Continuous batching: each iteration picks which requests run and how many tokens each feeds,
under a token budget and a sequence limit, with chunked prefill and preemption by recompute.

Order: running requests first (decodes and unfinished prompt chunks), oldest first; then waiting
requests in arrival order (preempted ones at the front). A long prompt is cut into chunks that
share iterations with other requests' decodes; while a request waits with a seat free, a running
prompt's chunk takes at most half the token budget, so a short prompt is admitted at the next
step instead of after the long one's whole prefill. Every running sequence, each sample of an
n > 1 request too, holds one of max_num_seqs seats.

When a running request needs a block and none is free, one is preempted: its blocks go back to
the pool and it later recomputes its K/V from its ids, so every admitted request eventually
finishes. Fairness rule: the victim is the newest sample of the request running the most
samples (a fan-out pays for its own growth, and re-queues behind those already waiting), else
the newest running request (back to the front of the queue). So short requests beside a large
n > 1 request keep moving instead of being the ones preempted over and over.

Speculative decoding: a decoding request that may speculate is scheduled for 1 + k tokens (its
last token and k proposals; the budget counts all of them) and gets KV slots for all of them
before anyone proposes (`ScheduledBatch.lookahead`; without the blocks it falls back to a plain
decode rather than preempting anyone). After verification `on_step_done` counts only the
accepted tokens as computed (the rest of the slots are rewound) and frees the whole blocks past
the sequence's new end; only blocks full of verified tokens ever enter the prefix cache.

Asynchronous scheduling (engine/overlap.py): the next step is scheduled while one runs, with
its sampled tokens pending (Request.num_pending, counted by num_tokens); `on_step_launched`
counts a step's tokens as computed at launch and `register_computed` hashes the blocks they
filled once its ids are known. A request whose pending token is its last (max_tokens, context)
is not scheduled again, nor a preempted one readmitted while its token is still in flight.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from ..model.config import SLIDING, ModelConfig
from .block_pool import BlockPool
from .config import EngineConfig
from .hybrid_tables import HybridTables
from .request import Request, RequestStatus

_ENGINE_DEFAULTS = EngineConfig()


def released_kv_window(model_config: ModelConfig, config: EngineConfig) -> int | None:
    """The window whose older blocks the scheduler releases: the model's sliding window when
    every layer has one (Mistral-style). None when some layer attends to every key (Gemma 2/3's
    global layers, Qwen2's layers past max_window_layers: they still read every block, and the
    layers share one block table), and under draft-model speculation (the draft model reads
    the same tables, with no window)."""
    types = model_config.layer_types
    if not types or any(t != SLIDING for t in types) or config.speculative == "draft":
        return None
    return model_config.sliding_window


class RequestRejected(ValueError):
    """The request can never run here (longer than the context or the whole KV cache)."""


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's limits; the defaults are EngineConfig's (`from_engine` builds one).
    max_model_len: the context a sequence may fill (the model's, capped by the KV cache)."""

    max_model_len: int
    max_num_seqs: int = _ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = _ENGINE_DEFAULTS.max_num_batched_tokens
    enable_chunked_prefill: bool = _ENGINE_DEFAULTS.enable_chunked_prefill
    num_lookahead_tokens: int = 0  # k of speculative decoding (0: off)
    # Every layer's sliding window (None: some layer attends to everything): blocks wholly
    # older than any future query's window are released (release_outside_window).
    kv_window: int | None = None
    # Hybrid local/global models with per-kind tables (engine/hybrid_tables.py): the windows
    # of layer groups 1.. (None: full attention; group 0 is full). (): one table.
    group_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len) < 1:
            raise ValueError(f"scheduler limits must be >= 1: {self}")

    @classmethod
    def from_engine(
        cls,
        config: EngineConfig,
        max_model_len: int,
        kv_window: int | None = None,
        group_windows: tuple[int | None, ...] = (),
    ) -> SchedulerConfig:
        return cls(
            kv_window=kv_window,
            group_windows=group_windows,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_lookahead_tokens=(
                config.num_speculative_tokens if config.speculative != "none" else 0
            ),
        )


@dataclass(slots=True)
class ScheduledBatch:
    """One iteration: (request, number of new tokens) in batch order, who was preempted, and
    the requests whose own scheduling or accounting failed (removed from the queues, blocks
    given back; the engine finishes them with an error). lookahead: decoding requests that may
    speculate and the k proposals they hold slots for (their entry counts 1 + k tokens until
    the engine shrinks it to 1 + the proposal's length). accepted: after verification, the
    proposals each accepted (they count as computed; the engine appends them to the output)."""

    entries: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    lookahead: dict[Request, int] = field(default_factory=dict)
    accepted: dict[Request, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    def __init__(self, pool: BlockPool, config: SchedulerConfig):
        self.pool = pool
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.hybrid: HybridTables | None = None  # per-kind tables, if any
        if config.group_windows:
            windows = (config.kv_window, *config.group_windows)
            self.hybrid = HybridTables(pool, windows, config.max_num_batched_tokens)

    def add(self, request: Request) -> None:
        limit = self.config.max_model_len
        if request.num_tokens >= limit:
            raise RequestRejected(
                f"request {request.request_id}: {request.num_tokens} prompt tokens leave no room "
                f"in a context of {limit} tokens (the model's, or what the KV cache holds)"
            )
        hybrid = self.hybrid
        needed = (hybrid.blocks_needed if hybrid else self.pool.blocks_for)(request.num_tokens + 1)
        if needed > self.pool.capacity:
            raise RequestRejected(
                f"request {request.request_id}: {request.num_tokens} prompt tokens need more KV "
                f"blocks than the whole cache holds "
                f"({self.pool.num_blocks} x {self.pool.block_size} tokens)"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        slots_per_block = self.pool.block_size
        running = self.running
        lookahead = self.config.num_lookahead_tokens
        entries = batch.entries
        # A running prompt's chunk leaves half the budget to the waiting requests that have a
        # seat, so a short prompt never waits behind a long one's whole prefill.
        admitting = self.waiting and len(running) < self.config.max_num_seqs
        chunk_cap = max(1, self.config.max_num_batched_tokens // 2) if admitting else budget
        i, num_running = 0, len(running)
        append = entries.append
        # Running requests in order. Most are plain decodes (a few hundred per step), whose
        # whole path is the first lines and the append: 1 token, room left in the last block.
        while i < num_running and budget > 0:
            request = running[i]
            computed, pending = request.num_computed_tokens, request.num_pending
            if pending and self._ends_with_pending(request):
                i += 1  # its in-flight token ends it (max_tokens / context): nothing to run
                continue
            num_new = len(request.prompt_ids) + len(request.output_ids) + pending - computed
            if num_new != 1:  # (a decode's 1 is within budget and chunk_cap)
                num_new = min(num_new, budget, chunk_cap)
            k = self._lookahead(request, num_new, budget) if lookahead else 0
            if k and self._reserve(request, 1 + k):  # short of blocks: a plain decode instead
                batch.lookahead[request] = k
                num_new = 1 + k
            elif computed + num_new > len(request.block_table) * slots_per_block:
                while not self._reserve(request, num_new):
                    victim = self._victim()
                    if running.index(victim) < i:  # scheduled already: take its entry back
                        i -= 1
                        budget += self._unschedule(batch, victim)
                    self._preempt(victim)
                    batch.preempted.append(victim)
                    num_running -= 1
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    continue  # running[i] is now the request after it
            append((request, num_new))
            budget -= num_new
            i += 1
        if batch.preempted:
            return batch  # memory is short: admit nobody new this iteration
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:  # preempted with a token in flight: next step, in order
                break
            try:  # hashing the request's own ids: its fault if it fails, nobody else's
                hits = self._prefix_hits(request)
            except Exception as exc:  # noqa: BLE001 - isolated: the request fails alone
                self.waiting.popleft()
                self._release(request)
                request.num_cached_tokens = 0
                batch.failed.append((request, exc))
                continue
            num_new = min(request.num_uncomputed, budget)
            chunk_not_allowed = (
                not self.config.enable_chunked_prefill and num_new < request.num_uncomputed
            )
            if chunk_not_allowed or not self._reserve(request, num_new):
                self.pool.free(hits)
                request.block_table.clear()
                request.num_computed_tokens = request.num_cached_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            entries.append((request, num_new))
            budget -= num_new
        return batch

    def _ends_with_pending(self, request: Request) -> bool:
        """Asynchronous scheduling: whether the token in flight is the request's last by
        max_tokens or the context (stops by EOS or stop strings are only known later)."""
        generated = len(request.output_ids) + request.num_pending
        return (
            generated >= request.params.max_tokens
            or request.num_tokens >= self.config.max_model_len
        )

    def _lookahead(self, request: Request, num_new: int, budget: int) -> int:
        """How many proposals a decoding request may verify this step: k, capped by the token
        budget, the context (every verified position needs a KV slot below max_model_len) and
        what max_tokens leaves (the step yields up to k + 1 tokens). 0: decode as usual."""
        if num_new != 1 or request.num_uncomputed != 1 or not request.may_speculate:
            return 0
        if not request.output_ids:  # its first token comes from the prompt (and n > 1 forks)
            return 0
        room = min(
            budget - 1,
            self.config.max_model_len - request.num_tokens,
            request.params.max_tokens - len(request.output_ids) - 1,
        )
        return max(0, min(self.config.num_lookahead_tokens, room))

    def _prefix_hits(self, request: Request) -> list[int]:
        """Acquire the cached blocks of the request's longest cached prefix (leaving at least one
        token to compute, whose logits give the next token)."""
        request.block_hashes = self.pool.block_hashes(request.all_ids, request.block_hashes)
        max_blocks = (request.num_tokens - 1) // self.pool.block_size
        if request.params.prompt_logprobs is not None:
            max_blocks = 0  # every prompt position is computed (engine/prompt_logprobs.py)
        if self.hybrid is not None:  # every group's tables set, all their blocks acquired
            hits, num_hit = self.hybrid.prefix_hits(request, max_blocks)
        else:
            hits = self.pool.lookup_prefix(request.block_hashes, max_blocks)
            self.pool.acquire(hits)
            request.block_table = list(hits)  # right after acquire: a release frees these
            num_hit = len(hits)
        self.pool.prefix_queries += request.num_tokens
        self.pool.prefix_hits += num_hit * self.pool.block_size
        request.num_computed_tokens = request.num_cached_tokens = num_hit * self.pool.block_size
        return hits

    def _reserve(self, request: Request, num_new: int) -> bool:
        if self.hybrid is not None:
            blocks = self.pool.blocks_for(request.num_computed_tokens + num_new)
            return self.hybrid.reserve(request, blocks)
        needed = self.pool.blocks_for(request.num_computed_tokens + num_new) - len(
            request.block_table
        )
        if needed <= 0:  # the common decode step: room left in the last block
            return True
        blocks = self.pool.allocate(needed)
        if blocks is None:
            return False
        request.block_table.extend(blocks)
        return True

    def _victim(self) -> Request:
        """Who gives its blocks back when memory is short: the newest running sample of the
        request that runs the most samples (an n > 1 request pays for its own fan-out), else
        the newest running request."""
        running = self.running
        counts = Counter(r.parent_id for r in running if r.parent_id is not None)
        if counts:
            parent, count = counts.most_common(1)[0]
            if count > 1:
                return next(r for r in reversed(running) if r.parent_id == parent)
        return running[-1]

    @staticmethod
    def _unschedule(batch: ScheduledBatch, request: Request) -> int:
        """Take `request`'s entry out of `batch`; the tokens it had."""
        for j, (r, num_new) in enumerate(batch.entries):
            if r is request:
                del batch.entries[j]
                batch.lookahead.pop(request, None)
                return num_new
        return 0

    def _preempt(self, request: Request) -> None:
        """Back to waiting, its blocks freed: a single request at the front (next to be
        readmitted), a sample of a fan-out behind the requests already waiting."""
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        if request.parent_id is None:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _release(self, request: Request) -> None:
        if self.hybrid is not None:
            self.hybrid.release(request)
        else:
            self.pool.free(request.block_table)
            request.block_table = []
        request.num_computed_tokens = 0

    def on_step_done(self, batch: ScheduledBatch) -> None:
        """Account the tokens just computed (and cache newly full blocks). A request whose own
        accounting fails is appended to batch.failed and left for the engine to finish. Who
        samples is the runner's to say (StepResult); `ready` says it without one."""
        bs = self.pool.block_size
        caching = self.pool.enable_prefix_caching
        verified = batch.accepted
        for request, num_new in batch.entries:
            accepted = verified.get(request) if verified else None
            if accepted is not None:  # verified: the last token and the accepted proposals
                num_new = 1 + len(accepted)
            before = request.num_computed_tokens
            after = request.num_computed_tokens = before + num_new
            if caching and after // bs > before // bs:  # blocks that just filled become findable
                try:
                    self._register_full_blocks(request, before // bs, after // bs, accepted)
                except Exception as exc:  # noqa: BLE001 - isolated: the request fails alone
                    batch.failed.append((request, exc))
                    continue
            if accepted is not None:
                self._roll_back(request, after + 1)
            self.release_outside_window(request, after)

    @staticmethod
    def ready(batch: ScheduledBatch) -> list[Request]:
        """After on_step_done: the batch's requests whose every token is now computed, i.e.
        those that sample a next token (a verified one counts its accepted proposals)."""
        failed = {request for request, _ in batch.failed}
        return [
            request
            for request, _ in batch.entries
            if request not in failed
            and request.num_computed_tokens
            == request.num_tokens + len(batch.accepted.get(request, ()))
        ]

    def on_step_launched(self, batch: ScheduledBatch) -> list[tuple[Request, int, int]]:
        """Asynchronous scheduling: account the batch's tokens as computed when it is handed
        to the worker (the next step is scheduled before this one ends; the worker runs steps
        in order). Returns (request, computed before, after) per entry: the prefix-cache
        hashes of blocks that fill wait for `register_computed`, once the ids are known."""
        advanced = []
        for request, num_new in batch.entries:
            before = request.num_computed_tokens
            request.num_computed_tokens = before + num_new
            advanced.append((request, before, before + num_new))
        return advanced

    def register_computed(self, request: Request, before: int, after: int) -> None:
        """Asynchronous scheduling, at the end of the step that computed tokens [before,
        after) of a still running request: make the blocks that filled findable."""
        bs = self.pool.block_size
        if self.pool.enable_prefix_caching and after // bs > before // bs:
            self._register_full_blocks(request, before // bs, after // bs)
        self.release_outside_window(request, after)

    def release_outside_window(self, request: Request, computed: int) -> None:
        """Windowed models: free the blocks no query from position `computed` on can see (keys
        older than computed - window + 1), their table entries becoming the pool's null block.
        Released entries form a prefix of the table: the walk stops at the first null one.
        Safe with a step in flight (asynchronous scheduling): its queries sit at or past
        `computed`; a block reallocated meanwhile is written only by a later step."""
        if self.hybrid is not None:
            self.hybrid.release_outside_window(request, computed)
            return
        window = self.config.kv_window
        if window is None:
            return
        table, null = request.block_table, self.pool.null_block
        end = min(max(0, computed - window + 1) // self.pool.block_size, len(table))
        j = end - 1
        while j >= 0 and table[j] != null:
            j -= 1
        released = table[j + 1 : end]
        if released:
            self.pool.free(released)
            table[j + 1 : end] = [null] * len(released)

    def _roll_back(self, request: Request, end: int) -> None:
        """Free the whole blocks past `end` tokens (slots of rejected proposals, or reserved
        for proposals never made); slots past num_computed_tokens in the kept last block are
        simply overwritten by the next step."""
        keep = self.pool.blocks_for(end)
        if self.hybrid is not None:
            self.hybrid.roll_back(request, keep)
        elif len(request.block_table) > keep:
            self.pool.free(request.block_table[keep:])
            del request.block_table[keep:]

    def _register_full_blocks(
        self, request: Request, first: int, full: int, accepted: tuple[int, ...] | None = None
    ) -> None:
        """Make blocks [first, full) findable, hashing only the ids of the blocks not hashed
        yet (a verified run's accepted ids follow the request's own)."""
        pool = self.pool
        hashes = request.block_hashes
        start, end = len(hashes) * pool.block_size, full * pool.block_size
        if start < end:
            ids = request.ids_between(start, end)
            if accepted and len(ids) < end - start:
                ids = [*ids, *accepted][: end - start]
            pool.extend_hashes(hashes, ids)
        if self.hybrid is not None:
            self.hybrid.register(request, first, full)
            return
        table = request.block_table
        for j in range(first, full):
            pool.register(table[j], hashes[j])

    def fork(self, leader: Request, sample: Request) -> tuple[int, int] | None:
        """n > 1: `sample` starts running from `leader`'s computed prompt: the full prompt blocks
        shared (one more reference each), the partial last block, if any, a fresh block whose
        K/V the caller copies: (source, destination) is returned. Without a free block or a
        free seat (every running sample counts against max_num_seqs) the sample waits and
        recomputes its prompt (prefix-cache hits make that cheap)."""
        bs = self.pool.block_size
        prompt_len = len(leader.prompt_ids)
        full = prompt_len // bs
        copy = None
        table = list(leader.block_table[:full])
        if len(self.running) >= self.config.max_num_seqs or self.hybrid is not None:
            self.add(sample)
            return None
        if prompt_len % bs:
            fresh = self.pool.allocate(1)
            if fresh is None:
                self.add(sample)
                return None
            copy = (leader.block_table[full], fresh[0])
            table += fresh
        self.pool.acquire(table[:full])
        sample.block_table = table
        sample.block_hashes = list(leader.block_hashes[:full])
        sample.num_computed_tokens = prompt_len
        sample.status = RequestStatus.RUNNING
        self.running.append(sample)
        return copy

    def finish(self, request: Request) -> None:
        """Remove a request from waiting or running and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED

    def block_tables(self) -> list[list[int]]:
        """Every running request's tables (every group's with per-kind tables)."""
        if self.hybrid is not None:
            return self.hybrid.all_tables(self.running)
        return [r.block_table for r in self.running]
