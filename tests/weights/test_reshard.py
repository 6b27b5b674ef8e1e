"""Resharding: a reader that asks for part of a tensor gets exactly that part, byte for byte, and
reads no more than its share — counted at the engine, on every byte it asked to move."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hixl
from hixl.weights import Shard, Subscriber

from .peer_main import random_tensor
from .peers import CountingEngine, Peer

SPECS = {
    "w": ((64, 48), "float32", 1),
    "o": ((48, 64), "float32", 2),
    "x": ((4, 8, 16), "int16", 3),
    "q": ((32, 48), "float32", 4),
    "k": ((16, 48), "float32", 5),
}


@pytest.fixture(scope="module")
def publisher(request: pytest.FixtureRequest) -> Iterator[Peer]:
    with Peer("publisher", {"transport": "auto"}) as peer:
        peer.do("publish_random", SPECS)
        yield peer


@pytest.fixture
def reader(publisher: Peer, transport: str) -> Iterator[tuple[CountingEngine, Subscriber]]:
    with CountingEngine("127.0.0.1:0", {"transport": transport}) as engine:
        subscriber = Subscriber(engine, publisher.address)
        yield engine, subscriber
        subscriber.close()


def full(name: str) -> np.ndarray:
    return random_tensor(*SPECS[name])  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("w", np.s_[16:32]),  # a row block: one run
        ("w", np.s_[:, 12:24]),  # a column block: a run per row
        ("w", np.s_[::3, 1::5]),  # strided both ways: a run per element
        ("w", np.s_[::-2, 5]),  # backwards, and one column
        ("w", np.s_[..., 7]),
        ("x", np.s_[1:3, ::2, 4:12]),
        ("x", np.s_[2]),
    ],
)
def test_a_shard_is_its_part_byte_for_byte_and_nothing_more(reader: tuple[CountingEngine, Subscriber], name: str, index: Any) -> None:
    engine, subscriber = reader
    want = full(name)[index]
    out = np.zeros(want.shape, want.dtype)
    engine.moved.clear()
    subscriber.pull({name: Shard(out, index)}, timeout=10)
    assert out.tobytes() == want.tobytes()
    assert engine.moved == [want.nbytes, 8]  # its bytes in one READ, then the slot's header word


def test_tensor_parallel_ranks_read_their_shards_only(reader: tuple[CountingEngine, Subscriber]) -> None:
    engine, subscriber = reader
    w, o = full("w"), full("o")
    ranks = []
    for rank in range(2):  # column-parallel w (rows split), row-parallel o (columns split)
        rows, cols = np.s_[32 * rank : 32 * (rank + 1)], np.s_[:, 32 * rank : 32 * (rank + 1)]
        out = {"w": Shard(np.zeros((32, 48), np.float32), rows), "o": Shard(np.zeros((48, 32), np.float32), cols)}
        plan = subscriber.plan(out)
        engine.moved.clear()
        subscriber.pull(plan, timeout=10)
        assert plan.nbytes == (w.nbytes + o.nbytes) // 2 and engine.moved == [plan.nbytes, 8]
        ranks.append(out)
    assert np.array_equal(np.concatenate([r["w"].out for r in ranks]), w)
    assert np.array_equal(np.concatenate([r["o"].out for r in ranks], axis=1), o)


def test_fused_destinations_and_names(reader: tuple[CountingEngine, Subscriber]) -> None:
    engine, subscriber = reader
    fused = np.zeros((48, 48), np.float32)  # q and k side by side in one parameter, as vLLM fuses them
    out = {"q": fused[:32], "k": fused[32:], "w": np.zeros((64, 48), np.float32)}
    engine.moved.clear()
    subscriber.pull(out, names=["q", "k"], timeout=10)
    assert np.array_equal(fused, np.concatenate([full("q"), full("k")]))
    assert not out["w"].any() and engine.moved == [fused.nbytes, 8]


def test_torch_bfloat16_shards(publisher: Peer, reader: tuple[CountingEngine, Subscriber]) -> None:
    torch = pytest.importorskip("torch")
    _, subscriber = reader
    publisher.do("publish_random", {**SPECS, "b": ((8, 6), "bfloat16", 6)})
    try:
        whole, part = torch.zeros(8, 6, dtype=torch.bfloat16), torch.zeros(8, 2, dtype=torch.bfloat16)
        subscriber.pull({"b": whole}, timeout=10)
        subscriber.pull({"b": Shard(part, np.s_[:, 2:4])}, timeout=10)
        assert torch.equal(whole, random_tensor((8, 6), "bfloat16", 6))
        assert torch.equal(part, whole[:, 2:4])
    finally:
        publisher.do("publish_random", SPECS)


def test_a_plan_replays_and_is_remade_for_a_new_layout(publisher: Peer, reader: tuple[CountingEngine, Subscriber]) -> None:
    _, subscriber = reader
    out = {"w": Shard(np.zeros((64, 12), np.float32), np.s_[:, :12])}
    plan = subscriber.plan(out)
    version, _ = publisher.do("publish_random", {**SPECS, "w": ((64, 48), "float32", 9)})  # same layout
    assert subscriber.pull(plan, timeout=10) == version
    assert np.array_equal(out["w"].out, random_tensor((64, 48), "float32", 9)[:, :12])
    version, _ = publisher.do("publish_random", {"extra": ((3,), "int64", 1), **SPECS})  # another layout
    assert subscriber.pull(plan, timeout=10) == version
    assert np.array_equal(out["w"].out, full("w")[:, :12])


@pytest.mark.parametrize(
    ("out", "error"),
    [
        ({"w": np.zeros((64, 48), np.float64)}, "'w' is float32; its destination is float64"),
        ({"w": Shard(np.zeros((4, 48), np.float32), np.s_[:5])}, r"has shape \(5, 48\); its destination \(4, 48\)"),
        ({"w": Shard(np.zeros(2, np.float32), ([0, 1], 0))}, "only ints, slices and ... can select"),
        ({"w": Shard(np.zeros(48, np.float32), 64)}, "index 64 is out of range"),
        ({"nope": np.zeros(3)}, "has no tensor 'nope'"),
    ],
)
def test_a_wrong_destination_is_refused_before_a_byte_moves(
    reader: tuple[CountingEngine, Subscriber], out: dict[str, Any], error: str
) -> None:
    engine, subscriber = reader
    engine.moved.clear()
    with pytest.raises(hixl.ParamInvalid, match=error):
        subscriber.pull(out, timeout=10)
    assert engine.moved == []
