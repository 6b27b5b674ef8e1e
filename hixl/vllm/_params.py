"""What travels between the halves of the connector and between instances.

* :class:`RemotePrefill` — the ``kv_transfer_params`` prefill returns with a
  finished request and decode receives with the same request: plain JSON
  (strings, ints, lists), so any proxy can carry it. It lists every prefill
  TP rank's endpoint with the KV heads it holds, and prefill's :class:`KvSpec`.
* :class:`Endpoint` — handshake metadata: one prefill worker's DataDist
  address, cluster id and KV heads, told to its scheduler once at start-up.
* :class:`KvSpec` — what prefill's and decode's KV caches must agree on;
  decode checks it before it pulls (:meth:`KvSpec.mismatches`).
* :class:`LoadSpec` / :class:`StepMetadata` — the scheduler's orders to its
  worker for one step: requests to pull, requests whose blocks to hold
  until decode reports them pulled, leases to keep alive or release
  (:class:`WatchedLease`, see :mod:`._leases`).
* :class:`LinkReport` — the worker's answer to its scheduler every step: the
  prefill endpoints it is linked to, and those it finds down (and, on a
  pushing prefill, the pushes every rank holds decode's grants for).
* Push mode (``mode: "push"``): :class:`PushSource` — decode's
  ``kv_transfer_params`` for a request whose KV prefill writes into decode's
  blocks as it computes; :class:`PushGrant` / :class:`PushStep` — the
  scheduler's orders to decode's and prefill's workers for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ._heads import is_read

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "CPU_LAYOUT", "Endpoint", "KvSpec", "LinkReport", "LoadSpec", "PushGrant", "PushSource", "PushStep", "RemotePrefill",
    "StepMetadata", "WatchedLease",
]

# vLLM's CPU attention backend: one tensor per layer, K and V interleaved per head inside a block.
CPU_LAYOUT = "[blocks, kv_heads, block_size, 2*head_size]"
# Bounds on the lease figures a prefill's params may carry (decode trusts nothing bigger).
_MAX_LEASE_S = 86400.0


@dataclass(frozen=True)
class Endpoint(KVConnectorHandshakeMetadata):
    """Where one prefill worker's DataDist listens, its cluster id, and the KV heads ``[start, stop)`` it holds."""

    ip_info: str
    cluster_id: int
    heads: tuple[int, int]

    @property
    def head_range(self) -> range:
        """The model-wide KV heads this worker holds."""
        return range(*self.heads)


