"""The tokenizer of a GGUF file, rebuilt with HF `tokenizers` from its metadata: the byte-level
BPE vocabulary and merges, the pre-tokenizer named by tokenizer.ggml.pre, the special tokens
(token type CONTROL) and BOS/EOS, and the chat template."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from .config_checks import check_types
from .errors import ModelLoadError
from .tokenizer import Tokenizer

# llama.cpp token types (llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

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
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
}


# The types of the tokenizer keys read (config_checks)
_KINDS = {"model": "str", "pre": "str", "tokens": "strs", "token_type": "ints", "merges": "strs"}
_KINDS |= {"add_bos_token": "bool"}
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


def tokenizer_from_gguf(meta: dict[str, Any], source: str) -> Tokenizer:
    """meta: the GGUF key/value metadata (tokenizer.* keys), values already decoded."""
    check_types(meta, _KINDS, source, prefix="tokenizer.ggml.")
    check_types(meta, {"tokenizer.chat_template": "str"}, source)
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            source, f"unsupported GGUF tokenizer model {model!r} (only byte-level BPE, 'gpt2')"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(source, f"unsupported GGUF pre-tokenizer {pre!r}")
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(source, "GGUF metadata holds no vocabulary (tokenizer.ggml.tokens)")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        problem = f"{len(types)} tokenizer.ggml.token_type entries for {len(tokens)} tokens"
        raise ModelLoadError(source, problem)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ModelLoadError(source, "tokenizer.ggml.merges: a merge is not two tokens")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicated string keeps its first id

    kind = _PRE_TOKENIZERS[pre]
    # Llama 3's tokenizer takes whole words found in the vocabulary before applying merges.
    ignore_merges = kind == _LLAMA3
    try:
        bpe = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=ignore_merges)
    except Exception as exc:  # (a merge of tokens the vocabulary lacks)
        raise ModelLoadError(source, f"invalid BPE vocabulary or merges: {exc}") from None
    backend = Backend(bpe)
    backend.pre_tokenizer = _pre_tokenizer(kind)
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (_CONTROL, _USER_DEFINED)
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
    steps = [processors.ByteLevel(trim_offsets=False)]
    if meta.get("tokenizer.ggml.add_bos_token") and special["bos_token"]:
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
