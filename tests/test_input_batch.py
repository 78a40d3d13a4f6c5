"""The persistent decode batch (engine/input_batch.py) against a fresh build: after random
sequences of membership changes (requests added, finished, preempted and readmitted, forked,
reordered; blocks appended, a table rolled back and regrown to the same length), a steady
decode step's layout and sampling inputs from the persistent batch equal, array for array,
what the runner's general path builds from per-request chunks (model.layout_batch), with and
without placeholder rows (asynchronous scheduling); steps that are not steady decodes take the
general path. Engine outputs are token-for-token those of the general path alone (greedy,
seeded, logprobs, penalties, n > 1, preemption, chunked prefill, the CUDA-graph path's static
buffers run eagerly, overlap on and off)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_async_scheduling import assert_same, make_engine, run_checked, varied_prompts

from pagedkern.engine import SamplingParams
from pagedkern.engine.logits_processing import LogitsState
from pagedkern.engine.request import Request, RequestStatus
from pagedkern.engine.runner import ModelRunner, PreparedStep

VOCAB = 512
LAYOUT_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "cu_seqlens",
    "block_tables",
    "seq_lens",
    "logits_indices",
)


@pytest.fixture(scope="module", params=[4, 3], ids=["block 4", "block 3"])
def runner(request) -> ModelRunner:
    """A power-of-two block size (the shift path) and another (divmod)."""
    engine = make_engine(False, block_size=request.param)
    yield engine.runner
    engine.close()


class Simulation:
    """Running requests as the scheduler leaves them between decode steps, changed at random."""

    def __init__(self, rng: random.Random, block_size: int):
        self.rng = rng
        self.block_size = block_size
        self.free = list(range(1, 100_000))
        rng.shuffle(self.free)
        self.running: list[Request] = []
        self.count = 0

    def blocks(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def cover(self, r: Request, spare: int = 0) -> None:
        """Grow r's table to hold its next token's slot (and `spare` more blocks)."""
        need = r.num_computed_tokens // self.block_size + 1 + spare - len(r.block_table)
        if need > 0:
            r.block_table.extend(self.blocks(need))

    def new_request(self) -> Request:
        rng = self.rng
        self.count += 1
        kind = rng.random()
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([0, 5]),
            logprobs=2 if kind < 0.05 else None,
            presence_penalty=0.5 if 0.05 <= kind < 0.1 else 0.0,
        )
        prompt = [rng.randrange(5, VOCAB) for _ in range(rng.randint(1, 30))]
        r = Request(f"S{self.count}", prompt, params, seed=rng.randrange(-(2**63), 2**63))
        r.logits_state = LogitsState(params, prompt, (), VOCAB)
        r.status = RequestStatus.RUNNING
        self.admit(r)
        return r

    def admit(self, r: Request) -> None:
        """As a finished prefill leaves it: every token but the last computed (the last one
        is the prompt's when nothing was generated yet, as after a full prefix-cache hit)."""
        if self.rng.random() < 0.7:
            r.output_ids.append(self.rng.randrange(5, VOCAB))
        r.block_table.clear()  # in place: the same list object, other blocks
        r.num_computed_tokens = r.num_tokens - 1
        self.cover(r, spare=self.rng.choice([0, 0, 1, 2]))

    def decode(self) -> None:
        """What a step does to every running request: one token computed, one appended."""
        for r in self.running:
            r.num_computed_tokens += 1
            r.output_ids.append(self.rng.randrange(5, VOCAB))
            self.cover(r)

    def change(self) -> None:
        rng, running = self.rng, self.running
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            op = rng.choice(["add", "finish", "preempt", "append", "regrow", "fork", "reorder"])
            if op == "add" or not running:
                running.insert(rng.randint(0, len(running)), self.new_request())
            elif op == "finish":
                running.pop(rng.randrange(len(running)))
            elif op == "preempt":  # table released, the tokens recomputed, readmitted later
                r = running.pop(rng.randrange(len(running)))
                r.block_table.clear()
                self.admit(r)
                running.insert(rng.randint(0, len(running)), r)
            elif op == "append":
                rng.choice(running).block_table.extend(self.blocks(1))
            elif op == "regrow":  # lookahead slots given back, then taken again: same length
                r = rng.choice(running)
                keep = r.num_computed_tokens // self.block_size + 1
                n = len(r.block_table)
                del r.block_table[keep:]
                r.block_table.extend(self.blocks(n - keep + 1))
                del r.block_table[n:]
            elif op == "fork":  # n > 1: the sample shares the leader's full blocks
                leader = rng.choice(running)
                sample = Request(
                    f"{leader.request_id}.f{self.count}",
                    leader.prompt_ids,
                    leader.params,
                    output_ids=list(leader.output_ids),
                    seed=leader.seed + 1,
                )
                sample.logits_state = leader.logits_state
                full = leader.num_computed_tokens // self.block_size
                sample.block_table = leader.block_table[:full] + self.blocks(1)
                sample.num_computed_tokens = leader.num_computed_tokens
                self.count += 1
                running.append(sample)
            else:
                rng.shuffle(running)


def assert_same_layout(fast: PreparedStep, general: PreparedStep) -> None:
    a, b = fast.layout, general.layout
    for name in LAYOUT_FIELDS:
        got, want = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    assert (a.width, a.num_prefills, a.max_query_len) == (b.width, b.num_prefills, b.max_query_len)
    assert np.array_equal(a.pack().numpy(), b.pack().numpy())
    assert list(fast.rows) == general.rows and fast.num_sampled == general.num_sampled
    assert fast.sample_requests()[0] == general.sample_requests()[0]
    assert list(fast.sample_requests()[1]) == list(general.sample_requests()[1])
    assert fast.fill_rows == general.fill_rows and fast.fill_from == general.fill_from


def assert_same_sampling(runner: ModelRunner, fast: PreparedStep, requests: list) -> None:
    """The fast path's sampling inputs, where it builds them, equal sampling_inputs'."""
    want = runner.sampling_inputs(requests)
    if fast.sampling is None:  # a row with host-side processing: sampled the general way
        assert want.processing.arrays or want.processing.want_logprobs
        return
    assert not fast.sampling.processing.arrays and not fast.sampling.processing.want_logprobs
    assert not want.processing.arrays and not want.processing.want_logprobs
    for got, expected in zip(fast.sampling.fields, want.fields, strict=True):
        assert got.dtype == expected.dtype and np.array_equal(got, expected)


@pytest.mark.parametrize("seed", range(6))
def test_persistent_batch_equals_a_fresh_build(runner, seed):
    rng = random.Random(seed)
    sim = Simulation(rng, runner.kv_cache.block_size)
    runner.batch.__init__(runner.kv_cache.block_size)  # a fresh persistent batch per case
    sim.running = [sim.new_request() for _ in range(rng.randint(1, 12))]
    for _ in range(120):
        sim.change()
        entries = [(r, 1) for r in sim.running]
        fast = runner.prepare(entries)
        assert fast.sampled is not None, "a steady decode step took the general path"
        general = runner.prepare_chunks(entries)
        assert_same_layout(fast, general)
        assert_same_sampling(runner, fast, [r for r, _ in entries])
        sim.decode()
    assert sim.count > 12, "the membership never changed"


@pytest.mark.parametrize("seed", range(4))
def test_placeholder_rows_equal_a_fresh_build(runner, seed):
    """Asynchronous scheduling: rows whose token the step in flight samples are placeholders
    filled from its ids; the rest read their last token."""
    rng = random.Random(100 + seed)
    sim = Simulation(rng, runner.kv_cache.block_size)
    runner.batch.__init__(runner.kv_cache.block_size)
    sim.running = [sim.new_request() for _ in range(rng.randint(1, 12))]
    every = 0
    for _ in range(60):
        sim.change()
        entries = [(r, 1) for r in sim.running]
        share = rng.choice([0.7, 1.0])  # 1.0: as a rule every row is in flight
        flight = [r for r in sim.running if r.output_ids and rng.random() < share]
        every += len(flight) == len(entries)
        pending = {r: j for j, r in enumerate(reversed(flight))}
        for r in flight:  # its token is sampled by the step in flight, not yet appended
            r.output_ids.pop()
            r.num_pending = 1
        fast = runner.prepare(entries, pending=pending)
        assert fast.sampled is not None
        general = runner.prepare_chunks(entries, pending=pending)
        assert_same_layout(fast, general)
        assert len(fast.fill_rows) == len(flight)
        if fast.sampling is not None:  # built ahead from the persistent batch
            for got, want in zip(fast.sampling.fields, general.sampling.fields, strict=True):
                assert np.array_equal(got, want)
        for r in flight:
            r.num_pending = 0
            r.output_ids.append(rng.randrange(5, VOCAB))
        sim.decode()
    assert every, "never a step with every row in flight"


def test_other_steps_take_the_general_path(runner):
    rng = random.Random(3)
    sim = Simulation(rng, runner.kv_cache.block_size)
    runner.batch.__init__(runner.kv_cache.block_size)
    a, b = sim.new_request(), sim.new_request()
    assert runner.prepare([(a, 1), (b, 1)]).sampled is not None
    # a prefill chunk in the step
    fresh = Request("P", [7] * 9, SamplingParams())
    fresh.block_table = sim.blocks(3)
    assert runner.prepare([(fresh, 9), (a, 1)]).sampled is None
    # a one-token chunk mid-prompt (chunked prefill): laid out, not sampled
    fresh.num_computed_tokens = 3
    step = runner.prepare([(a, 1), (fresh, 1)])
    assert step.sampled is None and step.num_sampled == 1
    # a block table too short for the token's slot: the general path's error
    short = sim.new_request()
    del short.block_table[short.num_computed_tokens // sim.block_size :]
    with pytest.raises(ValueError, match="block table"):
        runner.prepare([(a, 1), (short, 1)])
    # an empty sequence has no token to feed: the general path's error
    empty = Request("E", [], SamplingParams())
    empty.block_table = sim.blocks(1)
    with pytest.raises(ValueError, match="needs new tokens"):
        runner.prepare([(a, 1), (empty, 1)])
    # forks (n > 1) and proposals take the general path
    assert runner.prepare([(a, 1)], forks={a: [b]}).sampled is None


PARAMS = {
    "greedy": SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
    "mixed": None,  # a different processing per request
}


def mixed_params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.8, seed=i),
        dict(temperature=0),
        dict(temperature=1.0, top_k=20, seed=i, logprobs=2),
        dict(temperature=0.7, seed=i, presence_penalty=0.8, frequency_penalty=0.3),
        dict(temperature=0.9, seed=i, n=2),
        dict(temperature=0.6, top_p=0.8, min_p=0.05, seed=i),
    ]
    return SamplingParams(max_tokens=10 + i % 5, ignore_eos=True, **kinds[i % len(kinds)])


