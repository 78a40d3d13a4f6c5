"""The architectures beyond Llama/Qwen2 as a user serves them: tiny random models saved by
transformers (Qwen3: QK-norm; Gemma 2: soft-caps, alternating windows; Gemma 3: 2:1 local/global
with its own RoPE per kind; Qwen3-MoE: one dense layer, top-3 of 6 experts; gpt-oss: sinks,
biases, clamped SwiGLU, YaRN), each through `LLM`, the CLI and the HTTP server with the official
openai client. The server's greedy completions (whole, and streamed with n = 2) equal `LLM`'s text
and token count on the same folder, the CLI prints `LLM`'s text, and chat answers through the
folder's template. (Each family's logits against transformers: tests/test_model_*.py.)"""

from __future__ import annotations

import pytest
import torch
from http_stack import openai
from support.serving import ServerThread

from pagedkern.engine import LLM, Engine, EngineConfig, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 77, 301, 12, 250, 9, 33, 120, 7, 81, 14, 260], [300, 2, 41, 199, 64]]
MAX_TOKENS = 10
SETTINGS = dict(backend="reference", device="cpu", num_blocks=256, block_size=4)


def _save(folder, family: str) -> None:
    import test_model_gemma
    import test_model_moe
    import test_model_transformers
    from hf_model_files import write_tokenizer

    if family == "gpt_oss":
        from test_model_gpt_oss import save

        save(folder)
    elif family in test_model_moe.ARCHITECTURES:
        test_model_moe._save(folder, *test_model_moe.ARCHITECTURES[family])
    else:
        if family in test_model_gemma.ARCHITECTURES:
            model = test_model_gemma._hf_model(family)
        else:
            make_config, model_class = test_model_transformers.ARCHITECTURES[family]
            torch.manual_seed(0)
            model = model_class(make_config()).float().eval()
        model.save_pretrained(folder, safe_serialization=True)
        write_tokenizer(folder)


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "gemma3", "qwen3_moe", "gpt_oss"])
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    _save(folder, request.param)
    return folder


@pytest.fixture(scope="module")
def offline(folder) -> list[tuple[str, int]]:
    """`LLM` on the folder: each prompt's greedy text and token count."""
    llm = LLM(str(folder), **SETTINGS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    answers = [(g.text, len(g.token_ids)) for g in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert len({text for text, _ in answers}) == len(PROMPTS)  # the prompts matter
    return answers


@pytest.fixture(scope="module")
def server(folder):
    engine = Engine.from_config(EngineConfig(model=str(folder), max_num_seqs=8, **SETTINGS))
    with ServerThread(engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


def _complete(client, server, prompt, **kwargs):
    return client.completions.create(
        model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True}, **kwargs,
    )  # fmt: skip


def test_greedy_completions_equal_llm(client, server, offline):
    for prompt, (text, count) in zip(PROMPTS, offline, strict=True):
        answer = _complete(client, server, prompt)
        assert answer.choices[0].text == text
        assert answer.usage.completion_tokens == count == MAX_TOKENS


def test_a_stream_and_n_2_equal_llm(client, server, offline):
    texts: dict[int, str] = {}
    for chunk in _complete(client, server, PROMPTS[0], n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: offline[0][0], 1: offline[0][0]}  # greedy: both samples alike


def test_chat_answers_through_the_template(client, server):
    answer = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Which layer answers?"}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == MAX_TOKENS
    assert isinstance(choice.message.content, str)


def test_the_cli_prints_what_llm_answers(folder, capsys):
    from pagedkern.serving.cli import main

    llm = LLM(str(folder), **SETTINGS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    (out,) = llm.generate("the capital of France is", params, use_tqdm=False)
    args = ["--model", str(folder), "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
            "--backend", "reference", "--raw"]  # fmt: skip
    assert main([*args, "the capital of France is"]) in (0, None)
    assert capsys.readouterr().out.strip() == out.text.strip()
