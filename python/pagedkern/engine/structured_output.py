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
    {"type": "grammar", "grammar": "<Lark>"}   llguidance's Lark syntax (%json{...} embeds a
                                           schema); the server's tool-call and after-thinking
                                           grammars (serving/tools/grammar.py)

Compilation, as vLLM and SGLang do it: once per request (`GrammarCompiler.compile`, cached per
schema, failures too), never per sample: each sample's matcher is a deep copy of the compiled
one (microseconds; building one costs up to ~0.5 s for a 100 KB schema). SamplingParams only
checks the shape (cheap, fine on an event loop); the schema itself is checked by compiling it.
A compiled grammar is also probed: the first PROBE_TOKENS steps of one path through it must
work within llguidance's limits, so a schema that admits no document (`{"$ref": "#"}`) or that
compiles but exceeds the limits once generation starts (`"pattern": "^a{1000000}$"`, a required
recursive `$ref`, hundreds of optional properties) is refused before admission (ValueError
naming response_format). A limit met later still fails its request alone
(StructuredOutputError). llguidance's errors are kept short (verbose errors off, then cut to
MAX_ERROR_CHARS): a verbose one carries the whole grammar, megabytes in a log.

`Engine.add_request` compiles on the caller's thread; the HTTP engine core compiles on a
`GrammarCompilePool` (llguidance drops the GIL while it builds) and admits the request once
its grammar is ready, so no step waits for a compile (serving/core/engine_core.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
import weakref
from collections.abc import Mapping

import numpy as np
import torch

from .logits_processing import bitmask_words, mask_allows

MAX_ERROR_CHARS = 300  # of a grammar engine's error, in a message or the log
PROBE_TOKENS = 8  # steps of the compile-time probe (each a mask: ~1 ms, bounded by llguidance)
CACHE_SIZE = 64  # compiled schemas kept per tokenizer (their outcome: a grammar or the error)


class StructuredOutputError(ValueError):
    """The grammar engine cannot follow a schema (the message starts with "response_format")."""


def schema_key(response_format: Mapping) -> str:
    """What identifies a checked response_format's grammar: its schema as JSON text (a JSON
    string for a Lark grammar: never equal to a schema, which is an object or a boolean)."""
    if response_format["type"] == "grammar":
        return json.dumps(response_format["grammar"])
    return json.dumps(response_format["schema"])


def _short(message: str) -> str:
    text = message.replace("<non-verbose/>", "").strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " [...]"


class GrammarCompiler:
    """llguidance's view of one tokenizer (built once per tokenizer: ~1 s for a big vocab) and
    the schemas compiled for it. Thread-safe: compiles may run on several threads."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        backend = tokenizer.backend
        self.eos = frozenset(tokenizer.stop_token_ids)
        self.vocab_size = vocab_size
        self.llg_tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=list(self.eos) or None
        )
        self._cache: collections.OrderedDict[str, CompiledGrammar | str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, response_format: Mapping) -> CompiledGrammar:
        """The checked response_format's grammar, compiled and probed once per schema (its
        outcome cached). StructuredOutputError (a ValueError naming response_format) for a
        schema that is invalid, admits no document or exceeds llguidance's limits."""
        key = schema_key(response_format)
        with self._lock:
            outcome = self._cache.get(key)
            if outcome is not None:
                self._cache.move_to_end(key)
        if outcome is None:
            try:
                outcome = self._compile(key)
            except StructuredOutputError as exc:
                outcome = str(exc)
            with self._lock:
                self._cache[key] = outcome
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(outcome, str):
            raise StructuredOutputError(outcome)
        return outcome

    def _compile(self, schema_text: str) -> CompiledGrammar:
        import llguidance

        lark = json.loads(schema_text)
        try:
            if isinstance(lark, str):
                grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            else:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema_text, defaults={"whitespace_flexible": False}
                )
        except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError
            what = "grammar" if isinstance(lark, str) else "JSON schema"
            raise StructuredOutputError(
                f"response_format: invalid {what}: {_short(str(exc))}"
            ) from None
        limits = llguidance.LLParserLimits(verbose_errors=False)  # errors without the grammar
        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            what = "grammar" if isinstance(lark, str) else "JSON schema"
            raise StructuredOutputError(
                f"response_format: invalid {what}: {_short(matcher.get_error())}"
            )
        self._probe(matcher.deep_copy())
        return CompiledGrammar(self, matcher)

    def _probe(self, matcher) -> None:
        """Walk PROBE_TOKENS steps of one path (the lowest allowed id that is not EOS) and
        refuse the schema when a mask or a token fails: llguidance checks its limits lazily,
        as generation reaches them, and the first steps are where the usual offenders (a huge
        repetition count, a required recursive $ref, a few hundred optional properties) do."""
        mask = torch.empty(bitmask_words(self.vocab_size), dtype=torch.int32)
        bits = mask.numpy().view(np.uint8)  # numpy: no torch intra-op team on this thread
        for step in range(PROBE_TOKENS):
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            if matcher.is_error():
                if step == 0:  # no first token at all (e.g. {"$ref": "#"})
                    error = _short(matcher.get_error())
                    raise StructuredOutputError(
                        f"response_format: the schema admits no value ({error})"
                    )
                break
            allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
            token = next((t for t in allowed.tolist() if t not in self.eos), None)
            if token is None:  # only EOS: a complete document (or, at the start, none)
                if step == 0:
                    raise StructuredOutputError("response_format: the schema admits no value")
                return
            if not matcher.consume_token(token) or matcher.is_stopped():
                break
        if matcher.is_error():
            raise StructuredOutputError(
                "response_format: the schema exceeds the grammar engine's limits: "
                + _short(matcher.get_error())
            )


