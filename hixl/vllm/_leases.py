"""Leases on prefilled blocks: prefill holds a request's KV while decode keeps extending it.

Theory of operation. Prefill's worker holds a finished request's blocks under a
lease of ``lease_s`` seconds (:class:`LeaseTable`). Decode's worker
(:class:`LeaseKeeper`) extends it while the request waits in decode's queue —
one small engine notification (:data:`LEASE_NOTIFY`, a :class:`LeaseMessage`)
every quarter lease — and releases it when decode drops the request unpulled
(aborted): a release that fails (the link to that prefill broke, its answer
did not come in time) is sent again once the link is back, until the lease
would have run out there anyway. The blocks go when decode's DataDist completion
notification says they were pulled, when decode releases them, when the lease
runs out (decode died, or stopped extending), or at the hard cap
``release_timeout`` after they were first held, however often they were
extended.

Trust. A lease is named by its transfer id, a random 63-bit number that
prefill hands out with the request's ``kv_transfer_params``: it is the
capability. A peer can extend or release only the ids it was given (guessing
one is a 2**-63 chance a try); what it can do with those is bounded — extend
them up to the hard cap, or release them early (which hurts only its own
requests). Messages are parsed strictly (:meth:`LeaseMessage.decode`); a
malformed one, or one naming no held lease, is refused and changes nothing.
Completions and releases that arrive before prefill's worker heard of the
request (its next step) are remembered for a while, in a bounded set.

Tensor parallelism. Every prefill TP rank holds its own KV heads of the
request's blocks under a lease of its own (its own table, the same transfer
id); a rank holding only replicas of heads a lower rank holds is never read
and frees its blocks at once (:attr:`~._params.RemotePrefill.leased` lists the
others). Every decode rank's keeper keeps the leases at every rank in
``leased`` — not only the ranks it reads from itself — so the links it
reports are the same set on every decode rank (the scheduler waits until all
of them report a request's ranks linked), and a lease lives while any decode
rank extends it. The duplicates this sends are harmless: an extension is a
``max``, and a second release (or a completion after a release) of an ended
lease names no held lease.

Decode's side never reads blocks whose lease it cannot vouch for: a lease is
*usable* until half a lease after the last extension prefill accepted (or
after the request arrived, before any), and half a lease before the hard cap;
the other half covers the pull itself and the time the request spent between
the two instances. A request whose lease is no longer usable fails its load
(vLLM then fails or recomputes it, ``kv_load_failure_policy``), never pulls.

Links. The keeper also links to each prefill in the background as soon as a
request naming it arrives, retrying with backoff; decode's scheduler holds such
a request back (:meth:`~hixl.vllm._scheduler.SchedulerSide.num_new_matched_tokens`
answers None) until the worker reports the link up (:class:`~._params.LinkReport`),
or the prefill down (several attempts in a row failed: nobody listens there), or
the request's lease is no longer surely alive.
"""

from __future__ import annotations

import collections
import enum
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .._exceptions import AccessDenied, HixlError, ParamInvalid
from .._types import NotifyDesc
from ..datadist import LLMClusterInfo, LLMDataDist, LLMStatusCode
from ._follow import client_id
from ._params import Endpoint, WatchedLease

__all__ = [
    "LEASE_NOTIFY",
    "Ending",
    "LeaseKeeper",
    "LeaseMessage",
    "LeaseOp",
    "LeaseTable",
    "new_transfer_id",
]

# A child of vLLM's logger: these lines show in vLLM's log, with its format and level.
log = logging.getLogger("vllm.hixl")

LEASE_NOTIFY = "hixl.vllm.lease"
_MAX_ID = 2**63 - 1
# Ends (pulls, releases) heard before the lease was granted: kept this long, at most this many.
_EARLY_TTL_S = 60.0
_MAX_EARLY = 4096
# Decode: extend every quarter lease; a lease is usable for half a lease after the last extension.
_EXTEND_EVERY = 0.25
_USABLE_FOR = 0.5
_NOTIFY_TIMEOUT_S = 2.0
_RELEASE_RETRY_S = 0.5  # pause before a failed release is tried again
_LINK_TIMEOUT_S = 5.0
_LINK_BACKOFF_S = (0.05, 2.0)  # first pause between link attempts, longest
# Failed attempts in a row after which a prefill counts as down: its requests are no longer held
# back (their loads fail now, not half a lease later). A refused connection fails an attempt in a
# fraction of a second, so a dead prefill is down within about a second; a slow handshake takes
# seconds an attempt, and such a prefill is still waited for.
_DOWN_AFTER = 3


