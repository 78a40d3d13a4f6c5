"""The tokenizer of a GGUF file, rebuilt with HF `tokenizers` from its metadata, for both kinds
llama.cpp writes: byte-level BPE ('gpt2': the vocabulary and merges, the pre-tokenizer named by
tokenizer.ggml.pre) and SentencePiece ('llama': Llama 2, Mistral 7B, Mixtral, Gemma: pieces
with scores, merged highest score first, bytes outside the vocabulary as <0xXX> tokens); the
special tokens (token type CONTROL), BOS/EOS and the chat template.

SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is the
highest-scoring piece (llama.cpp's llm_tokenizer_spm). As transformers' GGUF converter does, that
is an HF BPE whose merges are every split of every piece into two pieces, ranked by the score of
the piece they make, with byte fallback; spaces become ▁ (and a leading ▁ with
add_space_prefix, llama.cpp's default for these files). One difference: where two pieces have
equal scores, llama.cpp merges the leftmost pair first and this BPE the pair whose parts score
higher (a static rank cannot say "leftmost"); the vocabularies shipped (Llama 2, Mistral,
Gemma) score every piece apart."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from .config_checks import check_types
from .errors import ModelLoadError
from .tokenizer import Tokenizer

# llama.cpp token types (llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's ▁

# The pre-tokenizer regexes llama.cpp applies per tokenizer.ggml.pre, as HF pre-tokenizers.
_GPT2 = "gpt2"
_DIGITS_GPT2 = "digits+gpt2"  # StarCoder/SmolLM: every digit alone, then GPT-2's regex
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (tokenizer.json's regexes, which llama.cpp's src/llama-vocab.cpp names per pre; tekken and the
# Llama 3 family take whole words found in the vocabulary before any merge, and add BOS unless
# the file says not to, as llama.cpp sets both for them)
_PRE_TOKENIZERS = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "codeshell": _DIGITS_GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "gpt-4o": _GPT4O,
    "llama4": _GPT4O,
    "tekken": _TEKKEN,
}
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "tekken"}


# The types of the tokenizer keys read (config_checks)
_KINDS = {"model": "str", "pre": "str", "tokens": "strs", "token_type": "ints", "merges": "strs"}
_KINDS |= {"add_bos_token": "bool", "add_space_prefix": "bool", "scores": "numbers"}
_KINDS |= {f"{k}_token_id": "int" for k in ("bos", "eos", "unknown", "padding", "eot", "eom")}


def _pre_tokenizer(kind: str):
    if kind == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == _DIGITS_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(kind), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_bpe(meta: dict[str, Any], vocab: dict[str, int], pre: str, source: str) -> Backend:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ModelLoadError(source, "tokenizer.ggml.merges: a merge is not two tokens")
    try:
        bpe = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    except Exception as exc:  # (a merge of tokens the vocabulary lacks)
        raise ModelLoadError(source, f"invalid BPE vocabulary or merges: {exc}") from None
    backend = Backend(bpe)
    backend.pre_tokenizer = _pre_tokenizer(_PRE_TOKENIZERS[pre])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(
    meta: dict[str, Any], tokens: list[str], types: list[int], vocab: dict[str, int], source: str
) -> Backend:
    """SentencePiece's BPE as an HF BPE (module docstring)."""
    scores: list[float] | None = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        got = "none" if scores is None else len(scores)
        raise ModelLoadError(
            source, f"a SentencePiece vocabulary needs a score a token: {got} for {len(tokens)}"
        )
    score = {tok: scores[i] for tok, i in vocab.items()}
    ranked = []  # (score of the piece made, -score of each part's, the pair): best first
    for piece, i in vocab.items():
        if types[i] != _NORMAL or len(piece) < 2:  # (control, byte, unused: never merged into)
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in score and right in score:
                ranked.append((-score[piece], -score[left], -score[right], cut, left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk = next((tokens[i] for i in range(len(tokens)) if types[i] == _UNKNOWN), None)
    try:
        bpe = models.BPE(vocab, merges, unk_token=unk, fuse_unk=False, byte_fallback=True)
    except Exception as exc:
        raise ModelLoadError(source, f"invalid SentencePiece vocabulary: {exc}") from None
    backend = Backend(bpe)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    parts = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*parts, *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return backend


def tokenizer_from_gguf(meta: dict[str, Any], source: str) -> Tokenizer:
    """meta: the GGUF key/value metadata (tokenizer.* keys), values already decoded."""
    check_types(meta, _KINDS, source, prefix="tokenizer.ggml.")
    check_types(meta, {"tokenizer.chat_template": "str"}, source)
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(
            source,
            f"unsupported GGUF tokenizer model {model!r} (byte-level BPE 'gpt2' and "
            "SentencePiece 'llama' are supported)",
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(source, f"unsupported GGUF pre-tokenizer {pre!r}")
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(source, "GGUF metadata holds no vocabulary (tokenizer.ggml.tokens)")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        problem = f"{len(types)} tokenizer.ggml.token_type entries for {len(tokens)} tokens"
        raise ModelLoadError(source, problem)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicated string keeps its first id
    if model == "llama":
        backend = _sentencepiece(meta, tokens, types, vocab, source)
    else:
        backend = _byte_level_bpe(meta, vocab, pre, source)
    added = [  # (an unknown token is special too: skipped in decode, its id when written)
        AddedToken(tokens[i], special=types[i] != _USER_DEFINED, normalized=False)
        for i in range(len(tokens))
        if types[i] in (_CONTROL, _USER_DEFINED, _UNKNOWN)
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    special = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
    }
    steps = [processors.ByteLevel(trim_offsets=False)] if model == "gpt2" else []
    # (SentencePiece, Llama 3 and tekken files add BOS unless they say not to: llama.cpp's
    # defaults for them)
    bos_by_default = model == "llama" or pre in _IGNORE_MERGES
    if meta.get("tokenizer.ggml.add_bos_token", bos_by_default) and special["bos_token"]:
        bos = special["bos_token"]
        steps.append(
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            )
        )
    backend.post_processor = processors.Sequence(steps)
    # End-of-turn / end-of-message ids llama.cpp records beside EOS (an id past the vocabulary
    # ignored, as llama.cpp ignores it and BOS / EOS above)
    extra_stops = [
        i
        for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (i := meta.get(k)) is not None and 0 <= i < len(tokens)
    ]
    return Tokenizer(backend, special, meta.get("tokenizer.chat_template"), extra_stops)
