"""The connector's settings, read from ``kv_transfer_config.kv_connector_extra_config``.

Every key is optional: one prefill and one decode instance on one host need
none (the DataDist port is picked by the OS, the cluster id at random).
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ConnectorConfig", "LoadMode", "Mode"]


class Mode(enum.Enum):
    """Which side moves a request's KV."""

    PULL = "pull"  # decode READs prefill's blocks once prefill has finished the prompt
    PUSH = "push"  # prefill WRITEs each layer into decode's blocks as soon as it is computed


class LoadMode(enum.Enum):
    """How decode pulls a request's blocks within the step that needs them."""

    LAYERWISE = "layerwise"  # one request per layer; each attention layer waits only for its own
    SYNC = "sync"  # every layer in one transfer, finished before the forward starts


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings of one :class:`~hixl.vllm.HixlConnector` (all keys of the extra config are optional).

    ``host``: the address prefill's DataDist listens on and tells decode about
    (another host's decode needs a routable one); ``port``: 0 picks a free one;
    ``cluster_id``: this instance's DataDist cluster id (random by default);
    ``load_mode``: ``"layerwise"`` or ``"sync"``; ``transfer_timeout``: seconds
    a pull may take before the request's load fails (at most half the prefill's
    lease: the pull must end while its blocks are surely held); ``lease_s``: prefill holds
    a finished request's blocks this long unless decode extends the lease
    (decode does, every quarter lease, while the request waits in its queue;
    a decode that died stops, and the blocks go a lease later); decode holds a
    request back for its link to prefill for up to half of it;
    ``release_timeout``: the hard cap — the longest prefill holds a request's
    blocks however often decode extends the lease (a decode that keeps
    extending and never pulls ties up blocks at most this long);
    ``mode``: ``"pull"`` (decode reads a prefilled request's blocks) or ``"push"`` (prefill writes each
    layer into blocks decode granted, while it computes the next: docs/vllm.md, "Push mode"; both instances
    and the proxy must agree); ``push_timeout``: seconds decode waits for a granted push to land before the
    request's load fails (its grant withdrawn first);
    ``transport``: ``"auto"``, ``"cma"`` or ``"tcp"``; ``whole_below_bytes``:
    under ``"layerwise"``, a request whose KV on a decode rank is smaller than
    this is pulled whole — one transfer of every layer, inline, before the
    forward starts — as a sync load would (0: every request layer-wise); ``records``: a file decode
    appends one JSON line to per request and rank it loaded or failed to (its id and the client's,
    bytes, times, transport, outcome: docs/vllm.md, "Follow one request"; empty: none), and in push mode
    prefill too, per request and rank it pushed. Decode takes the lease
    figures from the prefill's ``kv_transfer_params``, not from its own settings.
    """

    mode: Mode = Mode.PULL
    host: str = "127.0.0.1"
    port: int = 0
    cluster_id: int = 0
    load_mode: LoadMode = LoadMode.LAYERWISE
    transfer_timeout: float = 30.0
    lease_s: float = 30.0
    release_timeout: float = 300.0
    transport: str = "auto"
    # Below this, on CPU, the copy is shorter than the layer-wise path's planning, hand-offs and wake-ups, and
    # the forward gains nothing from starting early: it shares the cores with the copy (docs/vllm.md).
    whole_below_bytes: int = 32 << 20
    records: str = ""
    push_timeout: float = 30.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Build from ``kv_connector_extra_config``; unknown keys and bad values raise ``ValueError``."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown hixl connector settings {unknown}; known: {sorted(known)}")
        try:
            config = cls(
                mode=Mode(extra.get("mode", Mode.PULL.value)),
                host=str(extra.get("host", cls.host)),
                port=int(extra.get("port", cls.port)),
                # Random rather than fixed: two instances must never share an id, and
                # nothing has to be configured for the common case.
                cluster_id=int(extra.get("cluster_id", 1 + secrets.randbelow(2**31 - 1))),
                load_mode=LoadMode(extra.get("load_mode", LoadMode.LAYERWISE.value)),
                transfer_timeout=float(extra.get("transfer_timeout", cls.transfer_timeout)),
                lease_s=float(extra.get("lease_s", cls.lease_s)),
                release_timeout=float(extra.get("release_timeout", cls.release_timeout)),
                transport=str(extra.get("transport", cls.transport)),
                whole_below_bytes=int(extra.get("whole_below_bytes", cls.whole_below_bytes)),
                records=str(extra.get("records", cls.records)),
                push_timeout=float(extra.get("push_timeout", cls.push_timeout)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad hixl connector setting: {exc}") from exc
        if config.whole_below_bytes < 0:
            raise ValueError(f"hixl connector whole_below_bytes must be 0 or more, not {config.whole_below_bytes}")
        if not 0 <= config.port < 65536 or config.cluster_id < 0:
            raise ValueError(f"bad hixl connector port {config.port} or cluster id {config.cluster_id}")
        if not (config.transfer_timeout > 0 and config.lease_s > 0 and config.release_timeout > 0 and config.push_timeout > 0):  # NaN too
            raise ValueError("hixl connector timeouts must be positive")
        if config.release_timeout < config.lease_s or config.release_timeout > 86400:
            raise ValueError(
                f"hixl connector release_timeout ({config.release_timeout} s) must be at least lease_s "
                f"({config.lease_s} s) and at most a day"
            )
        return config
