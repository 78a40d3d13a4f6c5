"""A request's body to its typed request (request_models.py) and on to its SamplingParams; each
refusal a 400 naming the field."""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from ...engine import SamplingParams
from ...engine.sampling_params import MAX_STOP_STRING_LENGTH as MAX_WORD_IDS
from ...engine.sampling_params import MAX_TOKEN_LIST
from .errors import APIError, validation_error
from .prompts import INLINE_PROMPT_CHARS
from .request_models import IMPLEMENTED

# Bodies above this are validated in a worker thread: a few MB of messages or token ids take
# pydantic 0.5-0.9 s, which on the event loop would stall every stream; below it, the thread hop
# costs more than the parse.
INLINE_BODY_BYTES = 64 * 1024


def parse(model: type, body: bytes):
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise validation_error(exc) from exc


async def parse_off_the_loop(model: type, body: bytes):
    """parse(), in a worker thread for a big body."""
    if len(body) <= INLINE_BODY_BYTES:
        return parse(model, body)
    return await asyncio.to_thread(parse, model, body)


async def sampling(
    req, default_max_tokens: int, defaults: dict | None = None, tokenizer=None, vocab_size=None
) -> SamplingParams:
    """The request's SamplingParams; a 400 naming the field for a bad value (SamplingParams'
    own checks), an unknown token id (logit_bias, allowed_token_ids, bad_words) or schema."""
    words = req.bad_word_strings() if tokenizer is not None else None
    if words:
        words = await text_bad_words(tokenizer, words)
    try:
        params = req.sampling_params(default_max_tokens, defaults or {}, words)
    except (ValueError, TypeError) as exc:  # SamplingParams' own checks
        raise APIError(400, str(exc), param=_field_named(str(exc))) from exc
    if vocab_size is not None:
        for name, token in params.token_ids_used():
            if not 0 <= token < vocab_size:
                raise APIError(
                    400, f"{name}: {token} is not a token id (vocabulary {vocab_size})", param=name
                )
    return params


async def text_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences banning bad_words given as text. Words that cannot fit
    SamplingParams' bounds are refused by their count and characters before any is tokenized,
    and a big total is tokenized in a worker thread (as prompts.py does with prompts): either
    would stall every stream for seconds."""
    most = MAX_TOKEN_LIST // 2  # (a word makes up to two sequences: bad_word_ids)
    if len(words) > most:
        raise APIError(
            400, f"bad_words: at most {most} words as text, got {len(words)}", param="bad_words"
        )
    per_token = tokenizer.max_token_chars  # (None: the characters bound no token count)
    for i, word in enumerate(words if per_token is not None else ()):
        chars = len(word.lstrip())  # (as bad_word_ids tokenizes it)
        if chars > MAX_WORD_IDS * per_token:
            raise APIError(
                400,
                f"bad_words[{i}]: {chars} characters make more than {MAX_WORD_IDS} tokens",
                param="bad_words",
            )
    # (an encode call costs about as much as 64 characters of text)
    if sum(64 + len(w) for w in words) <= INLINE_PROMPT_CHARS:
        return _sequences(tokenizer, words)
    return await asyncio.to_thread(_sequences, tokenizer, words)


def _sequences(tokenizer, words: list[str]) -> list[list[int]]:
    return [ids for word in words for ids in bad_word_ids(tokenizer, word)]


def bad_word_ids(tokenizer, word: str) -> list[list[int]]:
    """The token sequences that ban `word` (vLLM's rule): the word at the start of the text and
    the word after a space, which a BPE tokenizer spells with other ids (" lazy" is not
    "lazy"). An empty or all-space word bans nothing."""
    word = word.lstrip()
    if not word:
        return []
    bare, spaced = tokenizer.encode(word), tokenizer.encode(" " + word)
    return [bare] if spaced == bare else [bare, spaced]


def _field_named(message: str) -> str | None:
    """The request field a SamplingParams error message starts with."""
    head = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0].rstrip(":")
    return head if head in IMPLEMENTED else None
