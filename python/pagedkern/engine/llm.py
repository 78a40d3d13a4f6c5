"""The offline batch API: many prompts in, all answers out, with continuous batching."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from .config import EngineConfig
from .engine import Engine
from .request import FinishReason
from .sampling_params import SamplingParams


@dataclass(slots=True)
class Generation:
    """One finished request: its text, ids, why it stopped and its metrics."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    metrics: dict
    error: str | None = None


class LLM:
    """LLM(model=None, **engine_config).generate(prompts, SamplingParams(...)).

    `generate` takes raw prompt strings; `chat` takes conversations (lists of messages) and
    renders them with the model's chat template. Answers come back in input order."""

    def __init__(self, model: str | None = None, **config):
        self.engine = Engine.from_config(EngineConfig(model=model, **config))

    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Generation]:
        return self._run([{"prompt": p} for p in prompts], params, use_tqdm)

    def chat(
        self,
        conversations: Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Generation]:
        return self._run([{"messages": m} for m in conversations], params, use_tqdm)

    def _run(self, inputs: list[dict], params, use_tqdm: bool) -> list[Generation]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError(f"{len(params)} sampling params for {len(inputs)} prompts")
        order = {}
        texts: dict[str, list[str]] = {}
        for i, (item, p) in enumerate(zip(inputs, params, strict=True)):
            request = self.engine.add_request(params=p, **item)
            order[request.request_id] = i
            texts[request.request_id] = []
        results: list[Generation | None] = [None] * len(inputs)
        bar = tqdm(total=len(inputs), disable=not use_tqdm or len(inputs) < 8, unit="req")
        for output in self.engine.run_until_done():
            texts[output.request_id].append(output.text)
            if output.finished:
                r = output.request
                results[order[r.request_id]] = Generation(
                    "".join(texts.pop(r.request_id)),
                    list(r.output_ids),
                    r.finish_reason,
                    r.metrics(),
                    r.error,
                )
                bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]