@dataclass(frozen=True)
class KvSpec:
    """What a KV cache is, as far as moving it between instances goes.

    Everything but ``tp_size`` must be equal on both sides (``num_kv_heads``
    counts the model's heads, not one rank's); different TP sizes are fine.
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    layout: str
    tp_size: int

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> KvSpec:
        """This instance's KV cache, from vLLM's config."""
        model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        dtype = str(model.dtype) if cache.cache_dtype == "auto" else str(cache.cache_dtype)
        return cls(
            model=str(model.model),
            dtype=dtype.removeprefix("torch."),
            num_layers=model.get_num_layers(parallel),
            num_kv_heads=model.get_total_num_kv_heads(),
            head_size=model.get_head_size(),
            block_size=cache.block_size,
            layout=CPU_LAYOUT,
            tp_size=parallel.tensor_parallel_size,
        )

    def mismatches(self, decode: KvSpec) -> list[str]:
        """What differs between this (prefill's) spec and ``decode``'s, one phrase each; empty if compatible."""
        return [
            f"{f.name}: prefill {getattr(self, f.name)!r}, decode {getattr(decode, f.name)!r}"
            for f in fields(self)
            if f.name != "tp_size" and getattr(self, f.name) != getattr(decode, f.name)
        ]


@dataclass(frozen=True)
class RemotePrefill:
    """A prefilled request's KV, as decode finds it in ``kv_transfer_params``.

    ``ranks`` are prefill's TP ranks in order; ``transfer_id`` names the
    request on the prefill side (DataDist's completion notification carries it
    back, and it names the request's lease at every rank: random, see
    :mod:`._leases`); ``num_tokens`` is how many prompt tokens ``block_ids``
    hold (every rank uses the same block ids, each for its own heads);
    ``lease_s`` and ``hold_cap_s`` are prefill's lease length and hard cap
    (its ``lease_s`` and ``release_timeout``).
    """

    ranks: tuple[Endpoint, ...]
    kv: KvSpec
    transfer_id: int
    block_ids: list[int]
    num_tokens: int
    request_id: str
    lease_s: float
    hold_cap_s: float

    @property
    def leased(self) -> tuple[Endpoint, ...]:
        """The prefill ranks that hold this request's blocks under a lease: those decode reads from.

        A rank holding only replicas of heads a lower rank holds is never read
        and released its blocks at once (:func:`~._heads.is_read`).
        """
        heads = [r.head_range for r in self.ranks]
        return tuple(r for i, r in enumerate(self.ranks) if is_read(heads, i))

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` prefill returns (NIXL's key names where they mean the same)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            **source_params(self.ranks, self.kv),
            "remote_transfer_id": self.transfer_id,
            "remote_block_ids": list(self.block_ids),
            "remote_num_tokens": self.num_tokens,
            "remote_request_id": self.request_id,
            "remote_lease_s": self.lease_s,
            "remote_hold_cap_s": self.hold_cap_s,
        }

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RemotePrefill | None:
        """Parse decode's ``kv_transfer_params``; None unless they ask for a remote prefill and are whole
        (lease figures included, each positive and at most a day, the cap no shorter than the lease)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            source = parse_source(params)
            if source is None:
                return None
            remote = cls(
                *source,
                int(params["remote_transfer_id"]),
                [int(b) for b in params["remote_block_ids"]],
                int(params["remote_num_tokens"]),
                str(params.get("remote_request_id", "")),
                float(params["remote_lease_s"]),
                float(params["remote_hold_cap_s"]),
            )
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        if not 0 < remote.lease_s <= remote.hold_cap_s <= _MAX_LEASE_S:  # also refuses NaN
            return None
        return remote


@dataclass(frozen=True)
class LoadSpec:
    """Pull ``remote_blocks`` of a prefilled request into this instance's ``local_blocks``.

    ``trace_headers``: the request's W3C trace context, where vLLM traces (``Request.trace_headers``);
    ``arrived``: when decode's scheduler got the request (``time.monotonic()``). Both only for following
    the request (:mod:`._follow`).
    """

    request_id: str
    remote: RemotePrefill
    remote_blocks: list[int]
    local_blocks: list[int]
    trace_headers: dict[str, str] | None = None
    arrived: float | None = None


@dataclass(frozen=True)
class WatchedLease:
    """A request that arrived at decode with a remote prefill: its lease is kept alive until it is pulled.

    ``arrived`` is the scheduler's ``time.monotonic()`` when vLLM added the
    request (one host, one clock for both halves).
    """

    request_id: str
    remote: RemotePrefill
    arrived: float


@dataclass(frozen=True)
class PushSource:
    """A request whose KV prefill pushes, as decode finds it in ``kv_transfer_params`` (push mode).

    The proxy sends the request to decode and prefill at once, both naming it by
    ``push_id`` (random, from the proxy); ``ranks`` and ``kv`` are the prefill
    instance's (its ``remote_ranks`` / ``remote_kv`` as pull mode's params give
    them, which the proxy remembers from that instance's last answer).
    """

    ranks: tuple[Endpoint, ...]
    kv: KvSpec
    push_id: int

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` the proxy sends decode for this push."""
        return {"do_remote_prefill": True, "push_id": self.push_id, **source_params(self.ranks, self.kv)}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> PushSource | None:
        """Parse decode's ``kv_transfer_params``; None unless they ask for a remote prefill by push and are
        whole (the push id an int in ``[1, 2**63)``, as random ids are)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        push_id = params.get("push_id")
        if type(push_id) is not int or not 0 < push_id < 2**63:  # (bool is an int: not accepted)
            return None
        try:
            source = parse_source(params)
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        return None if source is None else cls(*source, push_id)


def source_params(ranks: tuple[Endpoint, ...], kv: KvSpec) -> dict[str, Any]:
    """Where a prefill instance's KV lives, as ``kv_transfer_params`` carry it: every TP rank's endpoint and
    heads, and its :class:`KvSpec` (pull mode's params and push mode's alike)."""
    return {
        "remote_ranks": [{"engine": r.ip_info, "cluster_id": r.cluster_id, "heads": list(r.heads)} for r in ranks],
        "remote_kv": asdict(kv),
    }


def parse_source(params: dict[str, Any]) -> tuple[tuple[Endpoint, ...], KvSpec] | None:
    """The inverse of :func:`source_params`; None if no rank is listed; KeyError, IndexError, TypeError or
    ValueError for anything malformed."""
    ranks = tuple(
        Endpoint(str(r["engine"]), int(r["cluster_id"]), (int(r["heads"][0]), int(r["heads"][1]))) for r in params["remote_ranks"]
    )
    if not ranks:
        return None
    kv = params["remote_kv"]
    spec = KvSpec(
        str(kv["model"]), str(kv["dtype"]), int(kv["num_layers"]), int(kv["num_kv_heads"]),
        int(kv["head_size"]), int(kv["block_size"]), str(kv["layout"]), int(kv["tp_size"]),
    )
    return ranks, spec


@dataclass(frozen=True)
class PushGrant:
    """Decode's order to its worker: let prefill write the request's KV into ``local_blocks``.

    ``local_blocks[i]`` receives the prompt's block ``first_block + i`` (blocks
    before ``first_block`` were prefix-cache hits at decode); ``num_tokens`` is
    how many prompt tokens decode takes from prefill.
    """

    request_id: str
    source: PushSource
    local_blocks: list[int]
    first_block: int
    num_tokens: int
    trace_headers: dict[str, str] | None = None
    arrived: float | None = None


@dataclass(frozen=True)
class PushStep:
    """Prefill's order to its worker for one step of a pushed request's prompt.

    ``block_ids`` are the request's blocks at prefill (the whole prompt's, in
    order); this step computes prompt tokens ``[start, end)``; ``last``: the
    step that computes the prompt's last token (after it, decode is told the
    push is done); ``trace_headers``: the request's W3C trace context, where
    vLLM traces (for the push's spans).
    """

    request_id: str
    push_id: int
    block_ids: list[int]
    start: int
    end: int
    last: bool
    trace_headers: dict[str, str] | None = None


@dataclass
class StepMetadata(KVConnectorMetadata):
    """The scheduler's orders to its worker for one step.

    ``sends`` maps the transfer id of each newly finished prefill request to
    its vLLM request id: each worker (TP rank) holds its blocks under a lease until
    decode's completion notification for that id arrives, decode releases it,
    or the lease runs out. On decode, ``watch`` lists newly arrived requests
    whose leases to keep alive (and whose prefills to link to), ``drop`` the
    requests that finished at decode unpulled (their leases are released), and
    ``idle`` says the step runs no model (the worker then paces vLLM's loop
    while it only waits: for links on decode, for held blocks on prefill).

    Push mode: on decode, ``grants`` lists requests whose blocks prefill may now
    write into, ``revokes`` those that finished (aborted) before their push
    landed: their grants are withdrawn before vLLM may reuse the blocks. On
    prefill, ``pushes`` lists this step's pushed requests, ``cancels`` the push
    ids of requests that ended before their last step (decode is told), and
    ``awaiting`` says requests wait for decode's grants (an idle step then waits
    for one to come instead of letting vLLM step again at once).
    """

    loads: list[LoadSpec] = field(default_factory=list)
    sends: dict[int, str] = field(default_factory=dict)
    watch: list[WatchedLease] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    idle: bool = False
    grants: list[PushGrant] = field(default_factory=list)
    revokes: list[str] = field(default_factory=list)
    pushes: list[PushStep] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    awaiting: bool = False


@dataclass(frozen=True)
class LinkReport(KVConnectorWorkerMetadata):
    """The worker's report to its scheduler: the prefill endpoints it is linked to now, and those
    its recent link attempts all failed for (nobody listens there: waiting for them is pointless)."""

    ready: frozenset[Endpoint]
    down: frozenset[Endpoint] = frozenset()
    granted: frozenset[int] = frozenset()  # prefill, push mode: push ids this worker holds every grant for

    def aggregate(self, other: KVConnectorWorkerMetadata) -> LinkReport:
        """Several workers (decode TP ranks, each linking to every prefill rank a request needs): an endpoint is
        ready when every worker is linked to it, down when one finds it down; a push is granted when every
        worker holds its grants."""
        if not isinstance(other, LinkReport):
            return self
        return LinkReport(self.ready & other.ready, self.down | other.down, self.granted & other.granted)
