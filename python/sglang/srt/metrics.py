"""Prometheus metrics of the HTTP server (``--enable-metrics``, served at ``/metrics``).

Counters and latency histograms are fed by the HTTP layer, which sees every output: one
:class:`RequestTracker` per HTTP request observes each output dict (stream chunks are
cumulative). Time to first token and inter-token latency are only measurable for streamed
requests, so only those feed the two histograms. Gauges (running, waiting, KV usage) are read
from the scheduler's internal state when ``/metrics`` is scraped.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from sglang.srt.managers.tokenizer_manager_protocol import TokenizerManagerProtocol

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    20.0, 40.0, 80.0,
)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class RequestTracker:
    """Latency bookkeeping of one HTTP request (possibly a batch of several choices)."""

    def __init__(self, metrics: ServerMetrics, stream: bool) -> None:
        self._metrics = metrics
        self._stream = stream
        self._start = time.perf_counter()
        self._num_tokens: dict[int, int] = {}
        self._last_time: dict[int, float] = {}
        self._done: set[int] = set()

    def observe(self, out: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Record one output (or a list of final outputs). Mutates the server's metrics."""
        if isinstance(out, list):
            for i, item in enumerate(out):
                self._observe_one(i, item)
        else:
            self._observe_one(out.get("index", 0), out)

    def _observe_one(self, index: int, out: dict[str, Any]) -> None:
        meta = out.get("meta_info", {})
        now = time.perf_counter()
        num_tokens = meta.get("completion_tokens", 0)
        prev = self._num_tokens.get(index, 0)
        if self._stream and num_tokens > prev:
            if prev == 0:
                self._metrics.time_to_first_token.observe(now - self._start)
            else:
                per_token = (now - self._last_time[index]) / (num_tokens - prev)
                self._metrics.inter_token_latency.observe(per_token)
            self._last_time[index] = now
        self._num_tokens[index] = num_tokens
        if meta.get("finish_reason") and index not in self._done:
            self._done.add(index)
            self._metrics.num_requests.inc()
            self._metrics.prompt_tokens.inc(meta.get("prompt_tokens", 0))
            self._metrics.generation_tokens.inc(num_tokens)
            self._metrics.e2e_latency.observe(now - self._start)


class ServerMetrics:
    """The server's metrics, in a private registry (so several servers in one process, as in
    tests, do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_requests = Counter(
            "sglang:num_requests", "Number of finished requests.", registry=r)
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(
            "sglang:generation_tokens", "Number of tokens generated.", registry=r)
        self.num_running_reqs = Gauge(
            "sglang:num_running_reqs", "Requests in the running batch.", registry=r)
        self.num_queue_reqs = Gauge(
            "sglang:num_queue_reqs", "Requests in the waiting queue.", registry=r)
        self.token_usage = Gauge(
            "sglang:token_usage", "Fraction of the KV pool in use (0 to 1).", registry=r)
        self.available_kv_tokens = Gauge(
            "sglang:available_kv_tokens", "Free KV-cache token slots.", registry=r)
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds", "Time to first token (streamed requests).",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "sglang:inter_token_latency_seconds", "Time between output tokens (streamed).",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "sglang:e2e_request_latency_seconds", "Request latency, arrival to last token.",
            buckets=_E2E_BUCKETS, registry=r)

    def new_request(self, stream: bool) -> RequestTracker:
        return RequestTracker(self, stream)

    async def refresh(
        self, tokenizer_manager: TokenizerManagerProtocol, max_total_tokens: int | None
    ) -> None:
        """Update the gauges from the scheduler's internal state (one round trip)."""
        states = await tokenizer_manager.get_internal_state()
        state = states[0] if states else {}
        self.num_running_reqs.set(sum(s.get("running_batch_size", 0) for s in states))
        self.num_queue_reqs.set(sum(s.get("waiting_queue_size", 0) for s in states))
        available = state.get("available_kv_tokens")
        if available is not None:  # summed over the DP ranks (each has its own KV pool)
            available = sum(s.get("available_kv_tokens", 0) for s in states)
            self.available_kv_tokens.set(available)
            total = sum(s.get("max_total_num_tokens", max_total_tokens or 0) for s in states)
            if total:
                self.token_usage.set(max(0.0, 1.0 - available / total))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _NullTracker:
    def observe(self, out: Any) -> None:
        """Metrics are disabled: nothing to record."""


class NoMetrics:
    """Stands in for :class:`ServerMetrics` when metrics are disabled."""

    _tracker = _NullTracker()

    def new_request(self, stream: bool) -> _NullTracker:
        return self._tracker
