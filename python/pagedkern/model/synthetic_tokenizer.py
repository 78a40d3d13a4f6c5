"""A small byte-level BPE tokenizer for synthetic models, built with HF `tokenizers`: ChatML
special tokens, the 256 byte symbols, then deterministic merges of frequent English letters
until the vocabulary has the requested size (so every id a synthetic model samples decodes)."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from .tokenizer import Tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Word-start marker (byte-level space) and letters, most frequent first.
_UNITS = ["\u0120", *"etaoinshrdlcumwfgypbvkjxqz"]


@lru_cache(maxsize=4)
def _backend(vocab_size: int) -> str:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    minimum = len(SPECIAL_TOKENS) + len(alphabet)
    if vocab_size < minimum:
        raise ValueError(f"a byte-level vocabulary needs at least {minimum} ids, got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *alphabet))}
    merges: list[tuple[str, str]] = []
    frontier = _UNITS
    while len(vocab) < vocab_size:
        grown = []
        for left in frontier:
            for right in _UNITS[1:]:
                if len(vocab) == vocab_size:
                    break
                token = left + right
                if token not in vocab:
                    vocab[token] = len(vocab)
                    merges.append((left, right))
                    grown.append(token)
        frontier = grown
    backend = Backend(models.BPE(vocab, merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return backend.to_str()  # cached as JSON: callers get independent tokenizer objects


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A tokenizer with exactly `vocab_size` ids (>= 259) and a ChatML chat template."""
    backend = Backend.from_str(_backend(vocab_size))
    special = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    return Tokenizer(backend, special, CHATML_TEMPLATE)
