"""Turning a request's prompt into token ids, off the engine thread.

The HTTP handlers hand the engine token ids only. They render the chat template and tokenize a
big prompt in a worker thread (`asyncio.to_thread`), so it never stalls the other streams, and
a small one (`is_small`: at most INLINE_PROMPT_CHARS characters in all) on the event loop:
there, tens of µs of tokenizing cost less than the thread hop and the GIL hand-offs around it,
and a burst of requests reaches the engine together instead of one per hop. Before
tokenizing, a prompt whose characters alone prove it cannot fit the context is refused: for
tokenizers where every token covers at most `max_token_chars` characters of the text (byte-level
BPE, or BPE with byte fallback, with no normalizer that could shrink the text), a text of n
characters has at least n / max_token_chars tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ...engine import RequestRejected
from ...model import Tokenizer

INLINE_PROMPT_CHARS = 2048  # prompts (text, template contents or ids) prepared on the loop
# Normalizers that never turn characters into fewer (Replace is checked for that below).
_NON_SHRINKING = {"Sequence", "Prepend", "Replace"}


def max_token_chars(tokenizer: Tokenizer) -> int | None:
    """The most text characters one token can stand for, or None where no such bound holds."""
    try:
        spec = json.loads(tokenizer.backend.to_str())
    except Exception:  # noqa: BLE001 - a backend that cannot describe itself: no bound
        return None
    model = spec.get("model") or {}
    byte_level = any(n.get("type") == "ByteLevel" for n in _nodes(spec.get("pre_tokenizer")))
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None  # some characters could vanish into one unknown token
    for node in _nodes(spec.get("normalizer")):
        if node.get("type") not in _NON_SHRINKING:
            return None
        if node["type"] == "Replace" and len(node.get("content", "")) < _pattern_len(node):
            return None
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=0) or None


def _nodes(node) -> list[dict]:
    """A normalizer / pre-tokenizer and, for a Sequence, its members (recursively)."""
    if not isinstance(node, dict):
        return []
    members = node.get("normalizers") or node.get("pretokenizers") or []
    return [node, *(n for member in members for n in _nodes(member))]


def _pattern_len(replace: dict) -> float:
    """A Replace normalizer's literal pattern length; a regex may match any length."""
    literal = (replace.get("pattern") or {}).get("String")
    return len(literal) if literal else float("inf")


class PromptPreparer:
    """add_request arguments -> {"prompt_ids": [...]}, in whatever thread calls it (the
    tokenizer is thread-safe; the engine is not touched)."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_token_chars = max_token_chars(tokenizer)

    def __call__(self, args: dict) -> dict:
        """Raises ValueError (empty prompt, bad token id, a template refusing the messages,
        RequestRejected for a prompt that cannot fit) or jinja2.TemplateError."""
        if "prompt_ids" in args:
            return {"prompt_ids": self.check_ids(args["prompt_ids"])}
        if "messages" in args:  # template_kwargs: tools=, chat_template_kwargs
            text = self.tokenizer.apply_chat_template(
                args["messages"], add_generation_prompt=True, **args.get("template_kwargs", {})
            )
        else:
            text = args["prompt"]
        if not text:
            raise ValueError("the prompt is empty")
        self.check_length(text)
        # raw text gets the tokenizer's special tokens (BOS where its config asks); a chat
        # template carries its own
        ids = self.tokenizer.encode(text, add_special_tokens="messages" not in args)
        if not ids:
            raise ValueError("the prompt has no tokens")
        return {"prompt_ids": ids}

    @staticmethod
    def is_small(prompts: list[dict]) -> bool:
        """Whether these add_request arguments are at most INLINE_PROMPT_CHARS characters (or
        token ids) in all, counting 64 per chat message for its template (and the tools'
        JSON): cheap enough to prepare on the event loop."""
        size = 0
        for args in prompts:
            if "messages" in args:
                size += sum(64 + len(str(m.get("content") or "")) for m in args["messages"])
                if "tools" in args.get("template_kwargs", {}):
                    size += len(json.dumps(args["template_kwargs"]["tools"]))
            else:
                size += len(args.get("prompt") or args.get("prompt_ids") or ())
        return size <= INLINE_PROMPT_CHARS

    def check_length(self, text: str) -> None:
        if self.max_token_chars is None:
            return
        at_least = -(-len(text) // self.max_token_chars)
        if at_least >= self.max_model_len:  # a prompt must leave room for one new token
            raise RequestRejected(
                f"the prompt has at least {at_least} tokens ({len(text)} characters); "
                f"this model's context is {self.max_model_len} tokens"
            )

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        if not ids:
            raise ValueError("the prompt is empty")
        for i, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"prompt[{i}] = {token} is not a token id (0 <= id < {self.vocab_size})"
                )
        return list(ids)
