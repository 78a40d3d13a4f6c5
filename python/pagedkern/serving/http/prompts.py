"""Turning a request's prompt into token ids, off the engine thread.

The HTTP handlers hand the engine token ids only. They render the chat template and tokenize a
big prompt in a worker thread (`asyncio.to_thread`), so it never stalls the other streams, and
a small one (`is_small`: at most INLINE_PROMPT_CHARS characters in all) on the event loop:
there, tens of µs of tokenizing cost less than the thread hop and the GIL hand-offs around it,
and a burst of requests reaches the engine together instead of one per hop. Before
tokenizing, a prompt whose characters alone prove it cannot fit the context is refused
(`check_prompt_length`, as the engine's own admission does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ...engine.admission import check_prompt_length
from ...model import Tokenizer

INLINE_PROMPT_CHARS = 2048  # prompts (text, template contents or ids) prepared on the loop


class PromptPreparer:
    """add_request arguments -> {"prompt_ids": [...]}, in whatever thread calls it (the
    tokenizer is thread-safe; the engine is not touched)."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

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
        check_prompt_length(self.tokenizer, text, self.max_model_len)
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

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        if not ids:
            raise ValueError("the prompt is empty")
        for i, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"prompt[{i}] = {token} is not a token id (0 <= id < {self.vocab_size})"
                )
        return list(ids)
