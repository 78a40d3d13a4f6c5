"""n > 1 and many-prompt requests over a real loopback server: a fan-out cancelled before its
prompt runs ends alone (the server and the other streams live on), every sample holds a seat of
--max-num-seqs, and a request asking for more sequences than the server allows is a 400; text
bad_words are banned with and without a leading space."""

from __future__ import annotations

import json

import httpx
import pytest
from http_stack import openai  # noqa: F401 - skips this module without the HTTP stack
from support.serving import ServerThread
from test_http_server import LONG, TINY, WAIT, check_pool, kv_used, sse_data, tiny_engine, user

from pagedkern.serving.http.settings import ServerSettings


def _stream_body(**extra) -> dict:
    return {"model": TINY, "messages": user("go"), "stream": True, "ignore_eos": True, **extra}


def test_a_fan_out_cancelled_while_it_waits_ends_alone():
    seats: list[int] = []

    def after_step(engine):
        check_pool(engine)
        seats.append(len(engine.scheduler.running))

    with ServerThread(tiny_engine(max_num_seqs=1), after_step=after_step) as server:
        url = server.url + "/v1/chat/completions"
        loop = server.engine_loop
        with httpx.stream("POST", url, json=_stream_body(max_tokens=LONG), timeout=WAIT) as busy:
            tokens = sse_data(busy)
            next(tokens), next(tokens)  # role chunk, first token: it holds the only seat
            fan = _stream_body(max_tokens=5, n=3)
            with httpx.stream("POST", url, json=fan, timeout=WAIT) as waiting:
                assert waiting.status_code == 200
                assert loop.wait_for(lambda: loop.num_live == 2, WAIT)
            # the fan-out's connection is closed before it ever ran: only it is aborted
            assert loop.wait_for(lambda: loop.num_live == 1, WAIT)
            more = [json.loads(next(tokens)) for _ in range(5)]
            assert all(c["choices"][0]["finish_reason"] is None for c in more)
        assert loop.wait_for(lambda: loop.num_live == 0, WAIT)
        r = httpx.post(url, json={**_stream_body(max_tokens=3), "stream": False}, timeout=WAIT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert kv_used(server) == 0
        assert max(seats) == 1


def test_every_sample_holds_a_seat_and_the_request_size_is_bounded():
    seats: list[int] = []

    def after_step(engine):
        check_pool(engine)
        seats.append(len(engine.scheduler.running))

    settings = ServerSettings(max_seqs_per_request=12)
    engine = tiny_engine(max_num_seqs=4)
    with ServerThread(engine, settings=settings, after_step=after_step) as server:
        url = server.url + "/v1/completions"
        body = {"model": TINY, "prompt": ["a", "b", "c"], "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(url, json={**body, "n": 4}, timeout=WAIT)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 12
        r = httpx.post(url, json={**body, "n": 5}, timeout=WAIT)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "n" and "3 x 5" not in error["message"]
        assert "5 x 3" in error["message"] and "12" in error["message"]
        chat = {"model": TINY, "messages": user("x"), "max_tokens": 2, "n": 13}
        assert httpx.post(server.url + "/v1/chat/completions", json=chat).status_code == 400
        assert kv_used(server) == 0
    assert max(seats) == 4, "12 samples, 4 seats"


@pytest.fixture(scope="module")
def server():
    with ServerThread(tiny_engine()) as s:
        yield s


@pytest.mark.parametrize("word", ["a", " a"])
def test_a_text_bad_word_is_banned_with_and_without_a_leading_space(server, word):
    tokenizer = server.engine_loop.tokenizer
    (spaced,) = tokenizer.encode(" a")  # one token: the word after a space
    body = {
        "model": TINY,
        "prompt": "x",
        "max_tokens": 4,
        "temperature": 0,
        "logit_bias": {str(spaced): 100},
        "logprobs": 1,
    }
    url = server.url + "/v1/completions"
    plain = httpx.post(url, json=body, timeout=WAIT).json()
    assert plain["choices"][0]["logprobs"]["tokens"] == [" a"] * 4  # the bias alone wins
    banned = httpx.post(url, json={**body, "bad_words": [word]}, timeout=WAIT).json()
    tokens = banned["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 4 and " a" not in tokens and "a" not in tokens
    assert kv_used(server) == 0
