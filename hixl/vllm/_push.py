"""Push mode's worker half: decode grants prefill writes into its blocks; prefill writes each layer as computed.

Theory of operation. In push mode decode's KV cache is registered read-only
(``access="r"``): no peer may write a byte of it. For each request whose KV
prefill pushes, decode's :class:`Receiver` registers *write windows* — the
request's blocks, every layer, coalesced into runs of adjacent blocks, each a
``rw`` registration inside the read-only cache — and only then sends a GRANT
(a :class:`PushMessage` on the engine notification :data:`PUSH_NOTIFY`) to
every prefill TP rank: where to write, and which of its heads this decode rank
wants from that rank (none, for a rank holding only heads it reads elsewhere:
every prefill rank hears from every decode rank, so it can count them).

Prefill's :class:`GrantTable` collects the grants per push id (bounded in
number and age; a malformed one is refused). Once every decode rank's grant
is in, the push is *granted* (reported to the scheduler, which then schedules
the request's steps); its :class:`Pusher` links to the decode ranks, and after
each layer is computed (``save_layer``) writes that layer's blocks computed so
far — from the first block not yet written whole, a partial last block again
by the next chunk — into each decode rank that wants heads from it, without
waiting. ``end_step`` waits for the step's writes. Once the request's last
step has written its last layer, the pusher's own thread waits for those
writes to land and sends DONE to every decode rank that granted it — while
the forward still runs the rest of the model — a notification, so it arrives
after the data of the writes before it; ``ok`` false if a write failed.

Decode's push *lands* when every prefill rank it reads from said DONE ok; it
*fails* on a DONE not ok, on the link to such a rank found dead, on a prefill
rank the keeper finds down before the grants went out, or when
``push_timeout`` passes. Either way, and when the scheduler revokes it
(the request was aborted), the windows are withdrawn first — deregistered in
one batch (:meth:`~hixl.Engine.deregister_mems`), which returns only once no
peer can move a byte into them — and only then is the request reported to
vLLM (:meth:`Receiver.finished`), whose blocks may then go to another request.
So a late or stray write can never land in reused blocks: it is refused
(:class:`~hixl.AccessDenied`), not detected. The withdrawal waits on peers'
confirmations (up to the engine's ``deregister_timeout``), so it runs on the
receiver's one thread, never in vLLM's step.

Trust. A push id is random (from the proxy) and names the request on both
sides, as a transfer id names a lease: a DONE must name a push this decode
rank granted and a prefill rank it reads from. What a prefill may write is
bounded by decode's registrations, not by anything in the messages.
"""

from __future__ import annotations

import enum
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._exceptions import AccessDenied, HixlError, ParamInvalid
from .._types import MemDesc, MemHandle, NotifyDesc
from ..datadist import (
    BlocksCacheKey,
    Cache,
    CacheTask,
    LLMClusterInfo,
    LLMDataDist,
    LLMStatusCode,
)
from ._follow import client_id, transports
from ._heads import plan_reads
from ._leases import LeaseKeeper
from ._params import Endpoint, KvSpec, PushGrant, PushStep
from ._timeline import Timeline, Trace

__all__ = ["PUSH_NOTIFY", "GrantTable", "PushMessage", "PushOp", "Pusher", "Receiver"]

log = logging.getLogger("vllm.hixl")

PUSH_NOTIFY = "hixl.vllm.push"
_MAX_ID = 2**63 - 1
_MAX_BLOCKS = 1 << 20  # per grant: more than any vLLM request holds
# Prefill keeps grants for pushes it has not started yet this long, at most this many pushes.
_GRANT_TTL_S = 600.0
_MAX_GRANTS = 4096
_NOTIFY_TIMEOUT_S = 2.0
_LINK_TIMEOUT_S = 5.0
_TICK_S = 0.05  # the receiver's look at links and deadlines, while pushes are pending
_RECVED_KEPT = 4096  # requests listed in finished_recving remembered (a revoke crossing the listing comes within a step)
_TENSORS_PER_LAYER = 1


class PushOp(enum.Enum):
    """What a :class:`PushMessage` says."""

    GRANT = "grant"  # decode -> prefill: write the push's blocks here
    DONE = "done"  # prefill -> decode: every write of the push is over (landed, unless ``ok`` is false)


