"""A mixture-of-experts model through the HTTP server with the official openai client: a tiny
Qwen3-MoE folder saved by transformers (QK-norm, one dense layer, top-3 of 6 experts), served, its
greedy completions (whole and streamed, n = 2 in one request) equal to the offline engine's on the
same folder (text and token count), and its chat endpoint answering through the folder's template.
One server for the module."""

from __future__ import annotations

import pytest
from http_stack import openai
from support.serving import ServerThread
from test_model_moe import ARCHITECTURES, _save

from pagedkern.engine import Engine, EngineConfig, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 77, 301, 12, 250, 9, 33, 120, 7], [300, 2, 41, 199, 64]]
MAX_TOKENS = 12


def _engine(folder) -> Engine:
    config = EngineConfig(
        model=str(folder), backend="reference", device="cpu", num_blocks=256, block_size=4,
        max_num_seqs=8, max_num_batched_tokens=64,
    )  # fmt: skip
    return Engine.from_config(config)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe_http")
    make_config, model_class = ARCHITECTURES["qwen3_moe"]
    _save(folder, make_config, model_class)
    return folder


@pytest.fixture(scope="module")
def offline(folder) -> list[tuple[str, int]]:
    """The engine alone (no server): each prompt's greedy text and token count."""
    engine = _engine(folder)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    answers = []
    for prompt in PROMPTS:
        outs = list(engine.stream(params=params, prompt_ids=prompt))
        answers.append(("".join(o.text for o in outs), sum(len(o.token_ids) for o in outs)))
    assert len({text for text, _ in answers}) == len(PROMPTS)  # the prompts matter
    return answers


@pytest.fixture(scope="module")
def server(folder):
    with ServerThread(_engine(folder)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


def _complete(client, server, prompt, **kwargs):
    return client.completions.create(
        model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True}, **kwargs,
    )  # fmt: skip


def test_greedy_completions_equal_the_offline_engine(client, server, offline):
    for prompt, (text, count) in zip(PROMPTS, offline, strict=True):
        answer = _complete(client, server, prompt)
        assert answer.choices[0].text == text
        assert answer.usage.completion_tokens == count == MAX_TOKENS


def test_a_stream_and_n_2_equal_the_offline_engine(client, server, offline):
    texts: dict[int, str] = {}
    for chunk in _complete(client, server, PROMPTS[0], n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: offline[0][0], 1: offline[0][0]}  # greedy: both samples alike


def test_chat_answers_through_the_template(client, server):
    answer = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Which expert answers?"}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == MAX_TOKENS
    assert isinstance(choice.message.content, str)