def new_transfer_id() -> int:
    """A fresh transfer id: random, so that a peer cannot name a lease it was not given."""
    return 1 + secrets.randbelow(_MAX_ID)


class LeaseOp(enum.Enum):
    """What a :class:`LeaseMessage` asks of prefill."""

    EXTEND = "extend"  # the request still waits at decode: hold its blocks a lease longer
    RELEASE = "release"  # decode dropped the request unpulled: free its blocks now


@dataclass(frozen=True)
class LeaseMessage:
    """One lease request from decode to prefill, carried by an engine notification named :data:`LEASE_NOTIFY`."""

    op: LeaseOp
    transfer_id: int

    def encode(self) -> str:
        """The notification's message: ``{"op": "extend"|"release", "transfer_id": int}``."""
        return json.dumps({"op": self.op.value, "transfer_id": self.transfer_id})

    @classmethod
    def decode(cls, msg: str) -> LeaseMessage:
        """Parse a peer's message strictly; :class:`ParamInvalid` for anything but exactly the encoded form."""
        try:
            doc = json.loads(msg)
        except (ValueError, RecursionError):
            raise ParamInvalid("a lease message must be JSON") from None
        if not isinstance(doc, dict) or set(doc) != {"op", "transfer_id"}:
            raise ParamInvalid("a lease message is {op, transfer_id}")
        tid = doc["transfer_id"]
        if type(tid) is not int or not 1 <= tid <= _MAX_ID:  # bool is an int: not accepted
            raise ParamInvalid("a lease's transfer_id is an int in [1, 2**63)")
        try:
            op = LeaseOp(doc["op"])
        except ValueError:
            raise ParamInvalid(f"unknown lease op {doc['op']!r}") from None
        return cls(op, tid)


class Ending(enum.Enum):
    """Why prefill let a request's blocks go."""

    PULLED = "pulled"
    RELEASED = "released"
    EXPIRED = "expired"
    CAPPED = "capped"
    UNREAD = "unread"  # a TP rank decode never reads (it holds only replicas): freed at once

    @property
    def pulled(self) -> bool:
        """Whether decode was done with the blocks (pulled them, or never needed this rank's), not dropped them."""
        return self in (Ending.PULLED, Ending.UNREAD)


@dataclass
class _Held:
    request_id: str
    granted: float
    expires: float
    extended: float | None = None  # last accepted extension


