"""The offline batch API: many prompts in, all answers out, with continuous batching."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from .config import EngineConfig
from .engine import Engine
from .outputs import RequestMetrics
from .request import FinishReason
from .sampling_params import SamplingParams
from .validation import ParameterTypeError, is_int

# A prompt: text, token ids, or (as vLLM takes them) {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | Mapping
Conversation = Sequence[Mapping]


@dataclass(frozen=True, slots=True)
class Generation:
    """One finished request: its text, ids, why it stopped and its metrics."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    metrics: RequestMetrics
    error: str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    # n > 1: every sample (this one is samples[0]); logprobs per token when asked for
    samples: tuple[Generation, ...] = ()
    logprobs: tuple = ()


class LLM:
    """LLM(model=None, **engine_config).generate(prompts, SamplingParams(...)).

    tensor_parallel_size=N runs the model on N ranks (see parallel/); `close()` (or `with`)
    stops their workers and gives the GPU memory back. `generate` takes one prompt or a list
    of them, each text or token ids (list[int]);
    `chat` takes one conversation (a list of messages) or a list of them and renders each with
    the model's chat template. Answers come back as a list, in input order."""

    def __init__(self, model: str | None = None, **config):
        self.engine = Engine.from_config(EngineConfig(model=model, **config))

    def close(self) -> None:
        """Stop tensor-parallel workers now (they also stop when this process exits) and, on a
        GPU, give back the device memory (KV cache, CUDA graphs, weights), so that another LLM
        created next in this process can have it. `with LLM(...) as llm:` closes at the end."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Generation]:
        return self._run([_prompt_args(p) for p in _prompt_list(prompts)], params, use_tqdm)

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Generation]:
        if isinstance(conversations, (str, bytes, Mapping)) or not isinstance(
            conversations, Sequence
        ):
            raise ParameterTypeError(
                f"conversations must be a list of messages or a list of such lists, "
                f"got {conversations!r}"
            )
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # one conversation
        return self._run([{"messages": m} for m in conversations], params, use_tqdm)

    def _run(self, inputs: list[dict], params, use_tqdm: bool) -> list[Generation]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(inputs)
        params = list(params)
        if len(params) != len(inputs):
            raise ValueError(f"{len(params)} sampling params for {len(inputs)} prompts")
        order: dict[str, int] = {}
        samples: dict[str, list] = {}  # per request: per sample [texts, logprobs, final]
        try:
            for i, (item, p) in enumerate(zip(inputs, params, strict=True)):
                request = self.engine.add_request(params=p, **item)
                order[request.request_id] = i
                samples[request.request_id] = [[[], [], None] for _ in range(p.n)]
        except Exception:
            for request_id in order:  # a bad prompt: the ones before it do not linger
                self.engine.abort(request_id)
            raise
        results: list[Generation | None] = [None] * len(inputs)
        bar = tqdm(total=len(inputs), disable=not use_tqdm or len(inputs) < 8, unit="req")
        for output in self.engine.run_until_done():
            key = output.parent_id or output.request_id
            if key not in order:
                continue  # someone else's request on the same engine
            state = samples[key][output.index]
            state[0].append(output.text)
            state[1].extend(output.logprobs or ())
            if output.finished:
                state[2] = output
                if all(s[2] is not None for s in samples[key]):
                    done = [_generation(*s) for s in samples.pop(key)]
                    first = done[0]
                    results[order[key]] = dataclasses.replace(
                        first, samples=tuple(done) if len(done) > 1 else ()
                    )
                    bar.update(1)
        bar.close()
        if self.engine.broken is not None:  # a TP rank died: say which, after failing all
            raise self.engine.broken
        return results  # type: ignore[return-value]


def _generation(texts: list[str], logprobs: list, final) -> Generation:
    return Generation(
        "".join(texts),
        final.output_token_ids,
        final.finish_reason,
        final.metrics,
        final.error,
        final.prompt_token_ids,
        logprobs=tuple(logprobs),
    )


def _prompt_list(prompts) -> list:
    """One prompt (text, token ids, a dict) or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise ParameterTypeError(
            f"prompts must be a string, a list of token ids or a list of those, got {prompts!r}"
        )
    if prompts and is_int(prompts[0]):
        return [prompts]  # one prompt as token ids
    return list(prompts)


def _prompt_args(prompt) -> dict:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, Mapping):
        if set(prompt) == {"prompt"}:
            return {"prompt": prompt["prompt"]}
        if set(prompt) == {"prompt_token_ids"}:
            return {"prompt_ids": prompt["prompt_token_ids"]}
        raise ValueError(f'a prompt dict has "prompt" or "prompt_token_ids", got {prompt!r}')
    return {"prompt_ids": prompt}
