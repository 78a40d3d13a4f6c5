"""Structured output (response_format) through llguidance, the grammar engine vLLM also uses.

llguidance (a Rust library with a small abi3 wheel and no Python dependencies; xgrammar pulls
torch-version-specific builds) compiles a JSON schema into a grammar and, per generated token,
computes the set of tokens that keep the output a valid prefix as a bitmask (int32 words, bit
t % 32 of word t // 32 for token t): the `bitmask` input of the sampling op, applied inside it.
EOS is allowed only where the output is a complete document; the matcher then stops the
request. No JSON constraint logic lives here: only the wiring.

    {"type": "text"}                       no constraint
    {"type": "json_object"}                any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
"""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .logits_processing import bitmask_words
from .validation import ParameterTypeError

FORMAT_TYPES = ("text", "json_object", "json_schema")
MAX_SCHEMA_CHARS = 100_000  # bounds grammar compilation time per request


def check_response_format(value: Any) -> Mapping | None:
    """A checked, normalised response_format ({"type": ..., "schema": ...}); None for text.
    ValueError naming response_format for a malformed value or an invalid schema."""
    if not isinstance(value, Mapping):
        raise ParameterTypeError(f"response_format must be an object, got {value!r}")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise ValueError(f"response_format.type must be one of {FORMAT_TYPES}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", spec if "type" in spec or "properties" in spec else None)
        if not isinstance(schema, (Mapping, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"response_format: the schema has over {MAX_SCHEMA_CHARS} characters")
    _grammar(text)  # compile once here: an invalid schema is the caller's 400, not a failure
    return {"type": kind, "schema": json.loads(text)}


@functools.lru_cache(maxsize=256)
def _grammar(schema_text: str) -> str:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema_text, defaults={"whitespace_flexible": False}
        )
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError
        raise ValueError(f"response_format: invalid JSON schema: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"response_format: invalid JSON schema: {messages[0]}")
    return grammar


class GrammarCompiler:
    """llguidance's view of one tokenizer (built once per tokenizer: ~1 s for a big vocab)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        backend = tokenizer.backend
        eos = list(tokenizer.stop_token_ids) or None
        self.vocab_size = vocab_size
        self.llg_tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=eos
        )

    def compile(self, response_format: Mapping) -> str:
        return _grammar(json.dumps(response_format["schema"]))

    def matcher(self, grammar: str) -> GrammarMatcher:
        return GrammarMatcher(self, grammar)


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_compiler(tokenizer, vocab_size: int) -> GrammarCompiler:
    compiler = _compilers.get(tokenizer)
    if compiler is None or compiler.vocab_size != vocab_size:
        compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer, vocab_size)
    return compiler


class GrammarMatcher:
    """One request's position in its grammar: the next token's bitmask, and acceptance."""

    def __init__(self, compiler: GrammarCompiler, grammar: str):
        import llguidance

        self._matcher = llguidance.LLMatcher(compiler.llg_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"response_format: {self._matcher.get_error()}")
        self._mask = torch.empty(bitmask_words(compiler.vocab_size), dtype=torch.int32)

    def bitmask(self) -> torch.Tensor:
        """int32 [ceil(V / 32)]: the tokens allowed next (a fresh tensor each step)."""
        mask = torch.empty_like(self._mask)
        self._matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        return mask

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; True when the document is complete (the request stops).
        A token outside the mask cannot be sampled; should one still arrive the matcher's
        error is raised (the request fails alone)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(
                f"structured output: token {token} rejected: {self._matcher.get_error()}"
            )
        return self._matcher.is_stopped()
