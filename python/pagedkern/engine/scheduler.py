"""Continuous batching: each iteration picks which requests run and how many tokens each feeds,
under a token budget and a sequence limit, with chunked prefill and preemption by recompute.

Order: running requests first (decodes and unfinished prompt chunks), oldest first; then waiting
requests in arrival order (preempted ones at the front). A long prompt is cut into chunks that
share iterations with other requests' decodes; while a request waits with a seat free, a running
prompt's chunk takes at most half the token budget, so a short prompt is admitted at the next
step instead of after the long one's whole prefill. Every running sequence, each sample of an
n > 1 request too, holds one of max_num_seqs seats.

When a running request needs a block and none is free, one is preempted and later recomputes
its K/V (engine/preemption.py says who, and where it waits). The requests' block tables, the
prefix cache's hits and registrations and the windowed release are engine/block_tables.py's.

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

from collections import deque

from .block_pool import BlockPool
from .block_tables import BlockTables
from .preemption import preemption_victim, requeue_preempted
from .request import Request, RequestStatus
from .scheduled_batch import ScheduledBatch
from .scheduler_config import SchedulerConfig, released_kv_window

__all__ = [
    "RequestRejected",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "released_kv_window",
]


class RequestRejected(ValueError):
    """The request can never run here (longer than the context or the whole KV cache)."""


class Scheduler:
    def __init__(self, pool: BlockPool, config: SchedulerConfig):
        self.pool = pool
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.tables = BlockTables(
            pool,
            config.kv_window,
            config.group_windows,
            config.max_num_batched_tokens,
            config.copy_blocks,
        )
        self.hybrid = self.tables.hybrid  # per-kind tables, if any

    def add(self, request: Request) -> None:
        limit = self.config.max_model_len
        if request.num_tokens >= limit:
            raise RequestRejected(
                f"request {request.request_id}: {request.num_tokens} prompt tokens leave no room "
                f"in a context of {limit} tokens (the model's, or what the KV cache holds, or "
                "without chunked prefill the token budget of a step)"
            )
        needed = self.tables.blocks_needed(request.num_tokens + 1)
        if needed > self.pool.num_blocks:
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
        reserve = self.tables.reserve
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
            if k and reserve(request, 1 + k):  # short of blocks: a plain decode instead
                batch.lookahead[request] = k
                num_new = 1 + k
            elif computed + num_new > len(request.block_table) * slots_per_block:
                while not reserve(request, num_new):
                    victim = preemption_victim(running)
                    if running.index(victim) < i:  # scheduled already: take its entry back
                        i -= 1
                        budget += batch.take_back(victim)
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
                hits = self.tables.prefix_hits(request)
            except Exception as exc:  # noqa: BLE001 - isolated: the request fails alone
                self.waiting.popleft()
                self.tables.release(request)
                request.num_cached_tokens = 0
                batch.failed.append((request, exc))
                continue
            num_new = min(request.num_uncomputed, budget)
            chunk_not_allowed = (
                not self.config.enable_chunked_prefill and num_new < request.num_uncomputed
            )
            if chunk_not_allowed or not reserve(request, num_new):
                self.tables.drop_prefix_hits(request, hits)
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

    def _preempt(self, request: Request) -> None:
        """Back to waiting, its blocks freed (engine/preemption.py says where it waits)."""
        self.running.remove(request)
        self.tables.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        requeue_preempted(self.waiting, request)

    def on_step_done(self, batch: ScheduledBatch) -> None:
        """Account the tokens just computed (and cache newly full blocks). A request whose own
        accounting fails is appended to batch.failed and left for the engine to finish. Who
        samples is the runner's to say (StepResult); `ready` says it without one."""
        bs = self.pool.block_size
        caching = self.pool.enable_prefix_caching
        tables = self.tables
        verified = batch.accepted
        for request, num_new in batch.entries:
            accepted = verified.get(request) if verified else None
            if accepted is not None:  # verified: the last token and the accepted proposals
                num_new = 1 + len(accepted)
            before = request.num_computed_tokens
            after = request.num_computed_tokens = before + num_new
            if caching and after // bs > before // bs:  # blocks that just filled become findable
                try:
                    tables.register_full_blocks(request, before // bs, after // bs, accepted)
                except Exception as exc:  # noqa: BLE001 - isolated: the request fails alone
                    batch.failed.append((request, exc))
                    continue
            if accepted is not None:
                tables.roll_back(request, after + 1)
            tables.release_outside_window(request, after)

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
            self.tables.register_full_blocks(request, before // bs, after // bs)
        self.tables.release_outside_window(request, after)

    def release_outside_window(self, request: Request, computed: int) -> None:
        """Windowed models: free the blocks no query from position `computed` on can see
        (BlockTables.release_outside_window)."""
        self.tables.release_outside_window(request, computed)

    def fork(self, leader: Request, sample: Request) -> tuple[int, int] | None:
        """n > 1: `sample` starts running from `leader`'s computed prompt: the full prompt blocks
        shared (one more reference each), the partial last block, if any, a fresh block whose
        K/V the caller copies: (source, destination) is returned. Without a free block or a
        free seat (every running sample counts against max_num_seqs), or a partial block that
        may not be copied (SchedulerConfig.copy_blocks), the sample waits and recomputes its
        prompt (prefix-cache hits make that cheap)."""
        copies = None
        if len(self.running) < self.config.max_num_seqs:
            copies = self.tables.share_prompt(leader, sample)
        if copies is None:
            self.add(sample)
            return None
        sample.status = RequestStatus.RUNNING
        self.running.append(sample)
        return copies[0] if copies else None

    def finish(self, request: Request) -> None:
        """Remove a request from waiting or running and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.tables.release(request)
        request.status = RequestStatus.FINISHED

    def block_tables(self) -> list[list[int]]:
        """Every running request's tables (every group's with per-kind tables)."""
        return self.tables.all_tables(self.running)
