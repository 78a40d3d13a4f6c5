"""32 simultaneous streams through one server (chat and completions, more than the batch holds,
a KV pool small enough that running requests get preempted), 8 cancelled midway by their clients:
every other stream is complete and equal to the same request run alone on a fresh engine, the
cancelled ones are aborted, the pool's invariants hold after every step (checked in the engine
thread) and no KV block is left in use at the end (/metrics and the pool agree)."""

from __future__ import annotations

import asyncio
import re

import httpx
from http_stack import openai
from support.serving import ServerThread

from pagedkern.engine import Engine, EngineConfig, SamplingParams

TINY = "synthetic:tiny"
N = 32
WAIT = 120  # safety net only
LONG = 1800  # cancelled streams ask for this many tokens: they must not end on their own


def engine(**overrides) -> Engine:
    config = dict(model=TINY, backend="reference", device="cpu", block_size=4)
    config.update(overrides)
    return Engine.from_config(EngineConfig(**config))


def check_pool(e: Engine) -> None:
    e.pool.check_invariants(e.scheduler.block_tables())


def spec(i: int) -> dict:
    """Request i: chat (even) or completion (odd), its own prompt and length; every 4th is
    cancelled by its client (the last one right after its first event)."""
    text = f"Request {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4]) * (
        1 + i % 3
    )
    cancel_after = (1 if i == N - 1 else 3) if i % 4 == 3 else None
    return {
        "chat": i % 2 == 0,
        "text": text,
        "max_tokens": LONG if cancel_after else 4 + (i * 5) % 17,
        "cancel_after": cancel_after,
        "include_usage": i % 3 == 0,
    }


def solo(e: Engine, s: dict) -> tuple[str, int]:
    """Request s alone in engine e."""
    params = SamplingParams(max_tokens=s["max_tokens"], temperature=0, ignore_eos=True)
    request = (
        {"messages": [{"role": "user", "content": s["text"]}]}
        if s["chat"]
        else {"prompt": s["text"]}
    )
    outs = list(e.stream(params=params, **request))
    return "".join(o.text for o in outs), sum(len(o.token_ids) for o in outs)


async def one_stream(client: openai.AsyncOpenAI, s: dict) -> dict:
    common = dict(
        model=TINY,
        max_tokens=s["max_tokens"],
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    if s["include_usage"]:
        common["stream_options"] = {"include_usage": True}
    if s["chat"]:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": s["text"]}], **common
        )
    else:
        stream = await client.completions.create(prompt=s["text"], **common)
    pieces, reasons, usage, events = [], [], None, 0
    async for chunk in stream:
        events += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append((choice.delta.content if s["chat"] else choice.text) or "")
            reasons.append(choice.finish_reason)
        if s["cancel_after"] and events == s["cancel_after"]:
            await stream.close()  # the client leaves mid-stream: the connection closes
            return {"cancelled": True}
    return {"text": "".join(pieces), "reasons": reasons, "usage": usage}


async def run_all(url: str) -> list[dict]:
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT
    ) as client:
        return await asyncio.gather(*(one_stream(client, spec(i)) for i in range(N)))


def test_32_streams_with_cancellations_match_solo_runs_and_leak_nothing():
    specs = [spec(i) for i in range(N)]
    alone = engine(num_blocks=1024)
    expected = {i: solo(alone, s) for i, s in enumerate(specs) if not s["cancel_after"]}
    server_engine = engine(num_blocks=40, max_num_seqs=8, max_num_batched_tokens=64)
    with ServerThread(server_engine, max_queue=N, after_step=check_pool) as server:
        results = asyncio.run(run_all(server.url))
        loop = server.engine_loop
        cancelled = sum(1 for s in specs if s["cancel_after"])
        aborted = lambda: loop.metrics.finished.get("abort", 0) == cancelled  # noqa: E731
        assert loop.wait_for(lambda: aborted() and loop.num_live == 0, WAIT)

        for i, (s, result) in enumerate(zip(specs, results, strict=True)):
            if s["cancel_after"]:
                assert result == {"cancelled": True}
                continue
            text, tokens = expected[i]
            assert result["text"] == text, f"request {i}"
            assert result["reasons"][-1] == "length" and not any(result["reasons"][:-1])
            if s["include_usage"]:
                assert result["usage"].completion_tokens == tokens

        metrics = httpx.get(server.url + "/metrics", timeout=WAIT).text
        gauge = lambda name: int(re.search(rf"^pagedkern_{name} (\d+)$", metrics, re.M).group(1))  # noqa: E731
        assert gauge("kv_blocks_used") == 0
        assert gauge("num_requests_running") == gauge("num_requests_waiting") == 0
        assert loop.metrics.finished.get("length", 0) == N - cancelled

        def final_check(e: Engine) -> int:
            check_pool(e)
            assert not e.has_unfinished
            return e.pool.num_used

        assert loop.run_in_engine(final_check).result(WAIT) == 0
