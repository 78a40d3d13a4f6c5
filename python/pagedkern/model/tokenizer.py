"""Tokenizer: a HF `tokenizers` backend plus what serving needs around it (special tokens, stop
ids, the chat template), saved and loaded as a HF tokenizer folder (tokenizer.json +
tokenizer_config.json). Streaming detokenization lives in engine/detokenizer.py."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from .chat_template import Message, render_chat
from .config_checks import token_ids
from .errors import ModelLoadError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Texts (characters) and id lists longer than this go through the tokenizers library's batch
# calls, which release the GIL (its single calls hold it: an 8 MB text tokenized in a worker
# thread stalled the server's event loop for seconds); shorter ones skip the batch call's cost.
GIL_FREE_SIZE = 65536
# End-of-turn / end-of-text markers of common chat formats: generation stops on any present.
END_MARKERS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
    "<eos>",  # (Gemma's: a converted file may name no EOS)
)


class Tokenizer:
    """Text <-> token ids and chat rendering for one model.

    encode/decode wrap the backend; apply_chat_template renders like HF's; stop_token_ids is the
    set of ids that end generation (eos plus the chat format's end-of-turn markers).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
    ):
        self.backend = backend
        self._token_texts: dict[int, str] = {}  # token_text's, by id
        self.special_tokens = {k: special_tokens.get(k) for k in SPECIAL_TOKEN_KEYS}
        self.chat_template = chat_template
        # (ids past the vocabulary dropped: no token to stop on, and llguidance refuses them)
        stops = {i for i in extra_stop_ids if 0 <= i < self.vocab_size}
        for token in (self.special_tokens["eos_token"], *END_MARKERS):
            token_id = backend.token_to_id(token) if token else None
            if token_id is not None:
                stops.add(token_id)
        self.stop_token_ids = frozenset(stops)

    # --- ids -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (may be below the model's vocab_size)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens[key]
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    # --- text ------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. "<|im_end|>") become
        their single ids. add_special_tokens=True lets the tokenizer's post-processor add what
        the model expects around raw text (e.g. Llama 3's BOS); chat prompts already carry
        theirs from the template, so the default is False, as in apply_chat_template."""
        if len(text) > GIL_FREE_SIZE:  # (the same ids; the batch call lets other threads run)
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if len(ids) > GIL_FREE_SIZE:
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text `token_id` adds after other text (a logprob's token string): its text after
        an anchor's, since a SentencePiece decoder strips the space a sequence begins with
        ("▁Paris" alone decodes to "Paris", after "a" to " Paris"); cached per id."""
        text = self._token_texts.get(token_id)
        if text is None:  # (special tokens shown, as decode shows them by default)
            anchor, decode = self._anchor, self.backend.decode
            start = len(decode(anchor, skip_special_tokens=False))
            text = decode([*anchor, int(token_id)], skip_special_tokens=False)[start:]
            self._token_texts[token_id] = text
        return text

    @cached_property
    def _anchor(self) -> list[int]:
        return self.backend.encode("a", add_special_tokens=False).ids

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most text characters one token can stand for, or None where no such bound
        holds. Where it holds (byte-level BPE, or BPE with byte fallback, with no normalizer
        that could shrink the text) a text of n characters has at least n / max_token_chars
        tokens: a prompt too long for a context can be refused without tokenizing it."""
        try:
            spec = json.loads(self.backend.to_str())
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
        # (a byte-level token's string has a symbol per byte: at least its characters)
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=0) or None

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """The prompt text for `messages` (or its ids with tokenize=True), rendered like HF's
        apply_chat_template. kwargs: continue_final_message, tools, documents and template
        variables. The default add_generation_prompt=True ends with the assistant header."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=")
        text = render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )
        return self.encode(text) if tokenize else text

    # --- files -----------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (HF layout) into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {**self.special_tokens, "chat_template": self.chat_template}
        config["pagedkern_stop_token_ids"] = sorted(self.stop_token_ids)
        (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load a HF tokenizer folder: tokenizer.json, tokenizer_config.json (special tokens,
        chat_template), and where present chat_template.jinja and generation_config.json."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(folder, "no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(path, f"unreadable tokenizer: {exc}") from None
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path) or {}
        special = {k: _token_content(config.get(k), k, config_path) for k in SPECIAL_TOKEN_KEYS}
        template = _pick_template(config.get("chat_template"), config_path)
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            try:
                template = jinja.read_text()
            except UnicodeDecodeError as exc:
                raise ModelLoadError(jinja, f"not UTF-8 text: {exc}") from None
        key = "pagedkern_stop_token_ids"
        stops = token_ids(config.get(key, []), key, config_path)
        generation = folder / "generation_config.json"
        eos = (_read_json(generation) or {}).get("eos_token_id")
        stops += [] if eos is None else token_ids(eos, "eos_token_id", generation)
        return cls(backend, special, template, stops)


# Normalizers that never turn characters into fewer (Replace is checked for that).
_NON_SHRINKING = {"Sequence", "Prepend", "Replace"}


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


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(path, f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(path, "must hold a JSON object")
    return data


def _token_content(value, key: str, path: Path) -> str | None:
    """tokenizer_config.json spells a special token as a string or an AddedToken dict."""
    content = value.get("content") if isinstance(value, dict) else value
    if content is not None and not isinstance(content, str):
        raise ModelLoadError(path, f"{key} must be a string or an AddedToken, got {value!r}")
    return content


def _pick_template(value, path: Path) -> str | None:
    """chat_template is a string, or a list of named templates of which "default" is used."""
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
            raise ModelLoadError(path, "chat_template: a list entry lacks a template string")
        named = {t.get("name"): t["template"] for t in value}
        return named.get("default") or next(iter(named.values()), None)
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(path, f"chat_template must be a string, got {type(value).__name__}")
    return value
