"""`--speculative ngram` end to end on the synthetic tiny model: the CLI (answer equal to the
plain run's, --stats line, --trace narrating proposals), LLM(...) and the HTTP server (same
completion as without speculation, /metrics counting proposals); bad flag combinations exit 2
with one line."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from support.serving import ServerThread

from pagedkern.engine import LLM, Engine, EngineConfig, SamplingParams
from pagedkern.serving.cli import main

TINY = "synthetic:tiny"
CLI = [sys.executable, "-m", "pagedkern.serving.cli", "--model", TINY, "--raw"]
PROMPT = "hello hello hello hello hello"
WAIT = 120  # safety net for each request (seconds); nothing waits on timing to pass


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "--max-tokens", "16", "--ignore-eos", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def drafted_tokens(metrics: str) -> int:
    """The proposed-token counter of a /metrics page."""
    name = "pagedkern_spec_decode_num_draft_tokens_total "
    return int(next(line for line in metrics.splitlines() if line.startswith(name)).split()[1])


@pytest.fixture(scope="module")
def plain_answer() -> str:
    """The CLI's greedy answer without speculation (one process for the module)."""
    plain = cli(PROMPT)
    assert plain.returncode == 0 and plain.stdout.strip(), plain.stderr[-2000:]
    return plain.stdout


def test_cli_speculative_answer_stats_and_trace(plain_answer):
    spec = cli("--speculative", "ngram", "--ngram-min", "1", "--stats", "--trace", PROMPT)
    assert spec.returncode == 0, spec.stderr[-2000:]
    assert spec.stdout == plain_answer
    assert "speculative ngram:" in spec.stderr and "accepted per step" in spec.stderr
    assert " proposed [" in spec.stderr and "KV slots rewound" in spec.stderr
    assert " verify 1+" in spec.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--speculative", "draft"),  # no --draft-model
        ("--speculative", "guess"),
        ("--speculative", "ngram", "--ngram-min", "5", "--ngram-max", "2"),
        ("--num-speculative-tokens", "0"),
    ],
)
def test_cli_refuses_bad_speculative_flags(args, capsys):
    # main() in this process (test_cli_errors runs a bad flag through a real one): SystemExit(2)
    # and one line; any other exception would be a traceback
    with pytest.raises(SystemExit) as exit_info:
        main([*CLI[3:], "--max-tokens", "16", *args, PROMPT])
    assert exit_info.value.code == 2, args
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err, err


def test_llm_speculative_matches_plain():
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, [9, 10] * 9, list(range(3, 40))]
    config = dict(backend="reference", num_blocks=256, block_size=4)
    plain = LLM(TINY, **config).generate(prompts, params, use_tqdm=False)
    llm = LLM(TINY, speculative="ngram", ngram_min=1, num_speculative_tokens=3, **config)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    stats = llm.engine.stats()
    assert stats.speculative == "ngram" and stats.num_spec_accepted > 0
    assert 0 < stats.spec_acceptance_rate <= 1 and stats.spec_mean_accepted_length > 0


def test_http_completion_and_metrics_with_speculation():
    body = {
        "model": TINY,
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    texts = []
    for speculative in ("none", "ngram"):
        engine = Engine.from_config(
            EngineConfig(
                model=TINY,
                backend="reference",
                num_blocks=256,
                block_size=4,
                speculative=speculative,
                ngram_min=1,
            )
        )
        with ServerThread(engine) as server:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            metrics = httpx.get(server.url + "/metrics", timeout=WAIT).text
        assert (drafted_tokens(metrics) > 0) == (speculative == "ngram")
        assert "pagedkern_spec_decode_acceptance_rate " in metrics
    assert texts[0] == texts[1] and texts[0]


def test_cli_and_http_with_a_self_draft(plain_answer):
    # The draft proposer through the same surfaces: the CLI's answer and the HTTP completion
    # equal the plain ones (greedy), and /metrics counts the draft's proposals.
    spec = cli("--speculative", "draft", "--draft-model", "self:1", "--stats", "--trace", PROMPT)
    assert spec.returncode == 0, spec.stderr[-2000:]
    assert spec.stdout == plain_answer
    assert "speculative draft:" in spec.stderr and " proposed [" in spec.stderr
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    body["ignore_eos"] = True
    config = dict(model=TINY, backend="reference", num_blocks=256, block_size=4)
    texts, drafted = [], []
    for extra in ({}, {"speculative": "draft", "draft_model": "self:1"}):
        with ServerThread(Engine.from_config(EngineConfig(**config, **extra))) as server:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            metrics = httpx.get(server.url + "/metrics", timeout=WAIT).text
        drafted.append(drafted_tokens(metrics))
    assert texts[0] == texts[1] and texts[0]
    assert drafted[0] == 0 < drafted[1]