def generate(prompts, params, persistent: bool, overlap: bool, **overrides):
    engine = make_engine(overlap, **overrides)
    laid_out = []
    if persistent:
        decode_step = engine.runner.batch.decode_step

        def counted(entries, pending):
            step = decode_step(entries, pending)
            laid_out.append(step is not None)
            return step

        engine.runner.batch.decode_step = counted
    else:
        engine.runner.batch.decode_step = lambda entries, pending: None
    for i, ids in enumerate(prompts):
        p = params if params is not None else mixed_params(i)
        engine.add_request(prompt_ids=ids, params=p, request_id=f"Q{i}")
    results = run_checked(engine)
    engine.close()
    return results, sum(laid_out)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize(
    "scenario",
    [{}, {"num_blocks": 70}, {"max_num_batched_tokens": 16}, {"cuda_graphs": True}],
    ids=["roomy", "preemption", "chunked", "decode-graph buffers"],
)
def test_engine_outputs_equal_the_general_path(scenario, params, overlap):
    prompts = varied_prompts()
    want, _ = generate(prompts, PARAMS[params], False, overlap, **scenario)
    got, fast_steps = generate(prompts, PARAMS[params], True, overlap, **scenario)
    assert_same(got, want)
    assert fast_steps > 5, "the persistent batch laid out (almost) no step"
