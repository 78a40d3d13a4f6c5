"""SentencePiece GGUF tokenizers (tokenizer.ggml.model 'llama': Llama 2, Mistral 7B, Mixtral,
Gemma files as llama.cpp's converter writes them): pieces with scores, byte pieces <0xXX>,
control tokens. pagedkern's tokenizer must split text as llama.cpp's SentencePiece tokenizer
does, checked against a plain Python copy of that algorithm written here (merge, at each step,
the adjacent pair whose concatenation is the highest-scoring piece; a symbol outside the
vocabulary as its UTF-8 bytes; the pieces' scores all differ, as shipped vocabularies' do), and
give the text back when decoding: whole, streamed after a prompt, and token by token."""

from __future__ import annotations

import random

import pytest
from tokenizers import SentencePieceBPETokenizer

from pagedkern.engine.detokenizer import IncrementalDetokenizer
from pagedkern.model import ModelLoadError
from pagedkern.model.gguf_tokenizer import tokenizer_from_gguf

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a model reads its tokens and writes the next one",
    "pagedkern serves models from files and folders",
    "prefix caching keeps the blocks of shared prompts",
    "Hello, World! 1234 tokens; 56 steps.",
] * 20


@pytest.fixture(scope="module")
def pieces() -> list[str]:
    """A trained SentencePiece-style BPE vocabulary (pieces with ▁), in merge order."""
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(CORPUS, vocab_size=300, min_frequency=2, show_progress=False)
    vocab = trainer.get_vocab()
    return [p for p, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if not p.startswith("<")]


def spm_meta(pieces: list[str], **extra) -> dict:
    """llama.cpp's layout: <unk>, <s>, </s>, the 256 byte pieces, then the pieces, each scored
    by its rank (earlier merges score higher, as a SentencePiece BPE model's do)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    meta.update(extra)
    return meta


def llama_cpp_spm(meta: dict, text: str) -> list[int]:
    """llama.cpp's llm_tokenizer_spm, plainly: spaces as ▁ (and one in front with
    add_space_prefix), characters merged by the best-scoring adjacent pair until none is a
    piece, leftovers as their bytes."""
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    types = meta["tokenizer.ggml.token_type"]
    ids = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, i in ids.items() if types[i] == NORMAL}
    prefix = SPACE if meta.get("tokenizer.ggml.add_space_prefix", True) else ""
    symbols = list(prefix + text.replace(" ", SPACE))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            piece = symbols[i] + symbols[i + 1]
            if piece in normal and (best is None or scores[ids[piece]] > best[0]):
                best = (scores[ids[piece]], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for symbol in symbols:
        if symbol in ids:
            out.append(ids[symbol])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in symbol.encode())
    return out


def random_texts(count: int, seed: int) -> list[str]:
    """Words of the corpus, cut and joined oddly, with characters it never had (bytes)."""
    rng = random.Random(seed)
    words = " ".join(CORPUS[:5]).split() + ["é", "法国", "🇫🇷", "ß", "\t", "x=1", "  "]
    texts = []
    for _ in range(count):
        picked = [rng.choice(words) for _ in range(rng.randint(1, 8))]
        text = rng.choice([" ", "", "  "]).join(picked)
        if rng.random() < 0.3:
            text = " " + text
        texts.append(text)
    return texts


@pytest.mark.parametrize("prefix", [True, False])
def test_text_splits_as_llama_cpps_sentencepiece_and_decodes_back(pieces, prefix):
    meta = spm_meta(pieces, **{"tokenizer.ggml.add_space_prefix": prefix})
    tok = tokenizer_from_gguf(meta, "spm.gguf")
    for text in random_texts(300, seed=int(prefix)):
        ids = tok.encode(text)
        assert ids == llama_cpp_spm(meta, text), text
        assert tok.decode(ids) == text


def test_bos_by_default_bytes_for_unknown_characters_and_control_tokens(pieces):
    tok = tokenizer_from_gguf(spm_meta(pieces), "spm.gguf")
    ids = tok.encode("é", add_special_tokens=True)
    assert ids[0] == tok.bos_token_id == 1  # (SentencePiece files add BOS unless told not to)
    assert [tok.id_to_token(i) for i in ids[1:]] == [SPACE, "<0xC3>", "<0xA9>"]
    assert tok.encode("the</s>")[-1] == 2 and tok.eos_token_id == 2
    assert tok.decode(tok.encode("the</s>"), skip_special_tokens=True) == "the"
    no_bos = spm_meta(pieces, **{"tokenizer.ggml.add_bos_token": False})
    assert tokenizer_from_gguf(no_bos, "spm.gguf").encode("é", add_special_tokens=True) == ids[1:]


def test_a_sentencepiece_vocabulary_without_its_scores_is_refused(pieces):
    meta = spm_meta(pieces)
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ModelLoadError, match="a score a token: none for"):
        tokenizer_from_gguf(meta, "spm.gguf")
    meta = spm_meta(pieces, **{"tokenizer.ggml.scores": [0.0] * 3})
    with pytest.raises(ModelLoadError, match="a score a token: 3 for"):
        tokenizer_from_gguf(meta, "spm.gguf")
    meta = spm_meta(pieces, **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match="tokenizer model 'bert'"):
        tokenizer_from_gguf(meta, "spm.gguf")


def test_generated_text_keeps_the_space_its_first_piece_begins_with(pieces):
    """Decoded alone, a sequence's first "▁the" loses its space (the prefix the encoder added);
    after a prompt it must not: the streamed text is what the generated ids add to the
    prompt's, and a logprob's token string is the piece's own text."""
    tok = tokenizer_from_gguf(spm_meta(pieces), "spm.gguf")
    prompt, whole = tok.encode("the quick brown"), tok.encode("the quick brown fox jumps")
    generated = whole[len(prompt) :]
    assert tok.decode(generated).startswith("fox")  # (alone: the strip)
    stream = IncrementalDetokenizer(tok, context=prompt)
    text = "".join(stream.add(i) for i in generated) + stream.flush()
    assert text == tok.decode(whole)[len(tok.decode(prompt)) :] == " fox jumps"
    assert "".join(tok.token_text(i) for i in generated) == " fox jumps"
    assert tok.token_text(tok.eos_token_id) == "</s>"  # (a special token's text is shown)


def test_the_unknown_token_is_special(pieces):
    """Written in text it is its id, text after it prefixed again (llama.cpp prefixes every
    text fragment that follows a special token), and skipped when special tokens are."""
    meta = spm_meta(pieces)
    tok = tokenizer_from_gguf(meta, "spm.gguf")
    ids = tok.encode("the<unk>fox")
    assert ids == [*llama_cpp_spm(meta, "the"), 0, *llama_cpp_spm(meta, "fox")]
    assert tok.decode(ids, skip_special_tokens=True) == "the fox"


def test_gemmas_eos_stops_generation_when_the_file_names_no_eos(pieces):
    """The converter writes no EOS for a Gemma folder whose config lists several: its <eos>
    (and <end_of_turn>) must still end generation."""
    meta = spm_meta(pieces)
    meta["tokenizer.ggml.tokens"][2] = "<eos>"
    del meta["tokenizer.ggml.eos_token_id"]
    tok = tokenizer_from_gguf(meta, "gemma.gguf")
    assert tok.eos_token_id is None and 2 in tok.stop_token_ids
