"""A request's body to its typed request (request_models.py) and on to its SamplingParams; each
refusal a 400 naming the field."""

from __future__ import annotations

from pydantic import ValidationError

from ...engine import SamplingParams
from .errors import APIError, validation_error
from .request_models import IMPLEMENTED


def parse(model: type, body: bytes):
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise validation_error(exc) from exc


def sampling(
    req, default_max_tokens: int, defaults: dict | None = None, tokenizer=None, vocab_size=None
) -> SamplingParams:
    """The request's SamplingParams; a 400 naming the field for a bad value (SamplingParams'
    own checks), an unknown token id (logit_bias, allowed_token_ids, bad_words) or schema."""
    words = None
    if tokenizer is not None and req.bad_word_strings():
        words = [ids for w in req.bad_word_strings() for ids in bad_word_ids(tokenizer, w)]
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