class LeaseTable:
    """Prefill's held requests and their leases: one lock, fed by the worker and the engine's serve thread.

    ``grant`` (the worker, as it hears of finished requests), ``on_notify``
    (the engine's handler for :data:`LEASE_NOTIFY`, on a serve thread: quick,
    never blocks), ``pulled`` (DataDist's completions) and ``due`` (the worker,
    every step: which requests' blocks vLLM may free).
    """

    def __init__(self, lease_s: float, cap_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < lease_s <= cap_s:
            raise ValueError(f"a lease ({lease_s} s) must be positive and at most the hard cap ({cap_s} s)")
        self.lease_s = lease_s
        self.cap_s = cap_s
        self._clock = clock
        self._lock = threading.Condition()  # notified when a peer ends a lease (wait_for_end)
        self._held: dict[int, _Held] = {}
        self._early: collections.OrderedDict[int, tuple[Ending, float]] = collections.OrderedDict()
        self._ended: list[tuple[int, _Held, Ending]] = []  # ended by a peer, not yet reported by due()

    def grant(self, sends: dict[int, str], read: bool = True) -> None:
        """Hold the blocks of newly finished requests (transfer id -> vLLM request id), a lease each;
        with ``read`` False (a TP rank decode never reads) they are due at once instead."""
        now = self._clock()
        with self._lock:
            for transfer_id, request_id in sends.items():
                held = _Held(request_id, now, now + self.lease_s)
                early = self._early.pop(transfer_id, None)
                if not read:
                    self._ended.append((transfer_id, held, Ending.UNREAD))
                elif early is not None:
                    self._ended.append((transfer_id, held, early[0]))
                else:
                    self._held[transfer_id] = held

    def on_notify(self, notify: NotifyDesc) -> None:
        """The engine's handler: apply one peer's :class:`LeaseMessage`, or refuse it (raise)."""
        message = LeaseMessage.decode(notify.msg)
        if message.op is LeaseOp.EXTEND:
            self._extend(message.transfer_id)
        else:
            self._end(message.transfer_id, Ending.RELEASED)

    def pulled(self, transfer_ids: Iterable[int]) -> None:
        """Decode reported these pulled (DataDist's completion notifications)."""
        for transfer_id in transfer_ids:
            self._end(transfer_id, Ending.PULLED)

    def _extend(self, transfer_id: int) -> None:
        now = self._clock()
        with self._lock:
            held = self._held.get(transfer_id)
            if held is None:
                # Not granted yet (its worker step is still to come) or already gone: decode
                # learns only that this extension did not count, and keeps its own clock.
                raise AccessDenied(f"no lease is held for transfer {transfer_id}")
            held.expires = max(held.expires, min(now + self.lease_s, held.granted + self.cap_s))
            held.extended = now

    def _end(self, transfer_id: int, why: Ending) -> None:
        now = self._clock()
        with self._lock:
            held = self._held.pop(transfer_id, None)
            if held is not None:
                self._ended.append((transfer_id, held, why))
                self._lock.notify_all()
                return
            # Perhaps heard before the grant: remember it, boundedly (a peer can make up ids).
            while self._early and (len(self._early) >= _MAX_EARLY or next(iter(self._early.values()))[1] < now - _EARLY_TTL_S):
                self._early.popitem(last=False)
            self._early[transfer_id] = (why, now)

    def wait_for_end(self, timeout: float) -> None:
        """Sleep up to ``timeout`` or until decode releases a lease: paces an engine that steps only to
        hear about its held blocks (vLLM steps without pause while a finished request holds blocks, and its
        worker busy-waits between steps; see :mod:`._affinity`). Completions are seen at the next step."""
        with self._lock:
            if self._held and not self._ended:
                self._lock.wait(timeout)

    def due(self) -> dict[str, Ending]:
        """Request ids whose blocks vLLM may free now, with why (each logged); drains."""
        now = self._clock()
        with self._lock:
            ended, self._ended = self._ended, []
            for transfer_id, held in list(self._held.items()):
                if now >= held.granted + self.cap_s:
                    ended.append((transfer_id, held, Ending.CAPPED))
                elif now >= held.expires:
                    ended.append((transfer_id, held, Ending.EXPIRED))
                else:
                    continue
                del self._held[transfer_id]
        for _, held, why in ended:
            self._log(held, why, now)
        return {held.request_id: why for _, held, why in ended}

    def _log(self, held: _Held, why: Ending, now: float) -> None:
        if why is Ending.PULLED:
            log.info("hixl: request %s was pulled by decode; its blocks are released", held.request_id)
        elif why is Ending.UNREAD:
            log.info(
                "hixl: request %s: decode reads this rank's KV heads from a lower rank; its blocks are released",
                held.request_id,
            )
        elif why is Ending.RELEASED:
            log.info(
                "hixl: request %s was released by decode unpulled after %.2f s held, %.2f s before its lease "
                "would have expired; its blocks are released",
                held.request_id, now - held.granted, max(0.0, held.expires - now),
            )
        elif why is Ending.EXPIRED:
            log.warning(
                "hixl: request %s: its lease expired (%.1f s without an extension from decode, %.2f s held); "
                "releasing its blocks",
                held.request_id, self.lease_s, now - held.granted,
            )
        else:
            log.warning(
                "hixl: request %s was held %.0f s (release_timeout, the most decode may extend a lease); "
                "releasing its blocks",
                held.request_id, self.cap_s,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __repr__(self) -> str:
        return f"<LeaseTable held={len(self)} lease={self.lease_s}s cap={self.cap_s}s>"


class LinkState(enum.Enum):
    """Decode's link to one prefill endpoint, as its keeper sees it."""

    LINKING = "linking"  # not linked yet, or being checked again after a failed pull
    UP = "up"


class _Answer(enum.Enum):
    """What became of one lease message sent to a prefill rank."""

    ACCEPTED = "accepted"
    REFUSED = "refused"  # that rank holds no such lease (not yet, or no more)
    FAILED = "failed"  # no answer in time, or the link broke: it may not have arrived


@dataclass
class _Link:
    state: LinkState = LinkState.LINKING
    attempts: int = 0  # failed in a row
    next_try: float = 0.0
    tries: int = 0  # attempts ended, ever (what relink waits on)


@dataclass
class _Kept:
    """One request's lease at one prefill rank."""

    lease: WatchedLease
    endpoint: Endpoint
    basis: float  # when the last accepted extension was sent (the request's arrival, before any)
    next_extend: float = 0.0  # when the thread next sends for it (an extension, or a release)
    release: bool = False  # decode dropped it unpulled: the thread releases it, then forgets it


class LeaseKeeper:
    """Decode's side: links to prefills in the background and extends (or releases) the leases of waiting requests.

    One thread, whatever the number of prefills and requests. The worker calls
    :meth:`watch` / :meth:`drop` with each step's orders, :meth:`usable` and
    :meth:`linked` before a pull, :meth:`check` after a failed one,
    :meth:`relink` and :meth:`confirm` before retrying a pull whose link broke,
    :meth:`ready` to report links to the scheduler.
    """

    def __init__(self, datadist: LLMDataDist, clock: Callable[[], float] = time.monotonic) -> None:
        self.datadist = datadist
        self._clock = clock
        self._cond = threading.Condition()
        self._links: dict[Endpoint, _Link] = {}
        self._kept: dict[str, dict[Endpoint, _Kept]] = {}  # vLLM request id -> its lease at each prefill rank
        self._wanted: dict[str, frozenset[Endpoint]] = {}  # links kept for requests without a lease (push mode)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hixl-vllm-leases", daemon=True)
        self._thread.start()

    # -- the worker's calls ------------------------------------------------------------------------
    def watch(self, leases: Iterable[WatchedLease]) -> None:
        """Keep these requests' leases alive at every prefill rank holding their blocks (and link to those
        ranks) until dropped or pulled."""
        with self._cond:
            for lease in leases:
                self._kept[lease.request_id] = {e: _Kept(lease, e, lease.arrived) for e in lease.remote.leased}
                for endpoint in lease.remote.leased:
                    self._links.setdefault(endpoint, _Link())
            self._cond.notify_all()

    def drop(self, request_ids: Iterable[str], release: bool) -> None:
        """Stop extending these requests' leases; with ``release``, tell every prefill rank to free the
        blocks now (as soon as it is linked; not past the time its lease would have run out)."""
        with self._cond:
            for request_id in request_ids:
                if not release:
                    self._kept.pop(request_id, None)
                    continue
                parts = self._kept.get(request_id, {})
                if parts and not any(kept.release for kept in parts.values()):
                    log.info(
                        "hixl: request %s ended here unpulled; its blocks are released at prefill (client request id %s)",
                        request_id, client_id(request_id),
                    )  # fmt: skip
                for kept in parts.values():
                    kept.release, kept.next_extend = True, 0.0
            self._cond.notify_all()

    def want(self, key: str, endpoints: Iterable[Endpoint]) -> None:
        """Link to ``endpoints`` and keep them linked until :meth:`unwant` (``key``), with no lease to keep:
        a pushed request's prefill ranks, which decode tells where to write (:mod:`._push`)."""
        with self._cond:
            self._wanted[key] = frozenset(endpoints)
            for endpoint in self._wanted[key]:
                self._links.setdefault(endpoint, _Link())
            self._cond.notify_all()

    def unwant(self, key: str) -> None:
        """The links :meth:`want` asked for under ``key`` are no longer needed for it."""
        with self._cond:
            self._wanted.pop(key, None)

    def usable(self, request_id: str) -> bool:
        """True while the request's blocks are surely still held by every prefill rank holding them (see
        the module docstring)."""
        now = self._clock()
        with self._cond:
            parts = self._kept.get(request_id)
            if not parts or any(kept.release for kept in parts.values()):
                return False
            lease = next(iter(parts.values())).lease
            basis = min(kept.basis for kept in parts.values())
            half = _USABLE_FOR * lease.remote.lease_s
            return now < min(basis + half, lease.arrived + lease.remote.hold_cap_s - half)

    def linked(self, endpoint: Endpoint) -> bool:
        """True if the link to ``endpoint`` is up (as far as the keeper knows)."""
        with self._cond:
            link = self._links.get(endpoint)
            return link is not None and link.state is LinkState.UP

    def ready(self) -> frozenset[Endpoint]:
        """Endpoints whose links are up."""
        with self._cond:
            return self._up_locked()

    def down(self) -> frozenset[Endpoint]:
        """Endpoints whose last few link attempts all failed (still retried, with backoff)."""
        with self._cond:
            return frozenset(e for e, link in self._links.items() if link.attempts >= _DOWN_AFTER)

    def check(self, endpoint: Endpoint) -> None:
        """A pull from ``endpoint`` failed: link again (a no-op round trip if the link is fine)."""
        with self._cond:
            link = self._links.get(endpoint)
            if link is not None and link.state is LinkState.UP:
                link.state, link.attempts, link.next_try = LinkState.LINKING, 0, 0.0
                self._cond.notify_all()

    def relink(self, endpoint: Endpoint, timeout: float) -> bool:
        """A pull from ``endpoint`` broke on its link: link again now and wait up to ``timeout`` for it;
        True once the link is up.

        The attempt is the keeper thread's, as every link is (one thread links, so no two
        attempts at one prefill race), made at once rather than after its backoff: a prefill
        found down a moment ago gets one more attempt, which a refused connection fails fast.
        """
        deadline = self._clock() + timeout
        with self._cond:
            link = self._links.setdefault(endpoint, _Link())
            tried = link.tries
            link.state, link.next_try = LinkState.LINKING, 0.0
            self._cond.notify_all()
            while not self._closed and self._links.get(endpoint) is link and link.tries == tried:
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._links.get(endpoint) is link and link.state is LinkState.UP

    def confirm(self, request_id: str, endpoint: Endpoint, timeout: float) -> bool:
        """Extend the request's lease at ``endpoint`` now and wait up to ``timeout`` for prefill's answer:
        True only if prefill accepted it.

        An accepted extension is prefill's word that it still holds the request's blocks for
        another lease (a prefill that freed them, or a new process at that address, holds no
        such lease and refuses it): what a pull retried after a relink reads under.
        """
        with self._cond:
            kept = self._kept.get(request_id, {}).get(endpoint)
            if kept is None or kept.release:
                return False
        sent = self._clock()
        answer = self._notify(endpoint, LeaseMessage(LeaseOp.EXTEND, kept.lease.remote.transfer_id), set(), max(0.001, timeout))
        if answer is not _Answer.ACCEPTED:
            return False
        with self._cond:
            kept.basis = max(kept.basis, sent)
        return True

    def wait_for_link(self, timeout: float) -> None:
        """Sleep up to ``timeout`` or until a link comes up (at once if none is being made): paces an
        engine whose only requests wait for links."""
        with self._cond:
            if all(link.state is LinkState.UP for link in self._links.values()):
                return
            up = self._up_locked()
            self._cond.wait_for(lambda: self._closed or self._up_locked() != up, timeout)

    def _up_locked(self) -> frozenset[Endpoint]:
        return frozenset(e for e, link in self._links.items() if link.state is LinkState.UP)

    def close(self) -> None:
        """Stop the thread (leases of requests still waiting run out at prefill)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=_LINK_TIMEOUT_S + _NOTIFY_TIMEOUT_S)

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self._clock()
                wake = self._next_wake(now)
                if wake > now:
                    self._cond.wait(min(wake - now, 1.0))
                    continue
                to_link = [e for e, link in self._links.items() if link.state is LinkState.LINKING and link.next_try <= now]
                work = [k for parts in self._kept.values() for k in parts.values() if k.next_extend <= now]
            for endpoint in to_link:
                self._try_link(endpoint)
            self._send(work)
            self._forget_unused_links()

    def _next_wake(self, now: float) -> float:
        wakes = [link.next_try for link in self._links.values() if link.state is LinkState.LINKING]
        for kept in (k for parts in self._kept.values() for k in parts.values()):
            link = self._links.get(kept.endpoint)
            if link is not None and link.state is LinkState.UP:
                wakes.append(kept.next_extend)
            elif kept.release:  # (unlinked: given up once its lease would have run out)
                wakes.append(max(kept.next_extend, self._released_by(kept)))
        return min(wakes, default=now + 1.0)

    def _try_link(self, endpoint: Endpoint) -> None:
        started = self._clock()
        try:
            status = self._link(endpoint)
        except HixlError as exc:  # e.g. the engine is finalized under us
            status, detail = LLMStatusCode.LINK_FAILED, str(exc)
        else:
            detail = status.name
        with self._cond:
            link = self._links.get(endpoint)
            if link is None:
                return
            link.tries += 1
            self._cond.notify_all()  # for relink, whichever way it went
            if status in (LLMStatusCode.SUCCESS, LLMStatusCode.ALREADY_LINK):
                log.info(
                    "hixl: linked to prefill %s (cluster %d) in %.1f ms, after %d failed attempts",
                    endpoint.ip_info, endpoint.cluster_id, (self._clock() - started) * 1e3, link.attempts,
                )
                link.state, link.attempts = LinkState.UP, 0
                return
            link.attempts += 1
            pause = min(_LINK_BACKOFF_S[1], _LINK_BACKOFF_S[0] * 2 ** (link.attempts - 1))
            link.next_try = self._clock() + pause
        log.warning(
            "hixl: link to prefill %s (cluster %d), attempt %d, failed after %.2f s: %s; retrying in %.2f s",
            endpoint.ip_info, endpoint.cluster_id, link.attempts, self._clock() - started, detail, pause,
        )

    def _link(self, endpoint: Endpoint) -> LLMStatusCode:
        linked = self.datadist.linked_clusters().get(endpoint.cluster_id)
        if linked is not None and linked != endpoint.ip_info:  # that id lives elsewhere: a prefill restarted with it
            self.datadist.unlink_clusters([LLMClusterInfo(endpoint.cluster_id, linked)], force=True)
        # Also when linked at this address: DataDist answers ALREADY_LINK for a live link and links
        # anew to a prefill restarted there (a new incarnation), whose old link is dead.
        (status,) = self.datadist.link_clusters([LLMClusterInfo(endpoint.cluster_id, endpoint.ip_info)], _LINK_TIMEOUT_S)
        return status

    @staticmethod
    def _released_by(kept: _Kept) -> float:
        """When the lease at that prefill rank has surely run out without us: no use releasing it then."""
        return kept.basis + kept.lease.remote.lease_s

    def _send(self, work: list[_Kept]) -> None:
        slow: set[Endpoint] = set()  # one timeout per prefill rank a round, not one per lease
        for kept in work:
            endpoint, request_id = kept.endpoint, kept.lease.request_id
            if kept.release and self._clock() >= self._released_by(kept):
                log.info("hixl: request %s: gave up releasing it at prefill %s; its lease there has run out", request_id, endpoint.ip_info)
                self._forget(kept)
                continue
            if endpoint in slow or not self.linked(endpoint):
                continue
            op = LeaseOp.RELEASE if kept.release else LeaseOp.EXTEND
            sent = self._clock()
            answer = self._notify(endpoint, LeaseMessage(op, kept.lease.remote.transfer_id), slow)
            with self._cond:
                if self._kept.get(request_id, {}).get(endpoint) is not kept:
                    continue  # dropped (or watched anew) meanwhile
                if kept.release and op is LeaseOp.EXTEND:
                    kept.next_extend = 0.0  # dropped while the extension was on its way: the release next
                elif op is LeaseOp.RELEASE and answer is not _Answer.FAILED:
                    self._forget(kept)  # (refused: prefill holds no such lease any more, nothing to release)
                elif op is LeaseOp.RELEASE:
                    kept.next_extend = sent + _RELEASE_RETRY_S  # again, once the link is back if it broke
                else:
                    if answer is _Answer.ACCEPTED:
                        kept.basis = max(kept.basis, sent)
                    kept.next_extend = sent + _EXTEND_EVERY * kept.lease.remote.lease_s

    def _forget(self, kept: _Kept) -> None:
        with self._cond:
            parts = self._kept.get(kept.lease.request_id, {})
            if parts.get(kept.endpoint) is kept:
                del parts[kept.endpoint]
                if not parts:
                    del self._kept[kept.lease.request_id]

    def _notify(self, endpoint: Endpoint, message: LeaseMessage, slow: set[Endpoint], timeout: float = _NOTIFY_TIMEOUT_S) -> _Answer:
        try:
            self.datadist.engine.send_notify(endpoint.ip_info, NotifyDesc(LEASE_NOTIFY, message.encode()), timeout)
            return _Answer.ACCEPTED
        except AccessDenied:
            return _Answer.REFUSED  # prefill holds no such lease (not yet, or no more): this extension does not count
        except TimeoutError:
            slow.add(endpoint)
        except HixlError as exc:
            log.info("hixl: lease %s of transfer %d at %s: %s", message.op.value, message.transfer_id, endpoint.ip_info, exc)
            self.check(endpoint)
        return _Answer.FAILED

    def _forget_unused_links(self) -> None:
        """Stop retrying links no waiting request wants (a prefill that is gone); live links stay."""
        with self._cond:
            wanted = {endpoint for parts in self._kept.values() for endpoint in parts}
            wanted.update(endpoint for endpoints in self._wanted.values() for endpoint in endpoints)
            for endpoint in [e for e, link in self._links.items() if link.state is LinkState.LINKING and e not in wanted]:
                del self._links[endpoint]

    def __repr__(self) -> str:
        with self._cond:
            links = {e.ip_info: link.state.value for e, link in self._links.items()}
            return f"<LeaseKeeper leases={len(self._kept)} links={links}>"
