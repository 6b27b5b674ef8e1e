"""The publishing side: versions of a set of named tensors, which subscribers read one-sidedly.

Snapshot mode (the default) copies each version into one of ``slots`` buffers and
returns: the trainer goes on with its next step at once, and subscribers read the
copy. A slot is written again only once every subscriber that acquired the version
in it has released it or its lease has run out, and never while it holds the newest
version. Publishing waits for such a slot (at most one lease).

Zero-copy mode publishes the caller's tensors where they are (registered read-only).
The caller must not write them until :meth:`Publisher.wait_released` says every
reader is done with that version; the next :meth:`~Publisher.publish` then names
them as the new version.

Each version's tensors carry checksums (``checksums=True``, the default), which
subscribers that ``verify`` check after each pull: a second line of defence that
also catches bytes a transport or memory got wrong. Without them
(``checksums=False``) a pull is still proven to be one whole version by its lease
and the slot's header word (see :mod:`hixl.weights.subscriber`), and publish and
pull skip a pass over every byte each (docs/weights.md, "Checksums").
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._exceptions import HixlError, ParamInvalid
from .._types import MemDesc, MemHandle
from ..engine import Engine
from ._checks import CHECKSUM, NO_CHECKSUM, checksum_of, copy_with_checksum
from ._lanes import spread
from ._ledger import Ledger
from ._manifest import MAX_NAME, Manifest, TensorSpec, layout, within
from ._server import VersionServer
from ._slots import SlotBuffers
from ._tensors import View, byte_array, view_of

__all__ = ["MODES", "Publisher"]

MODES = ("snapshot", "zero-copy")


class Publisher:
    """Publishes versions 1, 2, ... of named tensors from ``engine``, which must listen.

    ``slots``: snapshot buffers (at least 2: the newest version stays readable while the next is
    written). ``lease``: seconds a reader may hold a version it acquired. ``mode``: ``"snapshot"``
    or ``"zero-copy"`` (see the module docstring). ``checksums``: give every tensor a checksum
    (see the module docstring). Copies and checksums run on the engine's ``copy_lanes``. Create it before subscribers connect if they
    are to use the ``shm`` transport (a connection chooses its transport when it is made). One
    publisher (or relay) per engine: they answer to the same metadata keys and notification names.
    """

    def __init__(
        self, engine: Engine, *, slots: int = 2, lease: float = 30.0, mode: str = "snapshot", checksums: bool = True
    ) -> None:
        if mode not in MODES:
            raise ParamInvalid(f"mode must be one of {MODES}, not {mode!r}")
        if type(slots) is not int or not 2 <= slots <= 64:
            raise ParamInvalid(f"slots must be an int from 2 to 64, not {slots!r}")
        self.mode = mode
        self.checksums = bool(checksums)
        self._lanes = int(engine.options["copy_lanes"])
        self._server = VersionServer(engine, slots if mode == "snapshot" else 1, lease)
        self._buffers = SlotBuffers(engine, slots) if mode == "snapshot" else None
        self._shared: dict[tuple[int, int], MemHandle] = {}  # zero-copy: the tensors registered here
        self._lock = threading.Lock()  # one publish at a time
        self._version = 0

    @property
    def engine(self) -> Engine:
        """The engine subscribers read from."""
        return self._server.engine

    @property
    def ledger(self) -> Ledger:
        """Slots and leases, as the publisher sees them now (its ``repr`` shows them)."""
        return self._server.ledger

    def publish(self, tensors: Mapping[str, Any]) -> int:
        """Publish ``tensors`` (name -> numpy array or torch CPU tensor) as the next version; return it.

        Snapshot mode copies them (with their checksums) and returns; zero-copy mode registers
        them read-only where they are. Subscribers hear of the version by notification.
        """
        if not isinstance(tensors, Mapping) or not tensors:
            raise ParamInvalid("publish takes a non-empty dict of name -> array or tensor")
        for name in tensors:
            if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME:
                raise ParamInvalid(f"tensor names are non-empty strings of at most {MAX_NAME} bytes, not {name!r:.40}")
        views = {name: view_of(t) for name, t in tensors.items()}  # every tensor checked before a slot is touched
        with self._lock:
            self._check_open()
            version = self._version + 1
            if self._buffers is not None:
                manifest = self._copy(version, views, self._buffers)
            else:
                manifest = self._share(version, views)
            self._server.commit(manifest)
            self._version = version
        return version

    def _copy(self, version: int, views: Mapping[str, View], buffers: SlotBuffers) -> Manifest:
        sources = [byte_array(v.owner) for v in views.values()]
        offsets, total = layout([len(s) for s in sources])
        slot = self._server.ledger.claim(self._server.ledger.lease + 1.0)  # every lease ends within one lease
        try:
            self._server.invalidate(slot)
            buf = buffers.ensure(slot, total)
            pairs = [(buf[o : o + len(s)], s) for o, s in zip(offsets, sources)]
            sizes = [len(s) for s in sources]
            if self.checksums:  # one pass each: copy and checksum
                sums = spread(lambda pair: copy_with_checksum(*pair), pairs, sizes, self._lanes)
            else:
                spread(lambda pair: np.copyto(*pair), pairs, sizes, self._lanes)
                sums = [0] * len(pairs)
        except BaseException:
            self._server.ledger.abandon(slot)
            raise
        specs = [
            TensorSpec(name, v.dtype, v.shape, 0, offset, s) for (name, v), offset, s in zip(views.items(), offsets, sums)
        ]
        return self._manifest(version, slot, (buffers.region(slot),), specs)

    def _manifest(self, version: int, slot: int, regions: Any, specs: list[TensorSpec]) -> Manifest:
        checksum = CHECKSUM if self.checksums else NO_CHECKSUM
        return Manifest(version, slot, self._server.header(slot), tuple(regions), tuple(specs), checksum)

    def _share(self, version: int, views: Mapping[str, View]) -> Manifest:
        self._server.ledger.claim_now(0)
        self._server.invalidate(0)
        header = self._server.headers
        regions = [MemDesc(int(header.ctypes.data), header.nbytes)]  # where empty tensors point
        sources = [byte_array(v.owner) for v in views.values()]
        sizes = [len(s) for s in sources]
        sums = spread(checksum_of, sources, sizes, self._lanes) if self.checksums else [0] * len(sources)
        specs, keep = [], set()
        for (name, view), checksum in zip(views.items(), sums):
            if not view.nbytes:
                specs.append(TensorSpec(name, view.dtype, view.shape, 0, 0, checksum))
                continue
            key = (view.addr, view.nbytes)
            if key not in self._shared and not within(view.addr, view.nbytes, self.engine.local_mems()):
                self._shared[key] = self.engine.register_mem(view.owner, access="r")  # C-contiguous only
            keep.add(key)
            specs.append(TensorSpec(name, view.dtype, view.shape, len(regions), 0, checksum))
            regions.append(MemDesc(*key))
        for key in set(self._shared) - keep:  # tensors of earlier versions only
            self.engine.deregister_mem(self._shared.pop(key))
        return self._manifest(version, 0, regions, specs)

    def versions(self) -> list[int]:
        """The versions subscribers can acquire now, oldest first."""
        return self._server.ledger.versions()

    def wait_released(self, version: int, timeout: float) -> None:
        """Zero-copy: refuse new readers of ``version`` and return once its readers are done, so its
        tensors may be written again (their header word is cleared first: a reader whose lease ran
        out gets :class:`Superseded`, never a mix). Raises :class:`HixlTimeout` after ``timeout``
        seconds (it never takes longer than one lease). Snapshot mode returns at once: publish
        copied the tensors."""
        if self._buffers is not None:
            return
        slot = self._server.ledger.retire(version, timeout)
        self._server.invalidate(slot)

    def close(self) -> None:
        """Stop publishing; when this returns no subscriber reads its memory any more."""
        with self._lock:
            if self._server.closed:
                return
            self._server.close()
            if self._buffers is not None:
                self._buffers.close()
            for handle in self._shared.values():
                try:
                    self.engine.deregister_mem(handle)
                except HixlError:
                    pass  # the engine was finalized first
            self._shared.clear()

    def _check_open(self) -> None:
        if self._server.closed:
            raise HixlError("this publisher is closed")

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Publisher {self.mode} at {self.engine.local_engine} v{self._version} {self.ledger!r}>"
