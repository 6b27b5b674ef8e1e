"""The worker half with TP ranks as real DataDist instances in this process (no vLLM engine).

Each :class:`WorkerSide` is one TP rank with its own engine on 127.0.0.1, as in
vLLM; decode ranks that run "at once" are threads sharing a barrier, as vLLM's
TP group would. These cover what the two-head model of the end-to-end tests
cannot: replicated heads (TP > KV heads) on either side — who reads, who is
told, and that a replica nobody reads frees its blocks at once — and leases
with TP: every prefill rank holding a request's blocks holds its own lease,
which every decode rank extends and releases.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")
torch = pytest.importorskip("torch")

from hixl.vllm import ConnectorConfig, LoadMode  # noqa: E402
from hixl.vllm._leases import Ending  # noqa: E402
from hixl.vllm._params import CPU_LAYOUT, KvSpec, LinkReport, LoadSpec, RemotePrefill, StepMetadata, WatchedLease  # noqa: E402
from hixl.vllm._worker import WorkerSide  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_SIZE = 2, 8, 32, 4
WHOLE = 1 << 30  # a whole_below_bytes every request here is under


def spec(num_heads: int, tp: int, block_size: int = BLOCK_SIZE) -> KvSpec:
    return KvSpec("tiny", "float32", LAYERS, num_heads, HEAD_SIZE, block_size, CPU_LAYOUT, tp)


class Ranks:
    """The workers of one instance, one per TP rank, with its KV tensors registered."""

    def __init__(
        self, kv: KvSpec, serves: bool, cluster_id: int, seed: int, load_mode: LoadMode = LoadMode.LAYERWISE, lease_s: float = 30,
        whole_below_bytes: int = 0,
    ) -> None:
        # Layer-wise means layer-wise here (whole_below_bytes 0): these requests are small enough to be pulled whole.
        config = ConnectorConfig(
            cluster_id=cluster_id, lease_s=lease_s, release_timeout=60, load_mode=load_mode, whole_below_bytes=whole_below_bytes
        )
        barrier = threading.Barrier(kv.tp_size).wait if kv.tp_size > 1 else None
        self.workers = [WorkerSide(config, serves, not serves, BLOCKS, kv, r, barrier) for r in range(kv.tp_size)]
        gen = torch.Generator().manual_seed(seed)
        self.caches = []
        for w in self.workers:
            shape = (BLOCKS, len(w.heads), kv.block_size, 2 * HEAD_SIZE)
            layers = {f"layer.{i}": torch.randn(shape, generator=gen) for i in range(LAYERS)}
            w.register(layers)
            self.caches.append(layers)

    def head(self, model_head: int, layer: str, block: int) -> torch.Tensor:
        """What the instance holds for ``model_head`` (from its lowest rank holding it)."""
        for w, cache in zip(self.workers, self.caches):
            if model_head in w.heads:
                return cache[layer][block, model_head - w.heads.start]
        raise AssertionError(f"no rank holds head {model_head}")

    def close(self) -> None:
        for w in self.workers:
            w.close()


@pytest.fixture
def made() -> Iterator[list[Ranks]]:
    instances: list[Ranks] = []
    yield instances
    for instance in instances:
        instance.close()


def transfer(prefill: Ranks, transfer_id: int) -> RemotePrefill:
    """The params prefill would return for a request in blocks 1 and 3."""
    ranks = tuple(w.endpoint() for w in prefill.workers)
    assert all(r is not None for r in ranks)
    first = prefill.workers[0]
    return RemotePrefill(
        ranks, first.kv, transfer_id, [1, 3], 40, f"req{transfer_id}", first.config.lease_s, first.config.release_timeout  # type: ignore[arg-type]
    )


def watched(decode: Ranks, remote: RemotePrefill, request_id: str) -> None:
    """The request arrives at decode: every rank keeps its leases and links to the prefill ranks holding
    them; returns once the ranks' reports, aggregated as vLLM does, have them all linked."""
    lease = WatchedLease(request_id, remote, time.monotonic())
    for w in decode.workers:
        w.take_orders(StepMetadata(watch=[lease]))
    deadline = time.monotonic() + 10
    while not functools.reduce(LinkReport.aggregate, [w.link_report() for w in decode.workers]).ready >= set(remote.leased):  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "decode never linked to every prefill rank"
        time.sleep(0.02)


