"""The reading side: wait for versions, pull them (whole or sharded), gather rows of tables.

A pull of version ``v`` is, in order: find ``v``'s manifest (the publisher's
metadata; cached per slot), *acquire* ``v`` (a notification the publisher
answers by granting a lease on its slot, or refuses if the slot is no longer
``v``'s), READ every byte of the plan in one batched transfer, READ the slot's
header word in a second transfer, and *release* ``v``. The pull returns only if
the header word still says ``v`` — the publisher zeroes it before it writes a
byte of that slot again, and a later transfer is not started before the earlier
one has finished, so every byte read came from ``v`` — and, with ``verify``,
only if every tensor read whole has ``v``'s checksum (where ``v`` has checksums). Otherwise it raises
:class:`Superseded`, and what it wrote into ``out`` is unspecified (a pull of
"the newest" tries the newest again first, a few times).

The release is automatic: a pull holds its lease only while it runs.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._exceptions import (
    AlreadyConnected,
    HixlError,
    HixlTimeout,
    MemoryRangeError,
    NotConnected,
    ParamInvalid,
    PeerDisconnected,
)
from .._memory import empty
from .._types import CheckedRows, MemDesc, MemHandle, NotifyDesc, Op, TransferOpDesc
from ..engine import Engine
from . import _checks, _wire
from ._errors import ManifestError, Superseded, TornRows
from ._lanes import spread
from ._manifest import Manifest, within
from ._plan import BytePlan, make_plan
from ._rows import TableInfo, accept, check_name
from ._tensors import DTYPES, byte_array, view_of

__all__ = ["Subscriber"]

log = logging.getLogger("hixl.weights")

_ATTEMPTS = 4
"""Tries of a pull of the newest version, each of the then newest, before :class:`Superseded` is raised."""
_NUMPY_DTYPES = {name: np.dtype(name) for name in DTYPES if hasattr(np, name)}
"""numpy's own dtype objects (one per type), for pull_rows' quick look at ``out``; others take view_of's."""
_ROW_TRIES = 16
"""READs of a row gather (the first and re-reads of the rows found torn) before :class:`TornRows`."""
_ROW_PAUSE = 50e-6
_LINK_CHECK = 0.2
"""Seconds between looks at the link while waiting for a version (a dead publisher ends the wait)."""
_STALLED = 1.0
"""A wait that overslept by this much means this process was stopped: it subscribes again."""


