"""The connector's figures in vLLM's own stats: the periodic log line and each instance's ``/metrics``.

vLLM 0.32 carries connector stats like this: after each step, a worker's
connector hands over what it recorded since the last step
(``get_kv_connector_stats``); the scheduler sends that, as a plain dict, to
the front end, which rebuilds the object (``build_kv_connector_stats``) to log
a summary every few seconds and feeds the dict to the connector's Prometheus
metrics (``build_prom_metrics``), which vLLM's ``/metrics`` serves. So
:class:`HixlKVConnectorStats` must stay plain data (lists and ints), and
:class:`HixlPromMetrics` registers its series once, with vLLM's labels
(``model_name``, ``engine``).

Decode records each pull (bytes, transfer time, first layer usable), each
failed pull and each pull retried after its link broke; prefill records each request whose blocks it released: pulled by
decode (or never read: a TP rank holding only replicas), or unpulled — decode
released the lease, the lease ran out, or it reached ``release_timeout``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["SECONDS_BUCKETS", "HixlKVConnectorStats", "HixlPromMetrics"]

#: Upper bounds of the time histograms' buckets, seconds: a one-block pull on loopback to a slow link.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_PER_PULL = ("pull_bytes", "pull_seconds", "first_layer_seconds")  # one entry per successful pull
_COUNTS = ("failed_pulls", "retried_pulls", "released", "expired")


@dataclass
class HixlKVConnectorStats(KVConnectorStats):
    """What one worker recorded since it last handed its stats over (or several workers', aggregated)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Forget everything recorded."""
        self.data = {**{key: [] for key in _PER_PULL}, **dict.fromkeys(_COUNTS, 0)}

    def record_pull(self, nbytes: int, seconds: float, first_layer_seconds: float) -> None:
        """Decode: one request's KV landed, ``nbytes`` in ``seconds``, its first layer usable after ``first_layer_seconds``."""
        for key, value in zip(_PER_PULL, (nbytes, seconds, first_layer_seconds)):
            self.data[key].append(value)

    def record_failed_pull(self) -> None:
        """Decode: one request's pull failed (its blocks were reported to vLLM as load errors)."""
        self.data["failed_pulls"] += 1

    def record_retry(self) -> None:
        """Decode: one request's pull broke on its link and was retried after relinking (if the retry failed
        too, it is a failed pull as well)."""
        self.data["retried_pulls"] += 1

    def record_release(self, expired: bool) -> None:
        """Prefill: one request's blocks were released, pulled by decode or (``expired``) unpulled: decode released
        the lease, the lease ran out, or the hard cap ``release_timeout``."""
        self.data["expired" if expired else "released"] += 1

    def take(self) -> HixlKVConnectorStats | None:
        """What was recorded since the last call (None if nothing), and start afresh."""
        if self.is_empty():
            return None
        taken = copy.copy(self)
        self.reset()
        return taken

    def is_empty(self) -> bool:
        """Nothing recorded."""
        return not self.data["pull_bytes"] and not any(self.data[key] for key in _COUNTS)

    def aggregate(self, other: KVConnectorStats) -> HixlKVConnectorStats:
        """Add ``other``'s records to these (vLLM: several workers, or several steps in a log interval)."""
        for key in _PER_PULL:
            self.data[key].extend(other.data[key])
        for key in _COUNTS:
            self.data[key] += other.data[key]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The summary vLLM logs each interval ("KV Transfer metrics: ...")."""
        seconds = np.asarray(self.data["pull_seconds"], dtype=float)
        first = np.asarray(self.data["first_layer_seconds"], dtype=float)
        mib = sum(self.data["pull_bytes"]) / 2**20
        pulled = len(seconds)

        def ms(values: np.ndarray, q: float | None = None) -> float:
            if not len(values):
                return 0.0
            return round(float(values.mean() if q is None else np.percentile(values, q)) * 1e3, 3)

        return {
            "Num pulls": pulled,
            "MiB pulled": round(mib, 3),
            "Avg pull time (ms)": ms(seconds),
            "P90 pull time (ms)": ms(seconds, 90),
            "Avg first layer usable (ms)": ms(first),
            "Throughput (MiB/s)": round(mib / seconds.sum(), 3) if seconds.sum() > 0 else 0.0,
            "Num failed pulls": self.data["failed_pulls"],
            "Num retried pulls": self.data["retried_pulls"],
            "Num released": self.data["released"],
            "Num released unpulled": self.data["expired"],
        }


class HixlPromMetrics(KVConnectorPromMetrics):
    """The connector's ``vllm:hixl_*`` series on vLLM's ``/metrics`` (table in docs/vllm.md)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(kind: Any, name: str, documentation: str, **extra: Any) -> dict[int, Any]:
            metric = kind(name=name, documentation=documentation, labelnames=labelnames, **extra)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        counter, histogram = self._counter_cls, self._histogram_cls
        self.pulled_bytes = per_engine(counter, "vllm:hixl_pulled_bytes", "Bytes of KV cache decode pulled over hixl.")
        self.pull_seconds = per_engine(
            histogram,
            "vllm:hixl_pull_seconds",
            "Seconds from issuing a request's KV pull to its last layer landing (one observation per successful pull).",
            buckets=SECONDS_BUCKETS,
        )
        self.first_layer_seconds = per_engine(
            histogram,
            "vllm:hixl_first_layer_seconds",
            "Seconds from issuing a request's KV pull to its first layer being usable (= the pull's time in sync mode).",
            buckets=SECONDS_BUCKETS,
        )
        self.failed_pulls = per_engine(
            counter, "vllm:hixl_failed_pulls", "KV pulls that failed; their blocks went to vLLM as load errors."
        )
        self.retried_pulls = per_engine(
            counter,
            "vllm:hixl_retried_pulls",
            "KV pulls that broke on their link and were retried once after relinking (failed_pulls counts those that failed again).",
        )
        self.released = per_engine(
            counter, "vllm:hixl_released_requests", "Prefill: requests whose blocks were released after decode pulled them."
        )
        self.expired = per_engine(
            counter,
            "vllm:hixl_expired_requests",
            "Prefill: requests whose blocks were released unpulled: decode released them, their lease ran out, or release_timeout.",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one stats payload (:attr:`HixlKVConnectorStats.data`) to the series of engine ``engine_idx``."""
        data = transfer_stats_data
        if data["pull_bytes"]:
            self.pulled_bytes[engine_idx].inc(sum(data["pull_bytes"]))
        for seconds, first in zip(data["pull_seconds"], data["first_layer_seconds"]):
            self.pull_seconds[engine_idx].observe(seconds)
            self.first_layer_seconds[engine_idx].observe(first)
        counts = ((self.failed_pulls, "failed_pulls"), (self.retried_pulls, "retried_pulls"), (self.released, "released"), (self.expired, "expired"))
        for metric, key in counts:
            if data[key]:
                metric[engine_idx].inc(data[key])