def run_step(decode: Ranks, load: LoadSpec) -> None:
    """One vLLM step on every decode rank at once: start, wait for each layer, end."""

    def step(worker: WorkerSide) -> None:
        worker.start([load])
        for layer in range(LAYERS):
            worker.wait_layer(f"layer.{layer}")
        worker.end_step()

    threads = [threading.Thread(target=step, args=(w,)) for w in decode.workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


def released_soon(worker: WorkerSide, request_id: str, timeout: float = 10) -> float:
    """Seconds until ``worker`` releases ``request_id``."""
    started = time.monotonic()
    while request_id not in worker.released():
        assert time.monotonic() - started < timeout, f"{request_id} not released"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.parametrize(
    ("heads", "prefill_tp", "decode_tp", "load_mode", "whole_below"),
    [
        (2, 2, 1, LoadMode.LAYERWISE, 0),
        (2, 1, 2, LoadMode.LAYERWISE, 0),
        (1, 2, 1, LoadMode.LAYERWISE, 0),
        (1, 1, 2, LoadMode.LAYERWISE, 0),
        (2, 4, 2, LoadMode.LAYERWISE, 0),
        (2, 2, 4, LoadMode.LAYERWISE, 0),
        (2, 2, 1, LoadMode.SYNC, 0),
        (2, 1, 2, LoadMode.SYNC, 0),
        (2, 2, 1, LoadMode.LAYERWISE, WHOLE),  # small enough: pulled whole
        (2, 1, 2, LoadMode.LAYERWISE, WHOLE),
    ],
    ids=lambda v: v.value if isinstance(v, LoadMode) else "whole" if v == WHOLE else str(v),
)
def test_decode_ranks_get_their_heads_and_every_prefill_rank_hears_once(
    made: list[Ranks], heads: int, prefill_tp: int, decode_tp: int, load_mode: LoadMode, whole_below: int
) -> None:
    prefill = Ranks(spec(heads, prefill_tp), True, 1000, seed=1)
    decode = Ranks(spec(heads, decode_tp), False, 2000, seed=2, load_mode=load_mode, whole_below_bytes=whole_below)
    made += [prefill, decode]
    remote = transfer(prefill, 7)
    watched(decode, remote, "d7")
    run_step(decode, LoadSpec("d7", remote, [1, 3], [0, 5]))
    for w, cache in zip(decode.workers, decode.caches):
        assert not w.take_failed_blocks()
        # A pull landed all at once (whole or sync) has its first layer usable when its last is; layer-wise, before.
        (seconds,), (first,) = w.stats.data["pull_seconds"], w.stats.data["first_layer_seconds"]
        assert (first == seconds) == (whole_below == WHOLE or load_mode is LoadMode.SYNC)
        for layer, tensor in cache.items():
            for src, dst in ((1, 0), (3, 5)):
                for i, model_head in enumerate(w.heads):
                    assert torch.equal(tensor[dst, i], prefill.head(model_head, layer, src))
    # A prefill rank that is some head's lowest holder is read, and hears exactly once, from its
    # lowest reader; a replica nobody reads is never told (it releases at once, next test).
    primary = {h: min(r for r, p in enumerate(prefill.workers) if h in p.heads) for h in range(heads)}
    for rank, w in enumerate(prefill.workers):
        readers = [d for d, dw in enumerate(decode.workers) if any(primary[h] == rank for h in dw.heads)]
        done = [(d.cluster_id, d.req_id, d.op) for d in w.datadist.cache_manager.completed_requests()]
        assert done == ([(decode.workers[readers[0]].cluster_id, 7, "pull")] if readers else [])


def test_a_replica_nobody_reads_releases_at_once(made: list[Ranks]) -> None:
    prefill = Ranks(spec(1, 2), True, 3000, seed=3)  # both ranks hold the one head: rank 1 is never read
    made.append(prefill)
    prefill.workers[1].hold({9: "req9"})
    assert prefill.workers[1].released() == {"req9"}
    prefill.workers[0].hold({9: "req9"})
    assert prefill.workers[0].released() == set()  # rank 0 waits for decode


def test_a_block_size_mismatch_fails_the_load_and_still_tells_prefill(made: list[Ranks]) -> None:
    prefill = Ranks(spec(2, 2), True, 4000, seed=4)
    decode = Ranks(spec(2, 1, block_size=64), False, 5000, seed=5)
    made += [prefill, decode]
    for w in prefill.workers:
        w.hold({8: "req8"})
    before = {name: t.clone() for name, t in decode.caches[0].items()}
    remote = transfer(prefill, 8)
    watched(decode, remote, "d8")
    run_step(decode, LoadSpec("d8", remote, [1, 3], [0, 5]))
    assert decode.workers[0].take_failed_blocks() == {0, 5}
    assert all(torch.equal(before[n], t) for n, t in decode.caches[0].items())  # nothing pulled
    for w in prefill.workers:  # each rank is told, and frees the blocks well before its 60 s timeout
        assert released_soon(w, "req8") < 5


def due_soon(worker: WorkerSide, timeout: float) -> dict[str, Ending]:
    """What ``worker``'s lease table lets go next, within ``timeout`` seconds."""
    assert worker.leases is not None
    deadline = time.monotonic() + timeout
    while not (due := worker.leases.due()):
        assert time.monotonic() < deadline, "nothing was let go"
        time.sleep(0.02)
    return due


def test_prefill_ranks_hold_leases_while_decode_extends_and_all_expire_when_it_dies(made: list[Ranks]) -> None:
    """Prefill TP 4 with 2 KV heads (ranks 1 and 3 hold replicas nobody reads), decode TP 2, a 1 s lease."""
    prefill = Ranks(spec(2, 4), True, 6000, seed=6, lease_s=1.0)
    decode = Ranks(spec(2, 2), False, 7000, seed=7)
    made.append(prefill)
    remote = transfer(prefill, 11)
    assert [e.cluster_id for e in remote.leased] == [6000, 6002]
    for w in prefill.workers:
        w.hold({11: "req11"})
    for w in prefill.workers[1::2]:  # never read: released at once, nothing to extend
        assert due_soon(w, 1) == {"req11": Ending.UNREAD}
    try:
        watched(decode, remote, "d11")
        time.sleep(2.5)  # 2.5 leases: still held at ranks 0 and 2 only because both decode ranks extend them
        for w in prefill.workers[::2]:
            assert w.leases is not None and w.leases.due() == {} and len(w.leases) == 1
        assert all(w.keeper is not None and w.keeper.usable("d11") for w in decode.workers)
    finally:
        decode.close()  # decode dies: nobody extends any more
    died = time.monotonic()
    for w in prefill.workers[::2]:
        assert due_soon(w, 3) == {"req11": Ending.EXPIRED}
    assert time.monotonic() - died < 2.0  # a lease (1 s) after the last extension, at most


def test_an_abort_at_decode_releases_every_prefill_rank_at_once(made: list[Ranks]) -> None:
    """Prefill TP 2, decode TP 2: both decode ranks release at both prefill ranks; the duplicates harm nothing."""
    prefill = Ranks(spec(2, 2), True, 8000, seed=8)
    decode = Ranks(spec(2, 2), False, 9000, seed=9)
    made += [prefill, decode]
    for w in prefill.workers:
        w.hold({12: "req12", 13: "req13"})
    watched(decode, transfer(prefill, 12), "d12")
    watched(decode, transfer(prefill, 13), "d13")
    started = time.monotonic()
    for w in decode.workers:  # the scheduler's drop reaches every decode rank
        w.take_orders(StepMetadata(drop=["d12"]))
    for w in prefill.workers:
        assert due_soon(w, 5) == {"req12": Ending.RELEASED}
    assert time.monotonic() - started < 2.0  # at once, not a 30 s lease later
    time.sleep(0.3)  # the second rank's duplicate releases land too
    for w in prefill.workers:
        assert w.leases is not None and w.leases.due() == {} and len(w.leases) == 1  # req13 is untouched
    assert all(w.keeper is not None and w.keeper.usable("d13") and not w.keeper.usable("d12") for w in decode.workers)


def break_link(decode: Ranks, prefill: Ranks) -> None:
    """Close every decode rank's connection to every prefill rank, as a link declared dead does: DataDist
    still lists the links, and the keepers still count them up."""
    for d in decode.workers:
        for p in prefill.workers:
            endpoint = p.endpoint()
            assert endpoint is not None
            d.datadist.engine.disconnect(endpoint.ip_info)


def assert_pulled(decode: Ranks, prefill: Ranks, blocks: list[tuple[int, int]]) -> None:
    for w, cache in zip(decode.workers, decode.caches):
        for layer, tensor in cache.items():
            for src, dst in blocks:
                for i, model_head in enumerate(w.heads):
                    assert torch.equal(tensor[dst, i], prefill.head(model_head, layer, src))


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "load_mode"),
    [(1, 1, LoadMode.LAYERWISE), (1, 1, LoadMode.SYNC), (2, 1, LoadMode.LAYERWISE), (1, 2, LoadMode.SYNC)],
    ids=lambda v: v.value if isinstance(v, LoadMode) else str(v),
)
def test_a_pull_whose_link_broke_is_retried_after_relinking(made: list[Ranks], prefill_tp: int, decode_tp: int, load_mode: LoadMode) -> None:
    """The link to prefill broke before the pull (its connection closed, the keeper not yet aware): the
    worker relinks, prefill confirms the lease, and the pull lands — once per decode rank, counted."""
    prefill = Ranks(spec(2, prefill_tp), True, 10000, seed=10)
    decode = Ranks(spec(2, decode_tp), False, 11000, seed=11, load_mode=load_mode)
    made += [prefill, decode]
    for w in prefill.workers:
        w.hold({14: "req14"})
    remote = transfer(prefill, 14)
    watched(decode, remote, "d14")
    break_link(decode, prefill)
    run_step(decode, LoadSpec("d14", remote, [1, 3], [0, 5]))
    for w in decode.workers:
        assert not w.take_failed_blocks()
        assert w.stats.data["retried_pulls"] == 1 and w.stats.data["failed_pulls"] == 0 and len(w.stats.data["pull_bytes"]) == 1
    assert_pulled(decode, prefill, [(1, 0), (3, 5)])
    for w in prefill.workers:  # told it was pulled: free at once, not a lease later
        assert released_soon(w, "req14") < 5