@dataclass(frozen=True)
class PushMessage:
    """One push-mode message between workers, carried by an engine notification named :data:`PUSH_NOTIFY`.

    GRANT (from decode rank ``rank`` of ``tp_size``): ``endpoint`` is that
    rank's DataDist, ``blocks`` its blocks for the prompt's blocks
    ``first_block`` on, ``num_tokens`` the prompt tokens it takes, ``reads``
    the (prefill-rank-local, decode-rank-local) head ranges it wants from the
    receiving prefill rank (None: nothing). DONE (from the prefill rank whose
    cluster id is ``cluster_id``): ``ok``.
    """

    op: PushOp
    push_id: int
    endpoint: Endpoint | None = None
    rank: int = 0
    tp_size: int = 1
    blocks: tuple[int, ...] = ()
    first_block: int = 0
    num_tokens: int = 0
    reads: tuple[range, range] | None = None
    cluster_id: int = 0
    ok: bool = True

    def encode(self) -> str:
        """The notification's message (JSON)."""
        if self.op is PushOp.DONE:
            return json.dumps({"op": "done", "push_id": self.push_id, "cluster_id": self.cluster_id, "ok": self.ok})
        assert self.endpoint is not None, "a grant names decode's endpoint"
        reads = None if self.reads is None else [self.reads[0].start, self.reads[0].stop, self.reads[1].start, self.reads[1].stop]
        return json.dumps({
            "op": "grant", "push_id": self.push_id, "engine": self.endpoint.ip_info, "cluster_id": self.endpoint.cluster_id,
            "heads": list(self.endpoint.heads), "rank": self.rank, "tp_size": self.tp_size, "blocks": list(self.blocks),
            "first_block": self.first_block, "num_tokens": self.num_tokens, "reads": reads,
        })

    @classmethod
    def decode(cls, msg: str) -> PushMessage:
        """Parse a peer's message strictly; :class:`ParamInvalid` for anything else."""
        try:
            doc = json.loads(msg)
        except (ValueError, RecursionError):
            raise ParamInvalid("a push message must be JSON") from None
        if not isinstance(doc, dict):
            raise ParamInvalid("a push message is a JSON object")
        try:
            op = PushOp(doc.get("op"))
        except ValueError:
            raise ParamInvalid(f"unknown push op {doc.get('op')!r}") from None
        if op is PushOp.DONE:
            _keys(doc, {"op", "push_id", "cluster_id", "ok"})
            if type(doc["ok"]) is not bool:
                raise ParamInvalid("a push's ok is true or false")
            return cls(op, _int(doc["push_id"], 1, _MAX_ID), cluster_id=_int(doc["cluster_id"], 0, _MAX_ID), ok=doc["ok"])
        _keys(doc, {"op", "push_id", "engine", "cluster_id", "heads", "rank", "tp_size", "blocks", "first_block", "num_tokens", "reads"})
        tp_size = _int(doc["tp_size"], 1, 1 << 16)
        heads, blocks, reads = doc["heads"], doc["blocks"], doc["reads"]
        if not isinstance(doc["engine"], str) or not isinstance(heads, list) or len(heads) != 2:
            raise ParamInvalid("a grant names decode's engine and heads [start, stop)")
        if not isinstance(blocks, list) or not 0 < len(blocks) <= _MAX_BLOCKS:
            raise ParamInvalid("a grant lists its blocks")
        if reads is not None and (not isinstance(reads, list) or len(reads) != 4):
            raise ParamInvalid("a grant's reads are null or [src_start, src_stop, dst_start, dst_stop]")
        endpoint = Endpoint(doc["engine"], _int(doc["cluster_id"], 0, _MAX_ID), (_int(heads[0], 0, 1 << 16), _int(heads[1], 1, 1 << 16)))
        head_reads = None
        if reads is not None:
            src, dst = range(*(_int(v, 0, 1 << 16) for v in reads[:2])), range(*(_int(v, 0, 1 << 16) for v in reads[2:]))
            if not len(src) or len(src) != len(dst):
                raise ParamInvalid("a grant's head ranges are equally long and not empty")
            head_reads = (src, dst)
        return cls(
            op, _int(doc["push_id"], 1, _MAX_ID), endpoint, _int(doc["rank"], 0, tp_size - 1), tp_size,
            tuple(_int(b, 0, _MAX_ID) for b in blocks), _int(doc["first_block"], 0, _MAX_BLOCKS), _int(doc["num_tokens"], 1, _MAX_ID),
            head_reads,
        )


def _keys(doc: dict[str, Any], keys: set[str]) -> None:
    if set(doc) != keys:
        raise ParamInvalid(f"a push message has exactly the keys {sorted(keys)}")