class CompiledGrammar:
    """A schema compiled for one tokenizer, at the start of a document: each sample's matcher
    is a deep copy of it (no compilation)."""

    def __init__(self, compiler: GrammarCompiler, matcher):
        self.compiler = compiler
        self._matcher = matcher

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.compiler, self._matcher.deep_copy())


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def grammar_compiler(tokenizer, vocab_size: int) -> GrammarCompiler:
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None or compiler.vocab_size != vocab_size:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer, vocab_size)
        return compiler


class PendingGrammar:
    """One response_format's compile on a GrammarCompilePool: `future` (a CompiledGrammar or
    the StructuredOutputError) and `started` (time.monotonic() when a worker took it; None
    while it waits for one)."""

    __slots__ = ("future", "started")

    def __init__(self) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started: float | None = None

    def running_for(self, now: float) -> float:
        return 0.0 if self.started is None else now - self.started


class GrammarCompilePool:
    """Compiles response_formats on at most `workers` threads, off the caller's (an engine
    core's step loop): llguidance drops the GIL while it builds, so steps go on meanwhile.
    Requests with the same schema share one compile; a compiled schema is ready at once."""

    def __init__(self, tokenizer, vocab_size: int, workers: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._executor = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="pagedkern-grammar"
        )
        self._running: dict[str, PendingGrammar] = {}
        self._lock = threading.Lock()

    def submit(self, response_format: Mapping) -> PendingGrammar:
        key = schema_key(response_format)
        with self._lock:
            pending = self._running.get(key)
            if pending is None:
                pending = self._running[key] = PendingGrammar()
                self._executor.submit(self._compile, key, response_format, pending)
        return pending

    def _compile(self, key: str, response_format: Mapping, pending: PendingGrammar) -> None:
        pending.started = time.monotonic()
        try:
            compiler = grammar_compiler(self.tokenizer, self.vocab_size)
            pending.future.set_result(compiler.compile(response_format))
        except BaseException as exc:  # noqa: BLE001 - the waiting request's answer
            pending.future.set_exception(exc)
        finally:
            with self._lock:
                self._running.pop(key, None)

    def close(self) -> None:
        """Drop the compiles not started; a running one ends on its own (it cannot be
        interrupted; llguidance's limits bound it)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class GrammarMatcher:
    """One sample's position in its grammar: the next token's bitmask, and acceptance."""

    def __init__(self, compiler: GrammarCompiler, matcher):
        self._matcher = matcher
        self._mask = torch.empty(bitmask_words(compiler.vocab_size), dtype=torch.int32)
        self._last: torch.Tensor | None = None  # the mask of the token being sampled

    def bitmask(self) -> torch.Tensor:
        """int32 [ceil(V / 32)]: the tokens allowed next (a fresh tensor each step).
        StructuredOutputError when the grammar engine fails (a limit reached): the request
        fails alone, with a short message."""
        mask = torch.empty_like(self._mask)
        self._matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if self._matcher.is_error():  # (its mask would allow only EOS: a cut-off "document")
            raise StructuredOutputError(
                f"response_format: the grammar engine stopped: {_short(self._matcher.get_error())}"
            )
        self._last = mask
        return mask

    def allows(self, token: int) -> bool:
        """Whether the last bitmask() let `token` be sampled."""
        return self._last is None or mask_allows(self._last, token)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; True when the document is complete (the request stops).
        A token outside the mask cannot be sampled; should one still arrive, or a limit be
        reached, StructuredOutputError (the request fails alone)."""
        if not self._matcher.consume_token(token):
            raise StructuredOutputError(
                f"response_format: token {token} rejected: {_short(self._matcher.get_error())}"
            )
        return self._matcher.is_stopped()