def test_a_retry_never_reads_blocks_prefill_no_longer_holds(made: list[Ranks]) -> None:
    """The link broke and prefill has let the request's blocks go meanwhile (here: a completion it took for
    this transfer): it refuses the confirmation, so the load fails and not a byte is read."""
    prefill = Ranks(spec(2, 1), True, 12000, seed=12)
    decode = Ranks(spec(2, 1), False, 13000, seed=13)
    made += [prefill, decode]
    prefill.workers[0].hold({15: "req15"})
    remote = transfer(prefill, 15)
    watched(decode, remote, "d15")
    assert prefill.workers[0].leases is not None
    prefill.workers[0].leases.pulled([15])  # its blocks are free at prefill (vLLM may reuse them)
    assert due_soon(prefill.workers[0], 1) == {"req15": Ending.PULLED}
    before = {name: t.clone() for name, t in decode.caches[0].items()}
    break_link(decode, prefill)
    run_step(decode, LoadSpec("d15", remote, [1, 3], [0, 5]))
    w = decode.workers[0]
    assert w.take_failed_blocks() == {0, 5}
    assert w.stats.data["retried_pulls"] == 1 and w.stats.data["failed_pulls"] == 1
    assert all(torch.equal(before[n], t) for n, t in decode.caches[0].items())  # nothing read


