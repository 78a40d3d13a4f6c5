"""Admission: turns `Engine.add_request`'s arguments into Requests, one per sample, with
every field checked (ValueError naming the field) and each request's own state set up: its
seed, stop ids, detokenizer, deadline, logits state and grammar matcher, and for an n > 1
request the samples that fork from the first one's prompt (`Request.forks`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Container, Mapping, Sequence
from typing import TYPE_CHECKING

import jinja2

from .detokenizer import IncrementalDetokenizer
from .logits_processing import LogitsState
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import RequestRejected
from .validation import ParameterTypeError, check_messages, check_number, check_token_ids

if TYPE_CHECKING:
    from ..model import Tokenizer
    from .structured_output import CompiledGrammar


def needs_sync(request: Request) -> bool:
    """Whether the request's next step needs host state from the token before it (so an
    asynchronous step holding it runs synchronously: engine/overlap.py)."""
    state, params = request.logits_state, request.params
    history = state is not None and (state.penalised or state.multi_word)
    prompt = state is not None and state.prompt_logprobs is not None
    return bool(request.grammar is not None or history or params.min_tokens or prompt)


def check_prompt_length(tokenizer: Tokenizer, text: str, max_model_len: int) -> None:
    """RequestRejected when `text`'s characters alone prove it has too many tokens for a
    context of max_model_len (Tokenizer.max_token_chars): a 10 MB prompt is refused before
    the tokenizer spends seconds on it."""
    per_token = tokenizer.max_token_chars
    if per_token is None:
        return
    at_least = -(-len(text) // per_token)
    if at_least >= max_model_len:  # a prompt must leave room for one new token
        raise RequestRejected(
            f"the prompt has at least {at_least} tokens ({len(text)} characters); "
            f"this model's context is {max_model_len} tokens"
        )


def check_a_token_is_left(params: SamplingParams, stop_ids: frozenset, vocab_size: int) -> None:
    """ValueError naming the field when allowed_token_ids, single-token bad_words and
    min_tokens (which masks the stop tokens until reached) leave no token to sample at the
    first step. (Later steps, and response_format's grammar: NoTokenAllowed as they run.)"""
    banned = {word[0] for word in params.bad_words if len(word) == 1}
    masked = len(banned) + (len(stop_ids) if params.min_tokens else 0)
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
    elif masked < vocab_size:
        return  # (the common case: no set built)
    else:
        allowed = set(range(vocab_size))
    left = allowed - banned
    if not left:
        field = "allowed_token_ids" if params.allowed_token_ids is not None else "bad_words"
        raise ValueError(f"{field}: bad_words ban every token that could be sampled")
    if params.min_tokens and left <= stop_ids:
        raise ValueError(
            f"min_tokens: every token left to sample is a stop token, which min_tokens "
            f"({params.min_tokens}) masks until reached"
        )


class Admission:
    """Checks requests and makes their Requests. detokenize: False for an engine whose
    outputs carry token ids only (the HTTP front end detokenizes): stop strings are refused
    and requests get no detokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.detokenize = True
        self._ids = itertools.count()
        self._seeds = random.Random()

    def make(
        self,
        prompt: str | None,
        params: SamplingParams | None,
        *,
        messages: Sequence[Mapping] | None,
        prompt_ids: Sequence[int] | None,
        request_id: str | None,
        arrival_time: float,
        grammar: CompiledGrammar | None,
        in_use: Container[str],
    ) -> list[Request]:
        """The request's samples (one unless params.n > 1; the first holds the others in
        `forks`); in_use: the ids of the requests still running (an id is refused while in
        use). Argument meanings and errors: Engine.add_request."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ParameterTypeError(f"params must be a SamplingParams, got {params!r}")
        if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages, prompt_ids")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ParameterTypeError(f"request_id must be a non-empty string, got {request_id!r}")
        check_number("arrival_time", arrival_time)
        if messages is not None:
            messages = check_messages(messages)
            try:
                prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except jinja2.TemplateError as exc:  # (a message without content, say)
                raise ValueError(f"messages: the chat template failed on them: {exc}") from None
        if prompt_ids is None:
            if not isinstance(prompt, str):
                raise ParameterTypeError(f"prompt must be a string, got {prompt!r}")
            if not prompt:
                raise ValueError("the prompt is empty")
            check_prompt_length(self.tokenizer, prompt, self.max_model_len)
            # Raw text gets what the tokenizer's config adds around it (e.g. BOS, as HF and
            # vLLM do); a rendered chat template already carries its own.
            try:
                prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=messages is None)
            except TypeError:  # the tokenizers library's word for text it cannot take
                raise ValueError(
                    "prompt: not text the tokenizer can take (a lone surrogate, say)"
                ) from None
        prompt_ids = check_token_ids("prompt_ids", prompt_ids, self.vocab_size)
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        for name, token in params.token_ids_used():
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"{name}: {token} is not a token id (vocabulary {self.vocab_size})"
                )
        if params.stop and not self.detokenize:
            raise ValueError("stop: stop strings need an engine that detokenizes")
        request_id = request_id or f"R{next(self._ids)}"
        ids = [request_id] + [f"{request_id}.{i}" for i in range(1, params.n)]
        if any(i in in_use for i in ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        grammars = self._grammars(params, grammar)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        eos = () if params.ignore_eos else self.tokenizer.stop_token_ids
        stop_ids = frozenset(params.stop_token_ids).union(eos)
        check_a_token_is_left(params, stop_ids, self.vocab_size)
        deadline = None if params.timeout is None else arrival_time + params.timeout
        samples = []
        for i, rid in enumerate(ids):
            sample = Request(
                rid,
                prompt_ids,
                params,
                messages=messages,
                prompt_text=prompt,
                seed=(seed + i + 2**63) % 2**64 - 2**63,  # sample i: its own seed stream
                arrival_time=arrival_time,
                sample_index=i,
                parent_id=request_id if params.n > 1 else None,
                grammar=grammars[i],
                stop_ids=stop_ids,
                deadline=deadline,
            )
            if self.detokenize:
                sample.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.min_tokens, context=prompt_ids
                )
            sample.logits_state = LogitsState(params, prompt_ids, stop_ids, self.vocab_size)
            sample.needs_sync = needs_sync(sample)
            samples.append(sample)
        if len(samples) > 1:
            samples[0].forks = samples[1:]
        return samples

    def _grammars(self, params: SamplingParams, grammar: CompiledGrammar | None) -> list:
        """One structured-output matcher per sample (None without response_format): the
        schema compiled once, each sample's matcher a copy."""
        if params.response_format is None:
            return [None] * params.n
        if grammar is None:
            from .structured_output import grammar_compiler

            compiler = grammar_compiler(self.tokenizer, self.vocab_size)
            grammar = compiler.compile(params.response_format)
        return [grammar.matcher() for _ in range(params.n)]
