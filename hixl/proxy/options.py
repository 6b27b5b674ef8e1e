"""The proxy's options, apart from the app so that ``hixl --help`` needs no aiohttp."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["KV_MODES", "EventsSource", "ProxyOptions", "unknown_sources"]

#: The values of ``ProxyOptions.kv_mode`` (``hixl proxy --kv-mode``).
KV_MODES = ("pull", "push")


@dataclass(frozen=True)
class EventsSource:
    """Where one vLLM instance publishes its KV-cache events (``--kv-events URL=ENDPOINT,REPLAY``)."""

    #: The instance's base URL, as given to ``--prefill`` or ``--decode`` (both, for an instance in both roles).
    url: str
    #: Its ZMQ PUB socket (vLLM's ``kv_events_config`` ``endpoint``), as the proxy connects to it: ``tcp://10.0.0.1:5557``.
    endpoint: str
    #: Its replay socket (``replay_endpoint``), likewise: ``tcp://10.0.0.1:5558``.
    replay: str

    @classmethod
    def parse(cls, text: str) -> EventsSource:
        """``URL=ENDPOINT,REPLAY``; ValueError saying what is missing."""
        url, equals, endpoints = text.rpartition("=")  # (the endpoints have no "="; a URL's query might)
        endpoint, comma, replay = endpoints.partition(",")
        if not (equals and comma and url and endpoint and replay) or "," in replay:
            raise ValueError(f"expected URL=ENDPOINT,REPLAY (e.g. http://10.0.0.1:8100=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558), not {text!r}")
        return cls(url.rstrip("/"), endpoint, replay)


def unknown_sources(sources: Iterable[EventsSource], urls: Iterable[str]) -> list[str]:
    """The URLs of ``sources`` that are none of the instances' ``urls`` (compared less a trailing ``/``)."""
    known = {url.rstrip("/") for url in urls}
    return [s.url for s in sources if s.url not in known]


@dataclass(frozen=True)
class ProxyOptions:
    """How long the proxy waits on upstreams and clients, how often it retries and checks, whose KV events it
    routes by (``hixl proxy``'s options of these names)."""

    #: The longest an upstream may keep the proxy waiting, seconds: a whole prefill, decode's
    #: first byte, and each gap between decode's chunks (a whole generation may take longer).
    timeout: float = 600.0
    #: Seconds to open a connection to an upstream.
    connect_timeout: float = 5.0
    #: Attempts a request may make after its first failed (each one from prefill).
    retries: int = 2
    #: Seconds from one round of health checks to the next.
    health_interval: float = 2.0
    #: Seconds one health check may take.
    health_timeout: float = 1.0
    #: Consecutive failed health checks that mark an upstream down.
    down_after: int = 3
    #: Seconds a client has for a request's headers: from its connection's opening, or from the first
    #: byte of its next request on a kept-alive connection (a slowloris is dropped after this long).
    header_timeout: float = 30.0
    #: Seconds a client has for a request's body, from the end of its headers.
    body_timeout: float = 60.0
    #: Seconds a client may take no data while the proxy has some for it: then its connection is
    #: dropped, and with it the upstream request it was holding (decode's blocks are released).
    write_timeout: float = 60.0
    #: The instances whose KV-cache events the proxy follows, to route by prefix (``routing``); none: by load alone.
    kv_events: tuple[EventsSource, ...] = ()
    #: Prompt tokens one outstanding request on an instance weighs when routing by prefix: the instance whose
    #: uncached prompt tokens plus this times its outstanding requests is least gets the request.
    prefix_load_weight: float = 512.0
    #: Seconds without an event or an answer to a replay request after which an instance's events count as
    #: stopped: its role is routed by load until it answers again.
    events_timeout: float = 10.0
    #: Seconds an instance's ``/tokenize`` may take, for a request whose prompt is text: then it is routed by load.
    tokenize_timeout: float = 2.0

    #: Where the proxy sends its spans (OTLP, as vLLM's ``--otlp-traces-endpoint``); None: no tracing (``follow``).
    otlp_traces_endpoint: str | None = None
    #: How a request's KV goes from prefill to decode: ``"pull"`` (prefill first, then decode pulls) or ``"push"``
    #: (both at once; prefill writes each layer into blocks decode granted: the instances' connectors must be in
    #: push mode too). See ``push``.
    kv_mode: str = "pull"

    def __post_init__(self) -> None:
        timeouts = (
            "timeout", "connect_timeout", "health_interval", "health_timeout", "header_timeout", "body_timeout", "write_timeout",
            "events_timeout", "tokenize_timeout",
        )  # fmt: skip
        for name in timeouts:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)!r}")
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}, not {self.kv_mode!r}")
        if self.retries < 0 or self.down_after < 1:
            raise ValueError(f"retries must be >= 0 and down_after >= 1, not {self.retries!r} and {self.down_after!r}")
        if not 0 <= self.prefix_load_weight < float("inf"):
            raise ValueError(f"prefix_load_weight must be >= 0 and finite, not {self.prefix_load_weight!r}")
        object.__setattr__(self, "kv_events", tuple(self.kv_events))  # (argparse gives a list)
        urls = [s.url for s in self.kv_events]
        if len(set(urls)) != len(urls):
            raise ValueError(f"kv_events names an instance twice: {sorted(u for u in set(urls) if urls.count(u) > 1)}")
