"""``Engine.deregister_mems``: several registrations withdrawn as one change, in one round of confirmations,
with ``deregister_mem``'s guarantee for each (tested on every transport)."""

from __future__ import annotations

import numpy as np
import pytest

import hixl
from hixl import Engine, MemoryRangeError, Op, ParamInvalid

pytestmark = pytest.mark.timeout(60)


def test_several_ranges_go_in_one_change_and_one_round_and_no_peer_writes_them_after(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = transport == "shm"  # shm moves only pool memory
    with Engine("127.0.0.1:0") as target, Engine("127.0.0.1", {"transport": transport}) as peer:
        bufs = [hixl.empty(4096, shared=shared) for _ in range(3)]
        handles = [target.register_mem(b) for b in bufs]
        src = hixl.empty(4096, shared=shared)
        src[:] = 9
        peer.register_mem(src)
        peer.connect(target.local_engine)
        assert peer.transport_of(target.local_engine) == transport
        for b in bufs:
            peer.transfer_sync(target.local_engine, Op.WRITE, [(int(src.ctypes.data), int(b.ctypes.data), 4096)])
        assert all((b == 9).all() for b in bufs)
        for b in bufs:
            b[:] = 0
        rounds: list[int] = []
        revoke = target._server.revoke  # type: ignore[union-attr]
        monkeypatch.setattr(target._server, "revoke", lambda *args: (rounds.append(1), revoke(*args))[1])
        before = target._registry.generation
        target.deregister_mems(handles[:2])
        assert target._registry.generation == before + 1 and len(rounds) == 1
        for b in bufs[:2]:
            with pytest.raises(MemoryRangeError):
                peer.transfer_sync(target.local_engine, Op.WRITE, [(int(src.ctypes.data), int(b.ctypes.data), 4096)])
            assert (b == 0).all()
        peer.transfer_sync(target.local_engine, Op.WRITE, [(int(src.ctypes.data), int(bufs[2].ctypes.data), 4096)])
        assert (bufs[2] == 9).all()


def test_it_is_all_or_nothing() -> None:
    with Engine("127.0.0.1:0") as eng:
        bufs = [hixl.empty(4096) for _ in range(2)]
        kept = eng.register_mem(bufs[0])
        gone = eng.register_mem(bufs[1])
        eng.deregister_mem(gone)
        generation = eng._registry.generation
        with pytest.raises(ParamInvalid, match="not registered"):
            eng.deregister_mems([kept, gone])
        with pytest.raises(ParamInvalid, match="twice"):
            eng.deregister_mems([kept, kept])
        with pytest.raises(ParamInvalid, match="MemHandle"):
            eng.deregister_mems([kept, np.zeros(1)])  # type: ignore[list-item]
        eng.deregister_mems([])
        assert eng._registry.generation == generation
        assert [(m.addr, m.len) for m in eng.local_mems()] == [(kept.addr, kept.len)]
