"""The engine's one append / stop-check path (OutputProcessor.append) against a per-token
statement of the stop rules, on random batches: runs of one token (a sampled row) and of
several (a verified speculative run) for requests with random stop ids, max_tokens,
min_tokens, EOS or ignore_eos and stop strings, admitted by the engine and appended without a
model. Each run must keep exactly the tokens up to its first stop, end for the first rule that
holds (stop id, stop string, max_tokens, context) and carry the text a fresh detokenizer makes
of them."""

from __future__ import annotations

import random

import pytest

from pagedkern.engine import Engine, EngineConfig, FinishReason, SamplingParams
from pagedkern.engine.detokenizer import IncrementalDetokenizer
from pagedkern.engine.outputs import TokenDeltas
from pagedkern.engine.runner import StepResult

MAX_MODEL_LEN = 40


@pytest.fixture(scope="module")
def engine() -> Engine:
    config = EngineConfig(
        model="synthetic:tiny",
        backend="reference",
        num_blocks=64,
        block_size=4,
        max_model_len=MAX_MODEL_LEN,
    )
    return Engine.from_config(config)


def random_params(rng: random.Random, detokenize: bool, vocab: list[int]) -> SamplingParams:
    max_tokens = rng.randint(1, 30)
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=0 if max_tokens < 3 else rng.choice([0, 0, 3]),
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=rng.sample(vocab, rng.randint(0, 3)),
        stop=rng.choice([[], ["e"], ["ab", "x"]]) if detokenize else [],
        temperature=0,
    )


class Expected:
    """The stop rules, token by token, for one request (the spec the engine must meet)."""

    def __init__(self, engine: Engine, request, detokenize: bool):
        params = request.params
        eos = () if params.ignore_eos else engine.tokenizer.stop_token_ids
        self.stop_ids = set(params.stop_token_ids) | set(eos)
        self.params, self.prompt_len = params, len(request.prompt_ids)
        self.detokenizer = (
            IncrementalDetokenizer(engine.tokenizer, params.stop, params.min_tokens)
            if detokenize
            else None
        )
        self.ids: list[int] = []
        self.reason: FinishReason | None = None

    def run(self, tokens: list[int]) -> tuple[list[int], str, FinishReason | None]:
        kept, text = [], ""
        for token in tokens:
            self.ids.append(token)
            kept.append(token)
            if token in self.stop_ids:
                self.reason = FinishReason.STOP
            else:
                if self.detokenizer is not None:
                    text += self.detokenizer.add(token)
                if self.detokenizer is not None and self.detokenizer.stopped_by is not None:
                    self.reason = FinishReason.STOP
                elif len(self.ids) >= self.params.max_tokens:
                    self.reason = FinishReason.LENGTH
                elif self.prompt_len + len(self.ids) >= MAX_MODEL_LEN:
                    self.reason = FinishReason.CONTEXT
            if self.reason is not None:
                if self.detokenizer is not None:
                    text += self.detokenizer.flush()  # (may complete a stop string: STOP)
                    if self.detokenizer.stopped_by is not None:
                        self.reason = FinishReason.STOP
                break
        return kept, text, self.reason


@pytest.mark.parametrize("columns", [False, True], ids=["outputs", "token-delta columns"])
@pytest.mark.parametrize("seed", range(12))
def test_append_follows_the_stop_rules_token_by_token(engine, seed, columns):
    rng = random.Random(seed)
    detokenize = not columns  # the HTTP core: ids only, its tokens as columns
    engine.detokenize = detokenize
    engine.token_deltas = TokenDeltas() if columns else None
    vocab = list(range(3, 80)) + list(engine.tokenizer.stop_token_ids)
    expected = {}
    for i in range(12):
        prompt = [rng.randint(3, 400) for _ in range(rng.randint(1, 20))]
        request = engine.add_request(
            prompt_ids=prompt, params=random_params(rng, detokenize, vocab), request_id=f"s{i}"
        )
        expected[request] = Expected(engine, request, detokenize)

    def first(request) -> int:
        """A run's first token, as a sampler draws it: before min_tokens, no stop token
        (append fails a request whose sampled token its bans refused: NoTokenAllowed)."""
        if len(request.output_ids) < request.params.min_tokens:
            return rng.choice([t for t in vocab if t not in request.stop_ids])
        return rng.choice(vocab)

    try:
        for _ in range(40):
            live = [r for r in expected if r.request_id in engine.requests]
            if not live:
                break
            rng.shuffle(live)
            cut = rng.randint(0, len(live))
            plain, verified = live[:cut], live[cut:]
            runs = {r: [first(r)] for r in plain}
            runs |= {r: [first(r)] + [rng.choice(vocab) for _ in range(rng.randint(0, 4))]
                     for r in verified}  # fmt: skip
            result = StepResult(
                plain, [runs[r][0] for r in plain], None, verified=[(r, runs[r]) for r in verified]
            )
            outputs = []
            engine.output.append([result], outputs)
            got = {o.request_id: o for o in outputs}
            columns_taken = engine.token_deltas.take() if columns else ([], [])
            in_columns = dict(zip(*columns_taken, strict=True))
            for request, tokens in runs.items():
                kept, text, reason = expected[request].run(tokens)
                assert request.output_ids == expected[request].ids
                if request.request_id in in_columns:
                    assert reason is None and kept == tokens == [in_columns[request.request_id]]
                    continue
                out = got[request.request_id]
                assert list(out.token_ids) == kept and out.text == text
                assert out.finish_reason is reason and out.finished == (reason is not None)
        assert not engine.requests, "every request stops within 40 steps"
    finally:
        for rid in list(engine.requests):
            engine.abort(rid)


def test_a_fan_out_that_times_out_before_its_prompt_ran_ends_each_sample_once():
    """Its first sample's timeout ends the samples waiting to fork from it; the samples'
    own deadlines (the same) must not end them a second time."""
    config = EngineConfig(model="synthetic:tiny", backend="reference", num_blocks=64, block_size=4)
    engine = Engine.from_config(config)
    clock = [100.0]
    engine.clock = lambda: clock[0]
    params = SamplingParams(n=3, timeout=1.0, max_tokens=4)
    engine.add_request(prompt_ids=[5, 6, 7], params=params, request_id="f")
    clock[0] += 5.0
    outputs = engine.step() + engine.pop_undelivered()
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [
        (rid, FinishReason.TIMEOUT) for rid in ("f", "f.1", "f.2")
    ]
    assert not engine.requests and engine.pool.num_used == 0


@pytest.mark.parametrize("stop", [[], ["\ufffd"]])
def test_the_last_ids_text_is_flushed_as_decode_shows_it(engine, stop):
    """An output cut off by max_tokens inside a character ends with the text its decode shows
    (U+FFFD for the missing bytes), and a stop string that text completes ends it as STOP."""
    engine.detokenize, engine.token_deltas = True, None
    euro = engine.tokenizer.encode("a€")  # ("a", then the euro sign's three bytes)
    ids = list(euro[:2])
    assert engine.tokenizer.decode(ids) == "a\ufffd"
    request = engine.add_request(
        prompt_ids=[5, 6], params=SamplingParams(max_tokens=2, stop=stop, temperature=0)
    )
    outputs = []
    for token in ids:
        engine.output.append([StepResult([request], [token], None)], outputs)
    text = "".join(o.text for o in outputs if o.request_id == request.request_id)
    assert text == ("a" if stop else "a\ufffd")
    assert outputs[-1].finish_reason is (FinishReason.STOP if stop else FinishReason.LENGTH)
