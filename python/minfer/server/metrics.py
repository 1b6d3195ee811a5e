"""Server counters in the Prometheus text exposition format (version 0.0.4).

Counters are bumped from the scheduler thread and the event loop; a lock keeps the
read of several of them consistent. Gauges that belong to the scheduler (queue depth,
busy slots) are read from it when /metrics is scraped.
"""

from __future__ import annotations

import collections
import threading
import time


class Metrics:
    WINDOW_S = 10.0  # tokens per second are measured over this trailing window

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()   # (endpoint, status) -> n
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.batch_tokens = 0
        self.batch_seqs = 0
        self.errors = 0
        self.queue_wait_s = 0.0
        self.started = 0
        self.drafted = 0                 # speculative jobs: tokens drafted and verified,
        self.accepted = 0                # and of those, kept
        self._recent: collections.deque = collections.deque()  # (time, generated tokens)

    # -- scheduler side ------------------------------------------------------------
    def on_start(self, waited_s: float) -> None:
        with self._lock:
            self.started += 1
            self.queue_wait_s += waited_s

    def on_step(self, n_seqs: int, n_tokens: int, seconds: float) -> None:
        with self._lock:
            self.steps += 1
            self.step_seconds += seconds
            self.batch_seqs += n_seqs
            self.batch_tokens += n_tokens

    def on_verify(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.drafted += drafted
            self.accepted += accepted

    def on_finish(self, usage: dict) -> None:
        now = time.monotonic()
        with self._lock:
            self.prompt_tokens += usage["prompt_tokens"]
            self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            self.generated_tokens += usage["completion_tokens"]
            self._recent.append((now, usage["completion_tokens"]))
            self._trim(now)

    def on_error(self) -> None:
        with self._lock:
            self.errors += 1

    # -- app side --------------------------------------------------------------------
    def on_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self.WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / self.WINDOW_S

    def render(self, queue_depth: int, slots_busy: int, n_slots: int, graph_builds: int = 0) -> str:
        tps = self.tokens_per_second()
        with self._lock:
            lines = []

            def metric(name, kind, help_, samples):
                lines.append(f"# HELP minfer_{name} {help_}")
                lines.append(f"# TYPE minfer_{name} {kind}")
                for labels, v in samples:
                    lab = "{" + ",".join(f'{k}="{val}"' for k, val in labels.items()) + "}" if labels else ""
                    lines.append(f"minfer_{name}{lab} {v}")

            metric("requests_total", "counter", "HTTP requests answered, by endpoint and status.",
                   [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [({}, self.prompt_tokens)])
            metric("prompt_cached_tokens_total", "counter", "Prompt tokens reused from a slot's KV.",
                   [({}, self.cached_tokens)])
            metric("generated_tokens_total", "counter", "Tokens generated.", [({}, self.generated_tokens)])
            metric("inference_errors_total", "counter", "Requests failed by a backend fault.", [({}, self.errors)])
            metric("speculative_drafted_tokens_total", "counter",
                   "Tokens drafted by prompt lookup and verified (speculating requests).", [({}, self.drafted)])
            metric("speculative_accepted_tokens_total", "counter", "Drafted tokens the target kept.",
                   [({}, self.accepted)])
            metric("steps_total", "counter", "Batched forward steps.", [({}, self.steps)])
            metric("step_seconds_total", "counter", "Time spent in forward steps.", [({}, round(self.step_seconds, 6))])
            metric("batch_sequences_total", "counter", "Sequences summed over steps (mean batch = this / steps).",
                   [({}, self.batch_seqs)])
            metric("batch_tokens_total", "counter", "Token rows summed over steps.", [({}, self.batch_tokens)])
            metric("queue_wait_seconds_total", "counter", "Time requests waited for a slot.",
                   [({}, round(self.queue_wait_s, 6))])
            metric("graph_builds_total", "counter", "Graphs built (one per new batch shape; the rest are reused).",
                   [({}, graph_builds)])
            metric("queue_depth", "gauge", "Requests waiting for a slot.", [({}, queue_depth)])
            metric("slots_busy", "gauge", "Slots generating now.", [({}, slots_busy)])
            metric("slots_total", "gauge", "Slots (sequences of the KV arena).", [({}, n_slots)])
            metric("tokens_per_second", "gauge", f"Generated tokens per second over the last {self.WINDOW_S:g} s.",
                   [({}, round(tps, 3))])
        return "\n".join(lines) + "\n"