def _int(value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:  # bool is an int: not accepted
        raise ParamInvalid(f"a push message's numbers are ints in [{low}, {high}]")
    return value


def _send(datadist: LLMDataDist, ip_info: str, message: PushMessage) -> None:
    datadist.engine.send_notify(ip_info, NotifyDesc(PUSH_NOTIFY, message.encode()), _NOTIFY_TIMEOUT_S)


# -- prefill -----------------------------------------------------------------------------------------
class GrantTable:
    """Prefill's grants from decode ranks, per push id, until its push starts: one lock, fed by the engine's
    serve thread (:meth:`on_notify`) and read by the worker."""

    def __init__(self) -> None:
        self._lock = threading.Condition()  # notified when a grant comes (wait_for_grant)
        self._grants: OrderedDict[int, tuple[float, dict[int, PushMessage]]] = OrderedDict()  # push id -> (first heard, rank -> grant)
        self._heard = 0  # grants taken in so far

    def on_notify(self, message: PushMessage) -> None:
        """Keep one decode rank's grant (the oldest pushes go past :data:`_MAX_GRANTS` or :data:`_GRANT_TTL_S`)."""
        now = time.monotonic()
        with self._lock:
            while self._grants and (len(self._grants) >= _MAX_GRANTS or next(iter(self._grants.values()))[0] < now - _GRANT_TTL_S):
                dropped, _ = self._grants.popitem(last=False)
                log.warning("hixl: dropped the grants of push %d: never pushed", dropped)
            _, by_rank = self._grants.setdefault(message.push_id, (now, {}))
            by_rank[message.rank] = message
            self._heard += 1
            self._lock.notify_all()

    def heard(self) -> int:
        """How many grants came so far (for :meth:`wait_for_grant`)."""
        with self._lock:
            return self._heard

    def wait_for_grant(self, since: int, timeout: float) -> None:
        """Sleep up to ``timeout`` or until a grant comes that :meth:`heard` had not counted at ``since``."""
        with self._lock:
            self._lock.wait_for(lambda: self._heard != since, timeout)

    def complete(self) -> frozenset[int]:
        """Push ids for which every decode rank's grant is in."""
        with self._lock:
            return frozenset(push_id for push_id, (_, by_rank) in self._grants.items() if _whole(by_rank))

    def take(self, push_id: int) -> list[PushMessage] | None:
        """The push's grants, one per decode rank, forgotten here; None unless all are in."""
        with self._lock:
            entry = self._grants.get(push_id)
            if entry is None or not _whole(entry[1]):
                return None
            del self._grants[push_id]
            return [entry[1][rank] for rank in sorted(entry[1])]


def _whole(by_rank: dict[int, PushMessage]) -> bool:
    sizes = {grant.tp_size for grant in by_rank.values()}
    return len(sizes) == 1 and len(by_rank) == sizes.pop()


@dataclass
class _Target:
    """One decode rank a push writes to (or, with no reads, only tells it is done)."""

    grant: PushMessage
    written: int  # prompt blocks before this one are written whole (from the grant's first block)
    tasks: list[CacheTask] = field(default_factory=list)  # this step's writes
    error: Exception | None = None


@dataclass
class _Push:
    push_id: int
    request_id: str
    targets: list[_Target]
    step: PushStep | None = None  # this step's orders
    started: float = 0.0
    nbytes: int = 0  # written so far
    trace: Trace | None = None  # with the timeline on
    telling: threading.Event | None = None  # handed to the pusher's thread to tell decode; set once told
    told: float = 0.0  # when DONE went to every decode rank


class Pusher:
    """Prefill's side: writes the granted pushes of each step, layer by layer, and tells decode when done."""

    def __init__(
        self, datadist: LLMDataDist, cache: Cache, kv: KvSpec, cluster_id: int, transfer_timeout: float,
        rank: int = 0, timeline: Timeline | None = None,
    ) -> None:  # fmt: skip
        self.datadist = datadist
        self.cache = cache
        self.kv = kv
        self.cluster_id = cluster_id
        self.transfer_timeout = transfer_timeout
        self.rank = rank
        self.timeline = timeline
        """Where each push's record goes (None: nowhere, and nothing is timed per layer)."""
        desc = cache.cache_desc
        self._head_bytes = desc.row_bytes // desc.shape[1]  # one head of one block, in one layer
        self._last_layer = desc.num_tensors // _TENSORS_PER_LAYER - 1
        # Pushes whose last writes are all issued, with those writes: the thread tells decode once they land.
        self._finishing: queue.SimpleQueue[tuple[_Push, list[tuple[_Target, list[CacheTask]]]] | None] = queue.SimpleQueue()
        self._finisher = threading.Thread(target=self._finish, name="hixl-vllm-push-done", daemon=True)
        self._finisher.start()
        self.grants = GrantTable()
        self._pushes: dict[int, _Push] = {}  # started, not yet done
        self._step: list[_Push] = []
        # Decode clusters a push to failed: their links are checked (and a broken one replaced) before the next.
        self._suspect: set[int] = set()
        self._reported = 0  # grants heard when the scheduler was last told which are in (granted)

    def granted(self) -> frozenset[int]:
        """Push ids this rank holds every grant for (started ones included)."""
        self._reported = self.grants.heard()  # (before the look: a grant after it wakes wait_for_grants)
        return self.grants.complete() | frozenset(self._pushes)

    def wait_for_grants(self, timeout: float) -> None:
        """Sleep up to ``timeout`` or until a grant comes that the last :meth:`granted` did not see: paces an
        engine whose requests wait for decode's grants (vLLM steps without pause while requests wait, and
        its worker busy-waits between steps: two prefills doing so starved a decode on two cores of the
        CPU its grants needed)."""
        self.grants.wait_for_grant(self._reported, timeout)

    def start(self, steps: Iterable[PushStep]) -> None:
        """This step's orders: start the pushes new to it (linking to their decode ranks), remember the step."""
        for step in steps:
            push = self._pushes.get(step.push_id)
            if push is None:
                grants = self.grants.take(step.push_id)
                if grants is None:
                    log.warning("hixl: request %s: push %d scheduled without every decode rank's grant; not pushed", step.request_id, step.push_id)
                    continue
                push = self._pushes[step.push_id] = _Push(step.push_id, step.request_id, [_Target(g, g.first_block) for g in grants], started=time.monotonic())
                if self.timeline is not None:
                    push.trace = Trace("hixl", step.request_id, self.rank, push.started, "push", role="prefill")
                for target in push.targets:
                    self._link(target)
            push.step = step
            self._step.append(push)

    def _link(self, target: _Target) -> None:
        """Link to the decode rank: once, and again after a push to it failed (DataDist answers ALREADY_LINK
        for a live link and replaces one found broken, e.g. declared dead while decode was starved)."""
        endpoint = target.grant.endpoint
        assert endpoint is not None
        try:
            linked = self.datadist.linked_clusters().get(endpoint.cluster_id) == endpoint.ip_info
            if not linked or endpoint.cluster_id in self._suspect or not self._connected(endpoint.ip_info):
                (status,) = self.datadist.link_clusters([LLMClusterInfo(endpoint.cluster_id, endpoint.ip_info)], _LINK_TIMEOUT_S)
                if status not in (LLMStatusCode.SUCCESS, LLMStatusCode.ALREADY_LINK):
                    target.error = HixlError(f"linking to decode {endpoint.ip_info} failed: {status.name}")
                else:
                    self._suspect.discard(endpoint.cluster_id)
        except HixlError as exc:
            target.error = exc

    def _connected(self, ip_info: str) -> bool:
        """Whether the engine's connection to ``ip_info`` is up (a local look: no round trip)."""
        try:
            self.datadist.engine.peer_incarnation(ip_info)
        except HixlError:
            return False
        return True

    def save_layer(self, layer: int) -> None:
        """``layer`` is computed: start writing it for every push of this step (returns at once)."""
        asked = time.monotonic() if self.timeline is not None else 0.0
        for push in self._step:
            step = push.step
            assert step is not None
            for target in push.targets:
                grant = target.grant
                if grant.reads is None or target.error is not None:
                    continue
                # Up to the block holding the step's last token, within the blocks decode granted.
                stop = min((step.end - 1) // self.kv.block_size + 1, grant.first_block + len(grant.blocks), len(step.block_ids))
                if stop <= target.written:
                    continue
                src = step.block_ids[target.written : stop]
                dst = grant.blocks[target.written - grant.first_block : stop - grant.first_block]
                assert grant.endpoint is not None
                try:
                    target.tasks.append(self.datadist.cache_manager.push_blocks_async(
                        BlocksCacheKey(grant.endpoint.cluster_id), self.cache, src, dst, range(layer, layer + 1), range(layer, layer + 1),
                        _TENSORS_PER_LAYER, timeout=self.transfer_timeout, src_heads=grant.reads[0], dst_heads=grant.reads[1],
                    ))
                except (HixlError, ValueError, TypeError) as exc:
                    target.error = exc
                else:
                    push.nbytes += len(src) * len(grant.reads[0]) * self._head_bytes
            if push.trace is not None:
                push.trace.asked(layer, asked, time.monotonic())
            if step.last and layer == self._last_layer and push.telling is None:
                # Every write of the push is issued: decode hears as they land, not after the forward's end.
                push.telling = threading.Event()
                self._finishing.put((push, [(target, list(target.tasks)) for target in push.targets]))

    def end_step(self) -> None:
        """Wait for this step's writes; after a push's last step, tell each decode rank it is done."""
        step_end = time.monotonic()
        for push in self._step:
            step = push.step
            assert step is not None
            for target in push.targets:
                _settle(target, target.tasks)
            if push.trace is not None:  # (before the tasks go: each layer's landing, by every target)
                landed: list[float | None] = [None] * self.cache.cache_desc.num_tensors
                for task in (task for target in push.targets for task in target.tasks):
                    for layer in task.layers:
                        at = task.landed_at(layer)
                        if at is not None:
                            landed[layer] = max(at, landed[layer] or at)
                push.trace.step_end = step_end
                push.trace.landed(landed)
            for target in push.targets:
                target.tasks.clear()
                if target.error is None:
                    whole = min(step.end // self.kv.block_size, target.grant.first_block + len(target.grant.blocks))
                    target.written = max(target.written, whole)
            if step.last:
                self._done(push)
        self._step.clear()

    def cancel(self, push_ids: Iterable[int]) -> None:
        """These requests ended before their last step: tell decode their pushes failed."""
        for push_id in push_ids:
            push = self._pushes.get(push_id)
            if push is None:  # never started: link to its decode ranks to tell them
                grants = self.grants.take(push_id) or []
                push = _Push(push_id, "?", [_Target(g, g.first_block) for g in grants])
                for target in push.targets:
                    self._link(target)
            for target in push.targets:
                target.error = HixlError("cancelled at prefill")
            self._done(push)

    def _finish(self) -> None:
        """The pusher's thread: for each push handed over, wait for its last writes, then tell decode."""
        while (item := self._finishing.get()) is not None:
            push, writes = item
            try:
                for target, tasks in writes:
                    _settle(target, tasks)
                self._tell(push)
            except Exception:  # the thread outlives one push's surprise; end_step then tells decode itself
                log.exception("hixl: request %s: telling decode push %d is over failed", push.request_id, push.push_id)
            finally:
                assert push.telling is not None
                push.telling.set()

    def close(self) -> None:
        """Stop the pusher's thread (after the pushes handed to it are told)."""
        self._finishing.put(None)
        self._finisher.join(timeout=self.transfer_timeout + _NOTIFY_TIMEOUT_S)

    def _done(self, push: _Push) -> None:
        """The push is over here: tell decode (unless the thread does: then wait for it), write its record."""
        self._pushes.pop(push.push_id, None)
        if push.telling is not None and not push.telling.wait(self.transfer_timeout + _NOTIFY_TIMEOUT_S):
            log.warning("hixl: request %s: push %d: the pusher's thread did not tell decode in time", push.request_id, push.push_id)
        if not push.told:  # (not handed to the thread, or it failed to tell)
            self._tell(push)
        if push.started:  # (a push cancelled before it started moved nothing: no line, no record)
            self._report(push, client_id(push.request_id))

    def _tell(self, push: _Push) -> None:
        """Send DONE to every decode rank the push has (``ok`` false where its writes failed)."""
        who = client_id(push.request_id)
        for target in push.targets:
            endpoint = target.grant.endpoint
            assert endpoint is not None
            if target.error is not None:
                self._suspect.add(endpoint.cluster_id)
                log.warning(
                    "hixl: request %s: push %d to decode %s failed: %s (client request id %s)",
                    push.request_id, push.push_id, endpoint.ip_info, target.error, who,
                )  # fmt: skip
            try:
                _send(self.datadist, endpoint.ip_info, PushMessage(PushOp.DONE, push.push_id, cluster_id=self.cluster_id, ok=target.error is None))
            except HixlError as exc:  # decode is gone, or gave the push up: it fails the request itself
                log.warning("hixl: request %s: cannot tell decode %s that push %d is over: %s", push.request_id, endpoint.ip_info, push.push_id, exc)
        push.told = time.monotonic()

    def _report(self, push: _Push, who: str) -> None:
        """Log the push's figures and write its record (with the timeline on)."""
        reported = push.told
        written = [t for t in push.targets if t.grant.reads is not None]
        failed = next((t.error for t in push.targets if t.error is not None), None)
        transport = transports(self.datadist.engine, (t.grant.endpoint.ip_info for t in written if t.grant.endpoint is not None))
        if failed is None:
            log.info(
                "hixl: pushed request %s: %.2f MiB to %d decode rank(s) in %.2f ms over %s (push %d, client request id %s)",
                push.request_id, push.nbytes / 2**20, len(written), (reported - push.started) * 1e3, transport or "-", push.push_id, who,
            )  # fmt: skip
        trace = push.trace
        if trace is not None and self.timeline is not None:
            trace.nbytes, trace.transport, trace.client_id, trace.reported = push.nbytes, transport, who, reported
            trace.outcome = "ok" if failed is None else f"failed: {failed}"
            self.timeline.write(trace, push.step.trace_headers if push.step is not None else None)


def _settle(target: _Target, tasks: Iterable[CacheTask]) -> None:
    """Wait for ``tasks``, writes to ``target``, until one fails: its error becomes the target's."""
    for task in tasks:
        if target.error is not None:
            return
        try:
            task.synchronize()
        except HixlError as exc:
            target.error = exc


# -- decode ------------------------------------------------------------------------------------------
class PushState(enum.Enum):
    """A granted push at decode."""

    GRANTED = "granted"  # windows registered, grants not all sent (waiting for links)
    SENT = "sent"  # every prefill rank has its grant
    LANDED = "landed"  # every prefill rank read from said DONE ok
    FAILED = "failed"
    REVOKED = "revoked"  # the scheduler withdrew it (request aborted)


_ENDED = (PushState.LANDED, PushState.FAILED, PushState.REVOKED)


@dataclass
class _Granted:
    grant: PushGrant
    handles: list[MemHandle] | None  # its windows, once the thread opened them
    began: float  # the worker took the grant
    deadline: float
    sources: dict[int, Endpoint]  # prefill cluster id -> rank: those it reads from (their DONE counts)
    state: PushState = PushState.GRANTED
    done: set[int] = field(default_factory=set)  # cluster ids that said DONE ok
    why: str = ""
    unsent: str = ""  # why the grants could not be sent last time (sent again once relinked)
    sent: float | None = None  # every prefill rank has its grant
    landed: float | None = None  # the last DONE ok came


class Receiver:
    """Decode's side: windows and grants per pushed request, their end, and what to tell vLLM.

    One thread sends grants once linked, watches links and deadlines, and withdraws ended pushes' windows
    before they are reported (:meth:`finished`).
    """

    def __init__(
        self, datadist: LLMDataDist, keeper: LeaseKeeper, cache: Cache, kv: KvSpec, rank: int, endpoint: Endpoint, push_timeout: float,
        timeline: Timeline | None = None,
    ) -> None:  # fmt: skip
        self.datadist = datadist
        self.timeline = timeline
        """Where each push's record goes (None: nowhere)."""
        self.keeper = keeper
        self.cache = cache
        self.kv = kv
        self.rank = rank
        self.endpoint = endpoint
        self.push_timeout = push_timeout
        self._cond = threading.Condition()
        self._pushes: dict[str, _Granted] = {}  # request id -> its push, until reported
        self._by_id: dict[int, str] = {}  # push id -> request id
        self._sending: set[str] = set()  # reported: blocks free (vLLM's finished_sending)
        self._recving: set[str] = set()  # reported: landed or failed (vLLM's finished_recving)
        # Listed in finished_recving lately: vLLM frees an ended request's blocks from that listing, so a revoke
        # of one (its abort crossed the report) is no second listing — vLLM asserts each request is freed once.
        self._recved: OrderedDict[str, None] = OrderedDict()
        self._failed_blocks: set[int] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hixl-vllm-push", daemon=True)
        self._thread.start()

    # -- the worker's calls ------------------------------------------------------------------------
    def grant(self, grants: Iterable[PushGrant]) -> None:
        """Take each request's grant: the thread opens its windows (registering them takes milliseconds, kept
        out of vLLM's step), then sends the grants once linked to every prefill rank."""
        for grant in grants:
            began = time.monotonic()
            source = grant.source
            try:
                mismatches = source.kv.mismatches(self.kv)
                if mismatches:
                    raise ValueError(f"prefill's and decode's KV caches differ ({'; '.join(mismatches)})")
                reads = plan_reads([r.head_range for r in source.ranks], self.kv_heads())
            except ValueError as exc:
                log.warning("hixl: request %s: cannot grant its push: %s", grant.request_id, exc)
                with self._cond:
                    self._recving.add(grant.request_id)
                    self._failed_blocks.update(grant.local_blocks)
                continue
            sources = {source.ranks[r.prefill_rank].cluster_id: source.ranks[r.prefill_rank] for r in reads}
            self.keeper.want(grant.request_id, source.ranks)
            with self._cond:
                self._pushes[grant.request_id] = _Granted(grant, None, began, began + self.push_timeout, sources)
                self._by_id[source.push_id] = grant.request_id
                self._cond.notify_all()

    def kv_heads(self) -> range:
        """This decode rank's KV heads (model-wide)."""
        return range(*self.endpoint.heads)

    def revoke(self, request_ids: Iterable[str]) -> None:
        """These requests ended at decode before their push landed: withdraw their windows, then report
        them in ``finished_sending``."""
        with self._cond:
            for request_id in request_ids:
                pushed = self._pushes.get(request_id)
                if pushed is None:
                    if request_id in self._recving or self._recved.pop(request_id, False) is None:
                        continue  # its push ended and is (to be) listed in finished_recving: vLLM frees it there
                    self._sending.add(request_id)  # nothing open: free now
                    continue
                pushed.state, pushed.why = PushState.REVOKED, "revoked"
            self._cond.notify_all()

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose blocks vLLM may free: revoked and withdrawn; requests whose push landed or failed,
        windows withdrawn); drains."""
        with self._cond:
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, set()
            for request_id in recving:
                self._recved[request_id] = None
            while len(self._recved) > _RECVED_KEPT:
                self._recved.popitem(last=False)
        return sending, recving

    def wait_for_end(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` or until a push ends (something for :meth:`finished`): paces an engine whose
        only requests wait for pushes. False, at once, if no push is pending."""
        with self._cond:
            if not self._pushes:
                return False
            self._cond.wait_for(lambda: self._closed or bool(self._sending or self._recving), timeout)
            return True

    def take_failed_blocks(self) -> set[int]:
        """Blocks of pushes that failed since the last call."""
        with self._cond:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def on_done(self, message: PushMessage) -> None:
        """A prefill rank's DONE (on the engine's serve thread: quick); refused unless it names a push
        granted here and a rank read from."""
        with self._cond:
            request_id = self._by_id.get(message.push_id)
            pushed = self._pushes.get(request_id) if request_id is not None else None
            if pushed is None or message.cluster_id not in pushed.sources:
                raise AccessDenied(f"no push {message.push_id} from cluster {message.cluster_id} is granted here")
            if pushed.state in _ENDED:
                return
            if not message.ok:
                pushed.state, pushed.why = PushState.FAILED, f"prefill cluster {message.cluster_id} reported its writes failed"
            else:
                pushed.done.add(message.cluster_id)
                if pushed.done >= set(pushed.sources):
                    pushed.state, pushed.landed = PushState.LANDED, time.monotonic()
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread (DataDist's finalize then withdraws every registration)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=_NOTIFY_TIMEOUT_S + _LINK_TIMEOUT_S)

    # -- windows ----------------------------------------------------------------------------------
    def _open(self, blocks: Sequence[int]) -> list[MemHandle]:
        """Register the blocks' bytes in every layer writable: adjacent blocks (and layers) as one range."""
        desc = self.cache.cache_desc
        if any(not 0 <= b < desc.shape[0] for b in blocks):
            raise ValueError(f"blocks {list(blocks)} outside the cache's {desc.shape[0]}")
        row = desc.row_bytes
        spans = sorted((addr + b * row, addr + (b + 1) * row) for addr in self.cache.tensor_addrs for b in set(blocks))
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        handles: list[MemHandle] = []
        try:
            for start, end in merged:
                handles.append(self.datadist.engine.register_mem(MemDesc(start, end - start), access="rw"))
        except HixlError:
            self.datadist.engine.deregister_mems(handles)
            raise
        return handles

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                if not self._pushes:
                    self._cond.wait(1.0)
                    continue
                pushes = list(self._pushes.values())
            for pushed in pushes:
                self._look(pushed)
            ended = [p for p in pushes if p.state in _ENDED]
            for pushed in ended:
                self._withdraw(pushed)
            if not ended:
                with self._cond:
                    self._cond.wait(_TICK_S)

    def _look(self, pushed: _Granted) -> None:
        """Send the grants once linked; fail the push on a dead link, a down prefill, or its deadline."""
        source = pushed.grant.source
        why, sent = "", False
        if pushed.handles is None and pushed.state is PushState.GRANTED:
            try:
                pushed.handles = self._open(pushed.grant.local_blocks)
            except (HixlError, ValueError) as exc:
                pushed.handles, why = [], f"its windows could not be opened: {exc}"
        if pushed.state is PushState.GRANTED and not why:
            down = self.keeper.down() & set(source.ranks)
            if down:
                why = f"prefill {', '.join(e.ip_info for e in down)} is down"
            elif all(self.keeper.linked(e) for e in source.ranks):
                # A link found broken as the grants go is relinked by the keeper, and they go again
                # (prefill waits for them): failing the push would fail a request a relink saves.
                pushed.unsent = self._send_grants(pushed)
                sent = not pushed.unsent
        elif pushed.state is PushState.SENT:
            for endpoint in pushed.sources.values():
                try:
                    self.datadist.engine.peer_incarnation(endpoint.ip_info)
                except HixlError as exc:
                    why = f"the link to prefill {endpoint.ip_info} is dead ({exc})"
                    self.keeper.check(endpoint)
                    break
        if not why and pushed.state not in _ENDED and time.monotonic() >= pushed.deadline:
            why = f"push_timeout ({self.push_timeout} s) passed" + (f"; the grants were not sent: {pushed.unsent}" if pushed.unsent else "")
        with self._cond:  # (a DONE or a revoke may have ended it meanwhile: that stands)
            if why and pushed.state not in _ENDED:
                pushed.state, pushed.why = PushState.FAILED, why
            elif sent and pushed.state is PushState.GRANTED:
                pushed.state, pushed.sent = PushState.SENT, time.monotonic()

    def _send_grants(self, pushed: _Granted) -> str:
        """Tell every prefill rank where to write (and which heads); why not, if one cannot be told."""
        grant, source = pushed.grant, pushed.grant.source
        reads = {r.prefill_rank: r for r in plan_reads([e.head_range for e in source.ranks], self.kv_heads())}
        for rank, endpoint in enumerate(source.ranks):
            read = reads.get(rank)
            message = PushMessage(
                PushOp.GRANT, source.push_id, self.endpoint, self.rank, self.kv.tp_size, tuple(grant.local_blocks),
                grant.first_block, grant.num_tokens, None if read is None else (read.src_heads, read.dst_heads),
            )
            try:
                _send(self.datadist, endpoint.ip_info, message)
            except HixlError as exc:
                self.keeper.check(endpoint)
                return f"cannot send its grant to prefill {endpoint.ip_info}: {exc}"
        return ""

    def _withdraw(self, pushed: _Granted) -> None:
        """Deregister the push's windows (no byte lands in them after), then report it."""
        grant = pushed.grant
        began = time.monotonic()
        try:
            self.datadist.engine.deregister_mems(pushed.handles or [])
        except HixlError as exc:  # the engine is finalized: nothing is registered any more
            log.warning("hixl: request %s: withdrawing its push's windows: %s", grant.request_id, exc)
        self.keeper.unwant(grant.request_id)
        reported = time.monotonic()
        withdrawn = (reported - began) * 1e3
        who, nbytes = client_id(grant.request_id), len(grant.local_blocks) * self.cache.cache_desc.row_bytes * self.cache.cache_desc.num_tensors
        with self._cond:
            self._pushes.pop(grant.request_id, None)
            self._by_id.pop(grant.source.push_id, None)
            if pushed.state is PushState.REVOKED:
                self._sending.add(grant.request_id)
                log.info("hixl: request %s: its push was revoked; windows withdrawn in %.2f ms (client request id %s)", grant.request_id, withdrawn, who)
            elif pushed.state is PushState.LANDED:
                self._recving.add(grant.request_id)
            else:
                self._recving.add(grant.request_id)
                self._failed_blocks.update(grant.local_blocks)
                log.warning(
                    "hixl: request %s: push %d failed: %s; windows withdrawn in %.2f ms (client request id %s)",
                    grant.request_id, grant.source.push_id, pushed.why, withdrawn, who,
                )  # fmt: skip
            self._cond.notify_all()  # (wait_for_end)
        transport = transports(self.datadist.engine, (e.ip_info for e in pushed.sources.values()))
        if pushed.state is PushState.LANDED:
            assert pushed.landed is not None
            log.info(
                "hixl: request %s: push %d landed (%d blocks, %.2f MiB from %d prefill rank(s), %.2f ms after the grant, over %s; "
                "client request id %s)",
                grant.request_id, grant.source.push_id, len(grant.local_blocks), nbytes / 2**20, len(pushed.sources),
                (pushed.landed - pushed.began) * 1e3, transport, who,
            )  # fmt: skip
        if self.timeline is not None:
            outcome = {PushState.LANDED: "ok", PushState.REVOKED: "revoked"}.get(pushed.state, f"failed: {pushed.why}")
            trace = Trace(
                "hixl", grant.request_id, self.rank, pushed.began, "push", nbytes=nbytes, issued=pushed.sent, usable=pushed.landed,
                client_id=who, transport=transport, outcome=outcome, reported=reported,
            )  # fmt: skip
            self.timeline.write(trace, grant.trace_headers, grant.arrived)


def dispatch(grants: GrantTable | None, receiver: Receiver | None) -> Callable[[NotifyDesc], None]:
    """The engine's handler for :data:`PUSH_NOTIFY`: a GRANT to the grant table (prefill), a DONE to the
    receiver (decode); anything else, or a message for a side this worker does not have, is refused."""

    def handle(notify: NotifyDesc) -> None:
        message = PushMessage.decode(notify.msg)
        if message.op is PushOp.GRANT and grants is not None:
            grants.on_notify(message)
        elif message.op is PushOp.DONE and receiver is not None:
            receiver.on_done(message)
        else:
            raise AccessDenied(f"this worker takes no push {message.op.value}")

    return handle
