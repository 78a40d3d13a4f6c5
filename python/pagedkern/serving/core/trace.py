"""`pagedkern-serve --trace`: the life of each request narrated on stderr, stage by stage, the
way the reference document follows R42: the rendered prompt, its token ids, every scheduler
iteration's composition, block tables as blocks are allocated, the top-5 next-token candidates
with their logits, the sampled token, why it finished and which blocks went back."""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from ...engine.block_pool import BlockPool
from ...engine.request import Request
from ...engine.scheduler import ScheduledBatch
from ...model import Tokenizer


def _show(text: str) -> str:
    return repr(text)[1:-1] if text else "∅"


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: token character -> the byte it stands for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_level_decoder()


def token_label(tokenizer: Tokenizer, token: int) -> str:
    """The token as text, or as its raw bytes when it holds part of a UTF-8 character."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return _show(text)
    piece = tokenizer.id_to_token(token) or ""
    if piece and all(c in _BYTES for c in piece):
        return "⟨" + " ".join(f"{_BYTES[c]:02x}" for c in piece) + "⟩"
    return f"⟨id {token}⟩"


def _ids(ids: list[int], limit: int = 24) -> str:
    head = ", ".join(map(str, ids[:limit]))
    return f"[{head}{', …' if len(ids) > limit else ''}] ({len(ids)} ids)"


class TraceWriter:
    def __init__(self, tokenizer: Tokenizer, out: TextIO | None = None, top: int = 5):
        self.tokenizer = tokenizer
        self.out = out  # None: sys.stderr as it is at each write (redirections, capsys see it)
        self.top = top
        self._tables: dict[str, list[int]] = {}

    def _say(self, line: str = "") -> None:
        print(line, file=self.out or sys.stderr, flush=True)

    def request_added(self, request: Request) -> None:
        p = request.params
        self._say(
            f"── {request.request_id} arrives ─ max_tokens={p.max_tokens} "
            f"temperature={p.temperature} top_p={p.top_p} top_k={p.top_k} "
            f"seed={request.seed}"
        )
        if request.prompt_text is not None:
            label = "chat template →" if request.messages else "prompt →"
            self._say(f"   {label}")
            for line in request.prompt_text.split("\n"):
                self._say(f"   │ {line}")
        self._say(f"   tokenizer → {_ids(request.prompt_ids)}")
        self._say(f"   status: waiting (prompt_len = {len(request.prompt_ids)})")

    def iteration(self, number: int, batch: ScheduledBatch, pool: BlockPool) -> None:
        parts = []
        for request, n in batch.entries:
            start = request.num_computed_tokens
            if n == 1 and start == request.num_tokens - 1:
                parts.append(f"{request.request_id} decode 1 (pos {start})")
            elif start == request.num_tokens - 1:  # the last token and n - 1 proposals
                parts.append(f"{request.request_id} verify 1+{n - 1} (pos {start}–{start + n - 1})")
            else:
                parts.append(f"{request.request_id} prefill {n} (pos {start}–{start + n - 1})")
        self._say(f"── iteration #{number}: {batch.num_tokens} tokens │ " + " │ ".join(parts))
        for victim in batch.preempted:
            self._say(f"   {victim.request_id} preempted: blocks freed, will recompute")
            self._tables.pop(victim.request_id, None)
        for request, _ in batch.entries:
            old = self._tables.get(request.request_id, [])
            if request.block_table != old:
                new = request.block_table[len(old) :]
                hit = (
                    f", {request.num_cached_tokens} tokens from the prefix cache"
                    if (not old and request.num_cached_tokens)
                    else ""
                )
                self._say(
                    f"   {request.request_id} block table {request.block_table} "
                    f"(+{new}{hit}) │ pool {pool.num_used}/{pool.num_blocks} in use"
                )
                self._tables[request.request_id] = list(request.block_table)

    def candidates(
        self, request: Request, logits: torch.Tensor, token: int, tokenizer: Tokenizer
    ) -> None:
        values, ids = logits.float().topk(min(self.top, logits.shape[-1]))
        shown = " │ ".join(
            f"{token_label(tokenizer, i)} {v:.2f}"
            for v, i in zip(values.tolist(), ids.tolist(), strict=True)
        )
        self._say(f"   {request.request_id} logits top-{self.top}: {shown}")
        self._say(f"   {request.request_id} sampled {token_label(tokenizer, token)} (id {token})")

    def speculated(
        self,
        request: Request,
        proposed: tuple[int, ...],
        accepted: tuple[int, ...],
        slots_rewound: int,
        blocks_freed: int,
    ) -> None:
        shown = " ".join(token_label(self.tokenizer, t) for t in proposed)
        self._say(
            f"   {request.request_id} proposed {list(proposed)} ({shown}) │ accepted "
            f"{len(accepted)}/{len(proposed)} │ KV slots rewound {slots_rewound}, "
            f"blocks freed {blocks_freed}"
        )
        if blocks_freed:
            self._tables[request.request_id] = list(request.block_table)

    def token(self, request: Request, token: int, text: str) -> None:
        if text:
            self._say(f"   {request.request_id} streams {_show(text)}")

    def finished(self, request: Request, text: str, freed: list[int], pool: BlockPool) -> None:
        if text:
            self._say(f"   {request.request_id} streams {_show(text)}")
        reason = request.finish_reason.value if request.finish_reason else "?"
        if request.output_ids and request.output_ids[-1] in self.tokenizer.stop_token_ids:
            last = self.tokenizer.decode([request.output_ids[-1]])
            reason += f" ({last})"
        m = request.metrics()
        ttft = f", ttft {m['ttft'] * 1e3:.0f} ms" if m["ttft"] is not None else ""
        self._say(
            f"── {request.request_id} finished: {reason}, {len(request.output_ids)} tokens"
            f"{ttft}; blocks freed {freed} │ pool {pool.num_used}/{pool.num_blocks} in use"
        )
        if request.error:
            self._say(f"   error: {request.error}")
        self._tables.pop(request.request_id, None)