def test_a_layerwise_pull_that_breaks_mid_way_is_pulled_again_from_that_layer(made: list[Ranks], monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0 landed, then the link broke (injected: the connection closed and the task's later layers
    failed with the link error its readers raise): the worker relinks and pulls layers 1 on, and only them."""
    from hixl.datadist import LLMException, LLMStatusCode

    prefill = Ranks(spec(2, 1), True, 14000, seed=14)
    decode = Ranks(spec(2, 1), False, 15000, seed=15)
    made += [prefill, decode]
    prefill.workers[0].hold({16: "req16"})
    remote = transfer(prefill, 16)
    watched(decode, remote, "d16")
    manager = decode.workers[0].datadist.cache_manager
    real, ranges = manager.pull_blocks_async, []

    def breaking(*args: object, **kwargs: object) -> object:
        task = real(*args, **kwargs)  # type: ignore[arg-type]
        ranges.append(args[4])  # src_layer_range
        if len(ranges) == 1:
            task.wait_layer(0)
            break_link(decode, prefill)
            task._fail_from(1, LLMException("the link broke", LLMStatusCode.LINK_FAILED))
        return task

    monkeypatch.setattr(manager, "pull_blocks_async", breaking)
    run_step(decode, LoadSpec("d16", remote, [1, 3], [0, 5]))
    w = decode.workers[0]
    assert not w.take_failed_blocks() and w.stats.data["retried_pulls"] == 1
    assert ranges == [None, range(1, LAYERS)]
    assert_pulled(decode, prefill, [(1, 0), (3, 5)])