class Subscriber:
    """Reads the versions a :class:`~hixl.weights.Publisher` (or :class:`~hixl.weights.Relay`) at
    ``publisher_address`` publishes, and the rows of its :class:`~hixl.weights.Table`\\ s.

    Connects ``engine`` to it if it is not connected yet. ``verify``: check the checksum of every
    tensor pulled whole, where the publisher gives checksums (about 0.2 s per GiB on one core, 0.3 s
    without the C extension, spread over the engine's ``copy_lanes``; the lease and header-word
    checks, which prove a pull is one whole version, are always made).
    ``timeout`` (seconds) is the default of every call's; None takes the engine's ``transfer_timeout``.
    :meth:`wait_version` needs ``engine`` to listen: the publisher connects back to it to notify it.
    Destinations are registered with ``engine`` the first time they are used and stay
    registered (and referenced) until :meth:`close`.
    """

    def __init__(
        self, engine: Engine, publisher_address: str, *, verify: bool = True, timeout: float | None = None
    ) -> None:
        self.engine = engine
        self.address = publisher_address
        self.verify = verify
        self._lanes = int(engine.options["copy_lanes"])
        self.timeout = float(engine.options["transfer_timeout"] if timeout is None else timeout)
        self._dialed = False
        try:
            engine.connect(publisher_address, self.timeout)
            self._dialed = True
        except AlreadyConnected:
            pass
        self._publisher = engine.peer_incarnation(publisher_address)
        # Where a slot's header word is read into. Pool memory: an engine that has some registered
        # can be reached over shm, so the publisher can connect back (to notify) even when shm is forced.
        self._header = empty(1, np.uint64, shared=True)
        self._handles = [engine.register_mem(self._header)]
        self._registered: dict[tuple[int, int], Any] = {}  # destinations registered here -> their owners
        self._manifests: dict[int, Manifest] = {}
        self._tables: dict[str, TableInfo] = {}
        self._scratch: np.ndarray | None = None  # where row gathers land
        self._scratch_handle: MemHandle | None = None
        self._scratch_addr = 0  # its address
        self._lock = threading.Lock()  # one pull or gather at a time: they share the words above
        self._heard = threading.Condition()
        self._newest_heard = 0
        self._token: str | None = None
        self._closed = False
        self.version = 0
        """The version the last pull that returned pulled (0: none yet)."""

    # -- versions ---------------------------------------------------------------------------------
    def wait_version(self, min_version: int = 1, timeout: float | None = None) -> int:
        """Wait until the publisher has published ``min_version`` or later; return the newest it has.

        Learns of versions by notification: each call (re)subscribes — a subscriber the publisher
        dropped, having found it stalled, is taken back — and asks once for the newest version,
        then sleeps until a notification (or ``timeout``). Raises :class:`HixlTimeout` after
        ``timeout`` seconds, :class:`PeerDisconnected` if the publisher goes away meanwhile.
        """
        deadline = self._deadline(timeout)
        self._subscribe(deadline)
        while True:
            with self._heard:
                if self._newest_heard >= min_version:
                    return self._newest_heard
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HixlTimeout(f"{self.address} published no version >= {min_version} within {timeout} s")
                slept = time.monotonic()
                self._heard.wait(min(left, _LINK_CHECK))
            self.engine.transport_of(self.address)  # raises if the link to the publisher broke
            if time.monotonic() - slept > _LINK_CHECK + _STALLED:  # this process was stopped: maybe dropped
                self._subscribe(deadline)

    def _subscribe(self, deadline: float) -> None:
        """Ask the publisher to notify this subscriber (again: it drops the ones it finds stalled),
        then catch up with what it published before that took effect."""
        if ":" not in self.engine.local_engine:
            raise ParamInvalid("wait_version needs a listening engine (\"ip:port\"): the publisher notifies it")
        if self._token is None:
            self._token = secrets.token_hex(8)
            self.engine.handle_notifies(_wire.version_name(self._token), self._on_version)
        message = _wire.encode(address=self.engine.local_engine, engine=self.engine.incarnation, token=self._token)
        self.engine.send_notify(self.address, NotifyDesc(_wire.SUBSCRIBE, message), self._left(deadline))
        self._latest(deadline)

    def _on_version(self, notify: NotifyDesc) -> None:
        if self._closed:
            raise HixlError("this subscriber is closed")
        doc = _wire.decode(notify.msg, version=int, slot=int, publisher=str)
        if doc["publisher"] != self._publisher:
            raise ManifestError(f"a version notification from another publisher than {self.address}")
        self._hear(doc["version"])

    def _hear(self, version: int) -> None:
        with self._heard:
            if version > self._newest_heard:
                self._newest_heard = version
                self._heard.notify_all()

    def _latest(self, deadline: float) -> tuple[int, int, int]:
        """``(version, slot, slots)`` of the publisher's newest version, asked now."""
        data = self.engine.get_remote_metadata(self.address, _wire.LATEST_KEY, self._left(deadline))
        doc = _wire.decode(data, version=int, slot=int, slots=int)
        if not 1 <= doc["slots"] <= 1 << 16 or doc["slot"] >= doc["slots"]:
            raise ManifestError(f"{self.address} names slot {doc['slot']} of {doc['slots']}")
        self._hear(doc["version"])
        return doc["version"], doc["slot"], doc["slots"]

    # -- manifests --------------------------------------------------------------------------------
    def manifest(self, version: int | None = None, *, timeout: float | None = None) -> Manifest:
        """The manifest of ``version`` (None: the newest), checked; :class:`Superseded` if it is gone."""
        return self._locate(version, self._deadline(timeout))

    def _locate(self, version: int | None, deadline: float) -> Manifest:
        newest, slot, slots = self._latest(deadline)
        if newest == 0:
            raise HixlError(f"{self.address} has published nothing yet: wait_version() first")
        if version is None:  # the newest: what the newest's slot holds (newer still, if it was rewritten)
            manifest = self._manifests.get(slot)
            if manifest is None or manifest.version < newest:
                manifest = self._fetch(slot, deadline)
            if manifest is not None and manifest.version >= newest:
                return manifest
        else:
            for index in range(slots):
                manifest = self._manifests.get(index)
                if manifest is None or manifest.version != version:
                    manifest = self._fetch(index, deadline)
                if manifest is not None and manifest.version == version:
                    return manifest
        raise Superseded(f"version {version or newest} is no longer published by {self.address}")

    def _fetch(self, slot: int, deadline: float) -> Manifest | None:
        try:
            data = self.engine.get_remote_metadata(self.address, _wire.slot_key(slot), self._left(deadline))
        except ParamInvalid:
            return None  # a slot never written
        manifest = Manifest.decode(data, self.engine.remote_mems(self.address))
        if manifest.slot != slot:
            raise ManifestError(f"{self.address}'s slot {slot} holds a manifest of slot {manifest.slot}")
        self._manifests[slot] = manifest
        return manifest

    def plan(
        self, out: Mapping[str, Any], *, names: Any = None, version: int | None = None, timeout: float | None = None
    ) -> BytePlan:
        """The byte plan that fills ``out`` (see :meth:`pull`), made against ``version``'s layout.

        Pass it to :meth:`pull` in place of ``out`` to skip planning; it replays for every version
        with the same layout (and is made again, transparently, for one without).
        """
        return make_plan(self.manifest(version, timeout=timeout), out, names)

    # -- pulls ------------------------------------------------------------------------------------
    def pull(
        self,
        out: Mapping[str, Any] | BytePlan,
        *,
        version: int | None = None,
        names: Any = None,
        timeout: float | None = None,
    ) -> int:
        """Fill ``out``'s tensors in place from one published version, in one batched READ; return it.

        ``out`` maps tensor names to numpy arrays or torch CPU tensors of the published dtype and
        shape, or to :class:`~hixl.weights.Shard`\\ s (a part of the tensor); or it is a
        :class:`~hixl.weights.BytePlan`. ``names``: only these entries of ``out``. ``version``:
        exactly that version (None: the newest). Returns the version pulled: every byte written
        comes from it. Raises :class:`Superseded` if that cannot be proven (``out`` then holds an
        unspecified mix), :class:`PeerDisconnected` if the publisher goes away, :class:`HixlTimeout`.
        """
        deadline = self._deadline(timeout)
        with self._lock:
            self._check_open()
            for attempt in range(_ATTEMPTS if version is None else 1):
                manifest = self._locate(version, deadline)
                if isinstance(out, BytePlan):
                    plan = out if out.layout == manifest.layout else make_plan(manifest, *out.source)
                else:
                    plan = make_plan(manifest, out, names)
                try:
                    self._read(manifest, plan, deadline)
                except Superseded:
                    if version is not None or attempt == _ATTEMPTS - 1:
                        raise
                    continue
                self.version = manifest.version
                return manifest.version
        raise AssertionError("unreachable")  # the loop returns or raises

    def _read(self, manifest: Manifest, plan: BytePlan, deadline: float) -> None:
        """One try of a pull (see the module docstring)."""
        self._register(plan)
        checked = _checks.ENABLED
        if checked:
            self._notify(_wire.ACQUIRE, manifest.version, deadline)
        try:
            if len(plan.runs):
                self.engine.transfer_sync(self.address, Op.READ, plan.descriptors(manifest), self._left(deadline))
            if checked:
                header = TransferOpDesc(int(self._header.ctypes.data), manifest.header, 8)
                self.engine.transfer_sync(self.address, Op.READ, [header], self._left(deadline))
                _checks.check_header(int(self._header[0]), manifest.version, f"{self.address}:{manifest.slot}")
        finally:
            if checked:
                try:
                    self._notify(_wire.RELEASE, manifest.version, deadline)
                except HixlError as exc:  # the lease runs out by itself
                    log.debug("hixl.weights: release of version %d failed: %s", manifest.version, exc)
        if checked and self.verify and manifest.checksummed:
            names, landed = list(plan.whole), [byte_array(dest) for dest in plan.whole.values()]
            sums = spread(_checks.checksum_of, landed, [len(a) for a in landed], self._lanes)
            for name, checksum in zip(names, sums):
                if checksum != manifest.tensor(name).checksum:
                    raise Superseded(f"{name!r} of version {manifest.version} does not match its checksum")

    def _notify(self, name: str, version: int, deadline: float) -> None:
        try:
            self.engine.send_notify(self.address, NotifyDesc(name, _wire.encode(version=version)), self._left(deadline))
        except (PeerDisconnected, NotConnected, HixlTimeout):
            raise
        except HixlError as exc:  # the publisher refused: the version is gone (or going)
            raise Superseded(f"{self.address} refused version {version}: {exc}") from exc

    def _register(self, plan: BytePlan) -> None:
        """Register the destinations the engine does not cover yet (a READ lands only in registered
        memory), keeping each one's owner alive while it is registered."""
        mine = self.engine.local_mems()
        for start, end, owner in plan.targets:
            if (start, end) not in self._registered and not within(start, end - start, mine):
                self._handles.append(self.engine.register_mem(MemDesc(start, end - start)))
                self._registered[(start, end)] = owner

    # -- rows -------------------------------------------------------------------------------------
    def pull_rows(
        self, name: str, indices: Any, out: Any, *, versions: np.ndarray | None = None, timeout: float | None = None
    ) -> int:
        """Gather rows ``indices`` of the publisher's table ``name`` into ``out`` in one batched READ.

        ``out``: a C-contiguous numpy array or torch CPU tensor of shape ``(len(indices), *row_shape)``
        and the table's dtype. Each row is a consistent copy of one of its versions: rows caught
        mid-update are read again (one batched READ for all of them), up to 16 READs in all, then
        :class:`TornRows` is raised (``out``'s rows are then not to be used). ``versions``, if given (int64, one per
        index), receives each row's version (the table update that last wrote it). Returns the
        newest of them. :class:`ParamInvalid` (nothing read or written) for indices that are not
        integers in ``[0, rows)`` in one dimension, or a wrong ``out`` or ``versions``;
        :class:`~hixl.MemoryRangeError` if the table is no longer served (closed, or made again).
        """
        deadline = self._deadline(timeout)
        with self._lock:
            self._check_open()
            info = self._table(check_name(name), deadline)
            rows = indices if type(indices) is np.ndarray else np.asarray(indices)
            if rows.ndim != 1 or (len(rows) and rows.dtype.kind not in "iu"):
                raise ParamInvalid("indices must be a 1-D sequence of row numbers")
            if rows.dtype != np.int64 or not rows.flags.c_contiguous:
                rows = np.ascontiguousarray(rows, dtype=np.int64)
            shape = (len(rows), *info.row_shape)
            if not (type(out) is np.ndarray and out.dtype is _NUMPY_DTYPES.get(info.dtype) and out.shape == shape and out.flags.c_contiguous):
                dest = view_of(out)  # (a tensor, or the error that says what is wrong)
                if dest.dtype != info.dtype or dest.shape != shape or not _contiguous(dest):
                    raise ParamInvalid(f"out must be C-contiguous {info.dtype} of shape {shape}, not {dest.dtype} {dest.shape}")
            if versions is not None and (
                not isinstance(versions, np.ndarray) or versions.shape != (len(rows),) or versions.dtype != np.int64
                or not versions.flags.c_contiguous
            ):
                raise ParamInvalid(f"versions must be a contiguous int64 array of shape ({len(rows)},)")
            if not len(rows):
                return 0
            seen = np.empty(len(rows), dtype=np.int64) if versions is None else versions
            landing = out.view(np.uint8) if isinstance(out, np.ndarray) else byte_array(out)  # (checked above)
            try:
                self._gather(info, rows, landing, seen, deadline)
            except MemoryRangeError as exc:
                del self._tables[info.name]  # (a table made again under the name is looked up anew)
                raise MemoryRangeError(
                    f"table {info.name!r} is no longer served by {self.address} (closed, or made again): {exc}"
                ) from exc
            return int(seen.max())

    def _gather(self, info: TableInfo, rows: np.ndarray, out: np.ndarray, versions: np.ndarray, deadline: float) -> None:
        """Rows ``rows`` of ``info``'s table, each accepted (see :mod:`._rows`): payloads into ``out``,
        versions into ``versions``; :class:`TornRows` if some row stays torn.

        The common case is one call, :meth:`hixl.Engine.read_rows` of the batch (checked as two ranges,
        not a descriptor per row): where the transport checks each row's sequence word around its copy,
        the rows land straight in ``out`` (shm); elsewhere they land in a scratch buffer, and one pass
        over it checks each row's hash and, if all are whole, hands them over (:func:`._rows.accept`).
        """
        torn = np.empty(len(rows), dtype=np.int64)
        count = self._read_rows(info, rows, out, versions, torn, deadline)
        if count == -1:
            self._accept_copies(info, rows, out, versions, torn, deadline)
        elif count:
            self._land_torn(info, rows, out, versions, torn[:count].copy(), deadline)

    def _read_rows(self, info: TableInfo, rows: np.ndarray, out: np.ndarray, versions: np.ndarray, torn: np.ndarray, deadline: float) -> int:
        """One :meth:`hixl.Engine.read_rows` of ``rows`` into the scratch's first slots, checked where it can
        be (see :class:`~hixl.CheckedRows`): how many are torn, or -1 (the rows are in the scratch)."""
        stride = info.stride
        self._scratch_of(len(rows) * stride)
        checked = CheckedRows(info.rows, info.row_bytes, out, versions, torn, _checks.ENABLED)
        try:
            return self.engine.read_rows(  # type: ignore[return-value]  # (an int, given checked)
                self.address, self._scratch_addr, info.region.addr, stride, rows, self._left(deadline), checked=checked
            )
        except MemoryRangeError:
            raise  # (a ParamInvalid: the table is no longer where it was)
        except ParamInvalid as exc:  # (everything else about the call is this class's own doing)
            raise ParamInvalid(f"row numbers must be in [0, {info.rows}) for table {info.name!r}") from exc

    def _accept_copies(
        self, info: TableInfo, rows: np.ndarray, out: np.ndarray, versions: np.ndarray, torn: np.ndarray, deadline: float
    ) -> None:
        """The rows read into the scratch, checked by their hashes and handed over if all are whole (``out`` and
        ``versions`` untouched until then); torn ones read again into their own slots, 16 tries in all."""
        stride = info.stride
        assert self._scratch is not None
        words = self._scratch[: len(rows) * stride].view(np.uint64)
        for attempt in range(_ROW_TRIES):
            count = accept(words, stride // 8, info.row_bytes, out, versions, torn)
            if not count:
                return
            if attempt == _ROW_TRIES - 1:
                break
            self._pause(attempt)
            pending = torn[:count]
            descs = np.empty((count, 3), dtype=np.uint64)
            descs[:, 0] = self._scratch_addr + pending * stride
            descs[:, 1] = info.region.addr + rows[pending] * stride
            descs[:, 2] = stride
            self.engine.transfer_sync(self.address, Op.READ, descs, self._left(deadline))
        raise TornRows(
            f"{count} row(s) of table {info.name!r} were being updated on each of {_ROW_TRIES} reads",
            [int(i) for i in torn[:count]],
        )

    def _land_torn(
        self, info: TableInfo, rows: np.ndarray, out: np.ndarray, versions: np.ndarray, pending: np.ndarray, deadline: float
    ) -> None:
        """Rows at positions ``pending`` came torn from a checked read that landed the rest in ``out``: read them
        again (all pending at once, 16 reads in all), each landed the moment it comes whole."""
        landed = out.reshape(len(rows), info.row_bytes)
        for attempt in range(1, _ROW_TRIES):
            self._pause(attempt - 1)
            k = len(pending)
            again_out = np.empty((k, info.row_bytes), dtype=np.uint8)
            again_versions = np.empty(k, dtype=np.int64)
            torn = np.empty(k, dtype=np.int64)
            count = self._read_rows(info, rows[pending], again_out, again_versions, torn, deadline)
            if count == -1:  # (read as copies: all or none)
                count = accept(self._scratch[: k * info.stride].view(np.uint64), info.stride // 8, info.row_bytes,  # type: ignore[index]
                               again_out, again_versions, torn)
                whole = np.zeros(k, dtype=bool) if count else np.ones(k, dtype=bool)
            else:
                whole = np.ones(k, dtype=bool)
                whole[torn[:count]] = False
            landed[pending[whole]] = again_out[whole]
            versions[pending[whole]] = again_versions[whole]
            pending = pending[~whole]
            if not len(pending):
                return
        raise TornRows(
            f"{len(pending)} row(s) of table {info.name!r} were being updated on each of {_ROW_TRIES} reads",
            [int(i) for i in pending],
        )

    @staticmethod
    def _pause(attempt: int) -> None:
        """Let the update in progress finish before a torn row is read again: 50 us, doubling, at most 1 ms."""
        time.sleep(min(_ROW_PAUSE * 2**attempt, 0.001))

    def _table(self, name: str, deadline: float) -> TableInfo:
        info = self._tables.get(name)
        if info is None:
            data = self.engine.get_remote_metadata(self.address, _wire.table_key(name), self._left(deadline))
            info = self._tables[name] = TableInfo.decode(data, name, self.engine.remote_mems(self.address))
        return info

    def _scratch_of(self, nbytes: int) -> np.ndarray:
        """A registered buffer of at least ``nbytes`` that row gathers land in (grown as needed)."""
        if self._scratch is None or len(self._scratch) < nbytes:
            if self._scratch_handle is not None:
                self._handles.remove(self._scratch_handle)
                self.engine.deregister_mem(self._scratch_handle)
            self._scratch = empty(max(nbytes, 1 << 16))
            self._scratch_addr = int(self._scratch.ctypes.data)
            self._scratch_handle = self.engine.register_mem(self._scratch)
            self._handles.append(self._scratch_handle)
        return self._scratch

    # -- helpers ----------------------------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> float:
        limit = self.timeout if timeout is None else float(timeout)
        if not limit > 0:
            raise ParamInvalid(f"timeout must be a positive number of seconds, not {timeout!r}")
        return time.monotonic() + limit

    @staticmethod
    def _left(deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HixlTimeout("the call ran out of time")
        return left

    def _check_open(self) -> None:
        if self._closed:
            raise HixlError("this subscriber is closed")

    def close(self) -> None:
        """Deregister what it registered, stop hearing of versions, and disconnect if it connected."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            for handle in self._handles:
                try:
                    self.engine.deregister_mem(handle)
                except HixlError:
                    pass  # the engine was finalized first
            self._handles.clear()
            self._registered.clear()
            if self._dialed:
                try:
                    self.engine.disconnect(self.address)
                except HixlError:
                    pass  # gone already

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pulled v{self.version}, heard of v{self._newest_heard}"
        return f"<Subscriber of {self.address} {state}>"


def _contiguous(view: Any) -> bool:
    expected = view.itemsize
    for n, stride in zip(reversed(view.shape), reversed(view.strides)):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True
