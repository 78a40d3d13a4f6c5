"""Server metrics in the Prometheus text format (version 0.0.4), without a client library.

The front end's client records as the core's messages arrive (TTFT, inter-token latency,
end-to-end latency, tokens, finished and rejected requests); /metrics renders, adding the
gauges the core reports on request (messages.EngineGauges: requests running / waiting, KV
blocks in use / total, speculative decoding, shadow mode). One lock guards the counters, so a
scrape sees a consistent snapshot.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

from .messages import EngineGauges

PREFIX = "pagedkern_"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


class Histogram:
    """Cumulative buckets (`le`), sum and count, as Prometheus histograms expose them."""

    def __init__(self, buckets: Sequence[float]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out.append(f"{name}_sum {self.sum!r}")
        out.append(f"{name}_count {self.count}")
        return out


class ServerMetrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # by the engine's finish reason
        self.rejected: dict[str, int] = {}  # by error code (queue_full, context_length_exceeded...)

    # --- recording (engine thread) ----------------------------------------------------------
    def request_added(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens

    def request_rejected(self, code: str) -> None:
        with self.lock:
            self.rejected[code] = self.rejected.get(code, 0) + 1

    def tokens(self, n: int, ttft: float | None, itl: float | None) -> None:
        with self.lock:
            self.generation_tokens += n
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None:
                self.itl.observe(itl)

    def later_tokens(self, itls: list[float]) -> None:
        """Tokens that each follow their sample's last one by these latencies (a frame's
        worth, under one lock)."""
        with self.lock:
            self.generation_tokens += len(itls)
            observe = self.itl.observe
            for itl in itls:
                observe(itl)

    def request_finished(self, reason: str, latency: float) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(latency)

    # --- rendering (HTTP thread) ------------------------------------------------------------
    @staticmethod
    def _shadow_lines(rows: list, metric) -> None:
        """Shadow mode's per op and layer readings (layer -1: outside the layers, the LM
        head)."""
        p = PREFIX

        def labels(op, layer):
            return f'{{op="{op}",layer="{layer}"}}'

        metric(
            "shadow_max_relative_error",
            "gauge",
            "Shadow mode: the largest relative error of an op against its PyTorch reference.",
            [f"{p}shadow_max_relative_error{labels(r[0], r[1])} {r[3]!r}" for r in rows],
        )
        metric(
            "shadow_divergences_total",
            "counter",
            "Shadow mode: op outputs with a row beyond the op's tolerance.",
            [f"{p}shadow_divergences_total{labels(r[0], r[1])} {r[4]}" for r in rows],
        )
        metric(
            "shadow_calls_total",
            "counter",
            "Shadow mode: op calls checked against their reference.",
            [f"{p}shadow_calls_total{labels(r[0], r[1])} {r[2]}" for r in rows],
        )

    def render(self, gauges: EngineGauges | None, model: str) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.append(f"# HELP {PREFIX}{name} {help_}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            lines.extend(samples)

        p = PREFIX
        if gauges is not None:
            for name, value, help_ in (
                ("num_requests_running", gauges.running, "Requests in the running batch."),
                ("num_requests_waiting", gauges.waiting, "Requests waiting for a batch slot."),
                ("kv_blocks_used", gauges.kv_blocks_used, "KV cache blocks held by requests."),
                ("kv_blocks_total", gauges.kv_blocks_total, "KV cache blocks in the pool."),
            ):
                metric(name, "gauge", help_, [f"{p}{name} {value}"])
            if gauges.kv_blocks_by_kind:  # per-kind tables: the blocks each layer kind holds
                for name, column, help_ in (
                    ("kv_blocks_used_by_kind", 1, "KV cache blocks held, per layer kind."),
                    ("kv_blocks_peak_by_kind", 2, "Most KV cache blocks held, per layer kind."),
                ):
                    samples = [
                        f'{p}{name}{{kind="{row[0]}"}} {row[column]}'
                        for row in gauges.kv_blocks_by_kind
                    ]
                    metric(name, "gauge", help_, samples)
            for name, value, help_ in (
                ("spec_decode_num_steps_total", gauges.spec_steps, "Speculative steps."),
                ("spec_decode_num_draft_tokens_total", gauges.spec_proposed, "Proposed tokens."),
                (
                    "spec_decode_num_accepted_tokens_total",
                    gauges.spec_accepted,
                    "Proposed tokens accepted.",
                ),
            ):
                metric(name, "counter", help_, [f"{p}{name} {value}"])
            proposed, steps = gauges.spec_proposed, gauges.spec_steps
            for name, value, help_ in (
                (
                    "spec_decode_acceptance_rate",
                    gauges.spec_accepted / proposed if proposed else 0.0,
                    "Accepted / proposed tokens.",
                ),
                (
                    "spec_decode_mean_accepted_length",
                    gauges.spec_accepted / steps if steps else 0.0,
                    "Accepted tokens per speculative step.",
                ),
            ):
                metric(name, "gauge", help_, [f"{p}{name} {value!r}"])
            if gauges.shadow is not None:
                self._shadow_lines(gauges.shadow, metric)
        with self.lock:
            metric(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of admitted requests.",
                [f"{p}prompt_tokens_total {self.prompt_tokens}"],
            )
            metric(
                "generation_tokens_total",
                "counter",
                "Tokens generated.",
                [f"{p}generation_tokens_total {self.generation_tokens}"],
            )
            metric(
                "request_finished_total",
                "counter",
                "Finished requests by the engine's finish reason.",
                [
                    f'{p}request_finished_total{{finish_reason="{k}"}} {v}'
                    for k, v in self.finished.items()
                ],
            )
            metric(
                "request_rejected_total",
                "counter",
                "Requests refused at admission, by error code.",
                [f'{p}request_rejected_total{{code="{k}"}} {v}' for k, v in self.rejected.items()],
            )
            for name, hist, help_ in (
                ("time_to_first_token_seconds", self.ttft, "Arrival to first token."),
                ("inter_token_latency_seconds", self.itl, "Time between consecutive tokens."),
                ("e2e_request_latency_seconds", self.e2e, "Arrival to finish."),
            ):
                metric(name, "histogram", help_, hist.lines(p + name))
        label = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        metric("model_info", "gauge", "The served model.", [f'{p}model_info{{model="{label}"}} 1'])
        return "\n".join(lines) + "\n"
