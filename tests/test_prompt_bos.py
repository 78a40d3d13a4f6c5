"""BOS on raw prompts: where the tokenizer's config adds one (a Llama 3-style post-processor),
raw text gets exactly one BOS through the engine and the HTTP prompt path, and a chat prompt,
whose template writes its own, never gets a second one."""

from __future__ import annotations

import pytest
from hf_model_files import base_config, write_folder
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.serving.http.prompts import PromptPreparer

BOS = "<|begin_of_text|>"
TEXT = "the capital of France is Paris"
MESSAGES = [{"role": "user", "content": "the capital of France"}]


def _folder(tmp_path, adds_bos: bool):
    write_folder(tmp_path, base_config())
    if adds_bos:  # what Llama 3's tokenizer.json says: BOS before every raw text
        backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
        bos_id = backend.token_to_id(BOS)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
        backend.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def _engine(folder) -> Engine:
    config = EngineConfig(model=str(folder), backend="reference", num_blocks=64, block_size=4)
    return Engine.from_config(config)


@pytest.mark.parametrize("adds_bos", [True, False])
def test_raw_prompts_get_bos_when_the_tokenizer_asks_and_chat_never_twice(tmp_path, adds_bos):
    engine = _engine(_folder(tmp_path, adds_bos))
    tok = engine.tokenizer
    bos = tok.token_to_id(BOS)
    plain = tok.encode(TEXT)  # the text's own ids, no special tokens
    assert bos not in plain
    expected_raw = [bos, *plain] if adds_bos else plain
    params = SamplingParams(max_tokens=1)
    raw = engine.add_request(prompt=TEXT, params=params)
    chat = engine.add_request(messages=MESSAGES, params=params)
    raw_ids = list(raw.prompt_ids)
    chat_ids = list(chat.prompt_ids)
    assert raw_ids == expected_raw
    # the template writes BOS once; the raw-text post-processor must not add another
    assert chat_ids[0] == bos and chat_ids.count(bos) == 1
    assert chat_ids == tok.encode(tok.apply_chat_template(MESSAGES))
    # the HTTP server's prompt path (/v1/completions, /v1/chat/completions) agrees
    prepare = PromptPreparer(tok, max_model_len=256, vocab_size=engine.vocab_size)
    assert prepare({"prompt": TEXT})["prompt_ids"] == expected_raw
    assert prepare({"messages": MESSAGES})["prompt_ids"] == chat_ids
    # token ids are taken as given: no BOS added to them
    assert prepare({"prompt_ids": plain})["prompt_ids"] == plain
    while engine.has_unfinished:
        engine.step()
