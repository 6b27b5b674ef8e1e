"""``GET /metrics``: the proxy's counters in Prometheus's text format (0.0.4), written by hand.

Three kinds are enough here: counters, histograms, and gauges read at scrape
time from the state's owner (the upstreams), so no value is kept twice. Every
label set the proxy can produce is there from the start, at zero: a series
that appears only on its first increment makes ``rate()`` miss that increment.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from .upstreams import Role, Upstream

__all__ = ["CONTENT_TYPE", "Outcome", "ProxyMetrics"]

#: The content type of Prometheus's text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Upper bounds of the latency histogram's buckets, seconds: a one-token prefill to a long generation.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

Labels = tuple[str, ...]  # label values, in the order of the family's label names


class Outcome(str, enum.Enum):
    """How one request to one upstream ended."""

    OK = "ok"  # a 2xx answer, relayed in full
    CLIENT_ERROR = "client_error"  # a 4xx answer (the request's fault), passed to the client as is
    ERROR = "error"  # unreachable, too slow, a 5xx, a broken answer or stream
    CANCELLED = "cancelled"  # the client went away first


class _Family:
    """What every metric family has: a name, a help line, a type, label names."""

    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str]) -> None:
        self.name, self.help, self.labels = name, help, tuple(labels)

    def lines(self) -> Iterator[str]:
        """The family in the text format: HELP, TYPE, then its samples."""
        yield f"# HELP {self.name} {self.help}"  # the help texts are ours: no backslash or newline to escape
        yield f"# TYPE {self.name} {self.kind}"
        yield from self.samples()

    def samples(self) -> Iterator[str]:
        """The sample lines."""
        raise NotImplementedError

    def _sample(self, suffix: str, values: Labels, value: float, extra: str = "") -> str:
        pairs = [f'{k}="{_escape(v)}"' for k, v in zip(self.labels, values)] + ([extra] if extra else [])
        return f"{self.name}{suffix}{{{','.join(pairs)}}} {_number(value)}" if pairs else f"{self.name}{suffix} {_number(value)}"


class Counter(_Family):
    """A count that only goes up, per label set."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str], initial: Iterable[Labels]) -> None:
        super().__init__(name, help, labels)
        self._values = dict.fromkeys(initial, 0.0)

    def inc(self, *values: str) -> None:
        """Add one to the count of this label set."""
        self._values[values] = self._values.get(values, 0.0) + 1

    def samples(self) -> Iterator[str]:
        for values, value in self._values.items():
            yield self._sample("", values, value)


class Gauge(_Family):
    """A value read from its owner at each scrape."""

    kind = "gauge"

    def __init__(self, name: str, help: str, labels: Sequence[str], read: Callable[[], Iterable[tuple[Labels, float]]]) -> None:
        super().__init__(name, help, labels)
        self._read = read

    def samples(self) -> Iterator[str]:
        for values, value in self._read():
            yield self._sample("", values, value)


class Histogram(_Family):
    """Observations counted into cumulative buckets, with their sum and count, per label set."""

    kind = "histogram"

    def __init__(self, name: str, help: str, labels: Sequence[str], initial: Iterable[Labels], buckets: Sequence[float]) -> None:
        super().__init__(name, help, labels)
        self.buckets = (*sorted(buckets), math.inf)
        self._counts = {values: [0] * len(self.buckets) for values in initial}  # per bucket, not cumulative
        self._sums = dict.fromkeys(self._counts, 0.0)

    def observe(self, values: Labels, value: float) -> None:
        """Count ``value`` for this label set."""
        counts = self._counts.setdefault(values, [0] * len(self.buckets))
        counts[next(i for i, bound in enumerate(self.buckets) if value <= bound)] += 1
        self._sums[values] = self._sums.get(values, 0.0) + value

    def samples(self) -> Iterator[str]:
        for values, counts in self._counts.items():
            total = 0
            for bound, count in zip(self.buckets, counts):
                total += count
                yield self._sample("_bucket", values, total, f'le="{_number(bound)}"')
            yield self._sample("_sum", values, self._sums[values])
            yield self._sample("_count", values, total)


class ProxyMetrics:
    """The proxy's series (see docs/vllm.md, "/metrics"), over these upstreams; ``extra``: other owners' families, rendered after."""

    def __init__(self, upstreams: Sequence[Upstream], extra: Sequence[_Family] = ()) -> None:
        names = [(u.url, u.role.value) for u in upstreams]
        roles = [(r.value,) for r in Role]
        self.requests = Counter(
            "hixl_proxy_requests_total",
            "Requests sent to an upstream, by how they ended (ok, client_error, error, cancelled).",
            ("upstream", "role", "outcome"),
            [(*n, o.value) for n in names for o in Outcome],
        )
        self.retries = Counter(
            "hixl_proxy_retries_total",
            "Requests tried again from prefill after an upstream of this role failed them before any byte reached the client.",
            ("role",),
            roles,
        )
        self.unavailable = Counter(
            "hixl_proxy_unavailable_total",
            "Requests answered 503 because no upstream of this role was up.",
            ("role",),
            roles,
        )
        self.latency = Histogram(
            "hixl_proxy_upstream_seconds",
            "Seconds from sending a request to an upstream to the end of its answer (decode: of the whole stream).",
            ("upstream", "role"),
            names,
            LATENCY_BUCKETS,
        )
        self._families: list[_Family] = [
            self.requests,
            self.retries,
            self.unavailable,
            self.latency,
            Gauge(
                "hixl_proxy_upstream_up",
                "1 while an upstream takes new requests, 0 while it is marked down.",
                ("upstream", "role"),
                lambda: [((u.url, u.role.value), float(u.up)) for u in upstreams],
            ),
            Gauge(
                "hixl_proxy_upstream_outstanding",
                "Requests an upstream is serving for the proxy now.",
                ("upstream", "role"),
                lambda: [((u.url, u.role.value), float(u.outstanding)) for u in upstreams],
            ),
            *extra,
        ]

    def hop(self, up: Upstream, outcome: Outcome, seconds: float) -> None:
        """One request to ``up`` ended with ``outcome`` after ``seconds``."""
        self.requests.inc(up.url, up.role.value, outcome.value)
        self.latency.observe((up.url, up.role.value), seconds)

    def render(self) -> str:
        """Every series, in the text format."""
        return "\n".join(line for family in self._families for line in family.lines()) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value == int(value) else repr(value)
