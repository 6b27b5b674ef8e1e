"""The connector's stats on their way through vLLM: recorded, taken, sent as a dict, rebuilt, summed, exposed.

No engine: this follows the path vLLM 0.32 gives connector stats (worker ->
plain dict -> ``build_kv_connector_stats`` / ``build_prom_metrics``) with a
real Prometheus registry of its own. ``test_serve.py`` checks the same series
on real servers' ``/metrics``.
"""

from __future__ import annotations

import functools
import pickle

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402

from hixl.vllm import HixlConnector  # noqa: E402
from hixl.vllm._stats import HixlKVConnectorStats  # noqa: E402


def recorded() -> HixlKVConnectorStats:
    stats = HixlKVConnectorStats()
    stats.record_pull(3 << 20, 0.004, 0.001)
    stats.record_pull(1 << 20, 0.002, 0.002)
    stats.record_failed_pull()
    stats.record_release(expired=False)
    stats.record_release(expired=True)
    return stats


def test_take_hands_over_once_and_starts_afresh() -> None:
    stats = HixlKVConnectorStats()
    assert stats.is_empty() and stats.take() is None  # vLLM then sends nothing for this step
    stats.record_release(expired=False)
    taken = stats.take()
    assert taken is not None and taken.data["released"] == 1
    assert stats.is_empty() and stats.take() is None


def test_the_dict_vllm_sends_rebuilds_and_aggregates() -> None:
    data = pickle.loads(pickle.dumps(recorded().to_dict()))  # what crosses vLLM's process boundary
    rebuilt = HixlConnector.build_kv_connector_stats(data)
    assert isinstance(rebuilt, HixlKVConnectorStats)
    both = rebuilt.aggregate(HixlConnector.build_kv_connector_stats(recorded().to_dict()))  # type: ignore[arg-type]
    assert both.data["pull_bytes"] == [3 << 20, 1 << 20] * 2 and both.data["failed_pulls"] == 2
    assert HixlConnector.build_kv_connector_stats().is_empty()  # type: ignore[union-attr]
    summary = both.reduce()
    assert summary["Num pulls"] == 4 and summary["MiB pulled"] == 8.0
    assert summary["Avg pull time (ms)"] == 3.0 and summary["Avg first layer usable (ms)"] == 1.5
    assert summary["Throughput (MiB/s)"] == round(8 / 0.012, 3)
    assert (summary["Num failed pulls"], summary["Num released"], summary["Num released unpulled"]) == (2, 2, 2)


def test_an_interval_of_failures_alone_is_reported() -> None:
    stats = HixlKVConnectorStats()
    stats.record_failed_pull()
    assert not stats.is_empty()
    assert stats.reduce()["Num pulls"] == 0 and stats.reduce()["Num failed pulls"] == 1


def test_prometheus_series() -> None:
    registry = CollectorRegistry()
    kinds = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    from vllm.config import VllmConfig

    metrics = HixlConnector.build_prom_metrics(VllmConfig(), kinds, ["model_name", "engine"], {0: ["m", "0"]})  # type: ignore[arg-type]
    before = generate_latest(registry).decode()
    for name in ("pulled_bytes_total", "failed_pulls_total", "released_requests_total", "expired_requests_total", "pull_seconds_count"):
        assert f'vllm:hixl_{name}{{engine="0",model_name="m"}} 0.0' in before  # there from the start, at 0
    metrics.observe(recorded().to_dict(), 0)
    sample = functools.partial(registry.get_sample_value, labels={"model_name": "m", "engine": "0"})
    assert sample("vllm:hixl_pulled_bytes_total") == 4 << 20
    assert sample("vllm:hixl_pull_seconds_count") == 2 and sample("vllm:hixl_pull_seconds_sum") == pytest.approx(0.006)
    assert sample("vllm:hixl_first_layer_seconds_sum") == pytest.approx(0.003)
    assert registry.get_sample_value("vllm:hixl_pull_seconds_bucket", {"model_name": "m", "engine": "0", "le": "0.0025"}) == 1
    assert sample("vllm:hixl_failed_pulls_total") == 1
    assert sample("vllm:hixl_released_requests_total") == 1 and sample("vllm:hixl_expired_requests_total") == 1
