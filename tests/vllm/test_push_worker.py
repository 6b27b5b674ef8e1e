"""Push mode's worker half with real DataDist instances on 127.0.0.1 (no vLLM engine).

Each :class:`WorkerSide` is one TP rank with its own engine, as in
test_worker_tp.py; prefill ranks push layer by layer into the blocks decode
granted, driven through :class:`HixlConnector`'s hooks in the order vLLM's model
runner calls them (:func:`vllm_step`). The tests that kill a side run it in a
child process (push_peer.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.distributed.kv_transfer")
torch = pytest.importorskip("torch")

import hixl  # noqa: E402
from hixl import AccessDenied, Engine, Op  # noqa: E402
from hixl.datadist import BlocksCacheKey  # noqa: E402
from hixl.vllm import ConnectorConfig, HixlConnector, Mode  # noqa: E402
from hixl.vllm._params import CPU_LAYOUT, Endpoint, KvSpec, LinkReport, PushGrant, PushSource, PushStep, StepMetadata  # noqa: E402
from hixl.vllm._push import PUSH_NOTIFY, PushMessage, PushOp  # noqa: E402
from hixl.vllm._worker import WorkerSide  # noqa: E402
from test_worker_tp import Ranks as PullRanks  # noqa: E402  (its head() and close())
from test_worker_tp import made  # noqa: E402, F401  (the fixture: every Ranks a test made is closed)

pytestmark = pytest.mark.timeout(120)

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_SIZE = 3, 10, 4, 4
PEER = Path(__file__).with_name("push_peer.py")


def spec(num_heads: int, tp: int) -> KvSpec:
    return KvSpec("tiny", "float32", LAYERS, num_heads, HEAD_SIZE, BLOCK_SIZE, CPU_LAYOUT, tp)


class Ranks(PullRanks):
    """One instance's workers in push mode, one per TP rank, with KV tensors registered (random values)."""

    def __init__(
        self, kv: KvSpec, decode: bool, cluster_id: int, seed: int, transport: str = "auto", shared: bool = False,
        push_timeout: float = 30.0, transfer_timeout: float = 10.0, records: str = "",
    ) -> None:
        config = ConnectorConfig(
            mode=Mode.PUSH, cluster_id=cluster_id, transport=transport, push_timeout=push_timeout, transfer_timeout=transfer_timeout,
            records=records,
        )
        self.workers = [WorkerSide(config, True, decode, BLOCKS, kv, r) for r in range(kv.tp_size)]
        gen = torch.Generator().manual_seed(seed)
        self.caches = []
        for w in self.workers:
            shape = (BLOCKS, len(w.heads), kv.block_size, 2 * HEAD_SIZE)
            layers = {}
            for i in range(LAYERS):
                # shm moves only pool memory: the cache is made of it then.
                tensor = torch.from_numpy(hixl.empty(shape, np.float32, shared=True)) if shared else torch.empty(shape)
                tensor.copy_(torch.randn(shape, generator=gen))
                layers[f"layer.{i}"] = tensor
            w.register(layers)
            self.caches.append(layers)

    def snapshot(self) -> list[dict[str, torch.Tensor]]:
        return [{name: t.clone() for name, t in cache.items()} for cache in self.caches]


def source(prefill_ranks: list, kv: KvSpec, push_id: int) -> PushSource:
    return PushSource(tuple(prefill_ranks), kv, push_id)


def granted(decode: Ranks, prefill: Ranks, request_id: str, push_id: int, blocks: list[int], first_block: int = 0, num_tokens: int = 14) -> PushGrant:
    """Decode's scheduler grants the request's blocks on every decode rank; returns once every prefill rank
    reports (aggregated as vLLM does) every decode rank's grant in."""
    ranks = [w.endpoint() for w in prefill.workers]
    grant = PushGrant(request_id, source(ranks, prefill.workers[0].kv, push_id), blocks, first_block, num_tokens)
    vllm_step(decode.workers, StepMetadata(grants=[grant]), range(0))
    deadline = time.monotonic() + 10
    while push_id not in functools.reduce(LinkReport.aggregate, [w.link_report() for w in prefill.workers]).granted:  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "prefill never held every decode rank's grant"
        time.sleep(0.01)
    return grant


def connector(worker: WorkerSide) -> HixlConnector:
    """The worker's connector as vLLM's worker holds it (made around ``worker``: no vLLM config needed)."""
    made = HixlConnector.__new__(HixlConnector)
    made.config, made._worker, made._scheduler, made._connector_metadata = worker.config, worker, None, None
    return made


def vllm_step(workers: list[WorkerSide], meta: StepMetadata, layers: range = range(LAYERS), end: bool = True) -> list[HixlConnector]:
    """One step of every rank as vLLM 0.32's model runner drives its connector when no load is synchronous
    (vllm/v1/worker/kv_connector_model_runner_mixin.py): bind the step's metadata, compute the forward's
    ``layers`` (``save_kv_layer`` after each), and only then ``start_load_kv``; with ``end``, ``wait_for_save``."""
    connectors = [connector(w) for w in workers]
    for c in connectors:
        c.bind_connector_metadata(meta)
    for layer in layers:
        for c in connectors:
            c.save_kv_layer(f"layer.{layer}", None, None)  # type: ignore[arg-type]  # (unused by hixl)
    if end:
        end_step(connectors)
    return connectors


def end_step(connectors: list[HixlConnector]) -> None:
    """The rest of a :func:`vllm_step`: ``start_load_kv`` (after the forward), ``wait_for_save``, clear."""
    for c in connectors:
        c.start_load_kv(None)  # type: ignore[arg-type]  # (unused by hixl)
        c.wait_for_save()
        c.clear_connector_metadata()


def prefill_step(prefill: Ranks, step: PushStep) -> None:
    """One vLLM step of a pushed request on every prefill rank: each layer computed, then the step's end."""
    vllm_step(prefill.workers, StepMetadata(pushes=[step]))


def finished(decode: Ranks, request_id: str, timeout: float = 10.0, sending: bool = False) -> float:
    """Seconds until every decode rank reports ``request_id`` (finished_recving, or with ``sending`` finished_sending)."""
    started = time.monotonic()
    waiting = set(range(len(decode.workers)))
    while waiting:
        for rank in list(waiting):
            done_sending, done_recving = decode.workers[rank].finished_pushes()
            if request_id in (done_sending if sending else done_recving):
                waiting.discard(rank)
        assert time.monotonic() - started < timeout, f"{request_id} not reported by decode ranks {sorted(waiting)}"
        time.sleep(0.01)
    return time.monotonic() - started


def assert_pushed(decode: Ranks, prefill: Ranks, pairs: list[tuple[int, int]]) -> None:
    """Every decode rank's block ``dst`` holds prefill's block ``src``, each of its heads, every layer."""
    for w, cache in zip(decode.workers, decode.caches):
        for layer, tensor in cache.items():
            for src, dst in pairs:
                for i, model_head in enumerate(w.heads):
                    assert torch.equal(tensor[dst, i], prefill.head(model_head, layer, src)), (layer, src, dst, model_head)


def assert_untouched(decode: Ranks, before: list[dict[str, torch.Tensor]], except_blocks: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Every element of every block of every layer but ``except_blocks`` is as it was."""
    keep = [b for b in range(BLOCKS) if b not in except_blocks]
    for cache, old in zip(decode.caches, before):
        for name, tensor in cache.items():
            assert torch.equal(tensor[keep], old[name][keep]), name


@pytest.mark.parametrize(
    ("heads", "prefill_tp", "decode_tp"),
    [(2, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 1), (1, 1, 2), (2, 4, 2)],
)
def test_a_push_lands_byte_for_byte_on_every_decode_rank(made: list[Ranks], heads: int, prefill_tp: int, decode_tp: int) -> None:
    prefill = Ranks(spec(heads, prefill_tp), False, 1000, seed=1)
    decode = Ranks(spec(heads, decode_tp), True, 2000, seed=2)
    made += [prefill, decode]
    before = decode.snapshot()
    granted(decode, prefill, "d1", 71, [6, 2, 3, 9])
    prefill_step(prefill, PushStep("p1", 71, [1, 4, 5, 8], 0, 14, True))
    finished(decode, "d1")
    assert_pushed(decode, prefill, [(1, 6), (4, 2), (5, 3), (8, 9)])
    assert_untouched(decode, before, {6, 2, 3, 9})
    assert all(not w.take_failed_blocks() for w in decode.workers)


def test_a_chunked_push_rewrites_the_partial_block_and_starts_at_decodes_first_block(made: list[Ranks]) -> None:
    """Two steps (tokens [0, 6) then [6, 14)); decode had the prompt's block 0 cached (first_block 1). The
    first step's partial block 1 is written again by the second, after prefill filled the rest of it."""
    prefill = Ranks(spec(2, 2), False, 3000, seed=3)
    decode = Ranks(spec(2, 1), True, 4000, seed=4)
    made += [prefill, decode]
    before = decode.snapshot()
    granted(decode, prefill, "d2", 72, [7, 8, 0], first_block=1)
    prompt = [3, 1, 4, 6]
    prefill_step(prefill, PushStep("p2", 72, prompt, 0, 6, False))
    assert_pushed(decode, prefill, [(1, 7)])  # the first chunk's blocks (block 0 is decode's own)
    for cache in prefill.caches:  # the second chunk computes tokens 6.. : block 1 changes, and blocks 4, 6
        for tensor in cache.values():
            tensor[[1, 4, 6]] += 1.0
    assert not decode.workers[0].finished_pushes()[1]  # not the last step: not landed yet
    prefill_step(prefill, PushStep("p2", 72, prompt, 6, 14, True))
    finished(decode, "d2")
    assert_pushed(decode, prefill, [(1, 7), (4, 8), (6, 0)])
    assert_untouched(decode, before, {7, 8, 0})


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_a_block_written_whole_is_not_written_again_by_a_later_chunk(made: list[Ranks], decode_tp: int) -> None:
    """Tokens [0, 8) fill blocks 0 and 1 whole: the second chunk writes from block 2 on, to every decode rank
    (a block changed at prefill after it was written whole stays as written)."""
    prefill = Ranks(spec(2, 1), False, 42000, seed=42)
    decode = Ranks(spec(2, decode_tp), True, 43000, seed=43)
    made += [prefill, decode]
    granted(decode, prefill, "d18", 94, [5, 6, 7, 8])
    prompt = [3, 1, 4, 6]
    prefill_step(prefill, PushStep("p18", 94, prompt, 0, 8, False))
    first = prefill.snapshot()
    for tensor in prefill.caches[0].values():  # (a block already whole never changes in vLLM: this one shows a rewrite)
        tensor[1] += 1.0
    prefill_step(prefill, PushStep("p18", 94, prompt, 8, 14, True))
    finished(decode, "d18")
    assert_pushed(decode, prefill, [(4, 7), (6, 8)])
    for w, cache in zip(decode.workers, decode.caches):
        for layer, tensor in cache.items():
            for i, head in enumerate(w.heads):
                assert torch.equal(tensor[6, i], first[0][layer][1, head]), (layer, head)  # as the first chunk wrote it


@pytest.mark.parametrize("dropped_by", ["prefill", "decode"])
def test_a_push_after_a_link_broke_links_again_and_lands(made: list[Ranks], dropped_by: str) -> None:
    """A connection between the two went after a push (in a starved fleet: declared dead by a heartbeat) while
    both live on. Prefill's to decode: the next push replaces the broken link before it writes. Decode's to
    prefill: the grant's send fails, the keeper relinks, and the grant goes again. Either way it lands,
    instead of every later push between them failing."""
    prefill = Ranks(spec(2, 1), False, 5100, seed=5)
    decode = Ranks(spec(2, 1), True, 5200, seed=6)
    made += [prefill, decode]
    granted(decode, prefill, "d1", 81, [2])
    prefill_step(prefill, PushStep("p1", 81, [1], 0, 14, True))
    finished(decode, "d1")
    dropper, other = (prefill, decode) if dropped_by == "prefill" else (decode, prefill)
    endpoint = other.workers[0].endpoint()
    assert endpoint is not None
    dropper.workers[0].datadist.engine.disconnect(endpoint.ip_info)
    granted(decode, prefill, "d2", 82, [5])
    prefill_step(prefill, PushStep("p2", 82, [3], 0, 14, True))
    finished(decode, "d2")
    assert not decode.workers[0].take_failed_blocks()
    assert_pushed(decode, prefill, [(1, 2), (3, 5)])


def test_each_layer_is_written_while_the_forward_goes_on(made: list[Ranks]) -> None:
    """vLLM calls ``start_load_kv`` after the forward when no load is synchronous (as on a prefill): a layer
    computed before it is written all the same, and at once — decode holds layer 0 before layer 1 is
    computed — and nothing of a layer not computed yet has moved."""
    prefill = Ranks(spec(2, 1), False, 20000, seed=20)
    decode = Ranks(spec(2, 1), True, 21000, seed=21)
    made += [prefill, decode]
    before = decode.snapshot()
    granted(decode, prefill, "d11", 81, [3, 5])
    connectors = vllm_step(prefill.workers, StepMetadata(pushes=[PushStep("p11", 81, [2, 7], 0, 6, True)]), range(1), end=False)
    deadline = time.monotonic() + 10
    layer0 = decode.caches[0]["layer.0"]
    while not torch.equal(layer0[[3, 5]], prefill.caches[0]["layer.0"][[2, 7]]):
        assert time.monotonic() < deadline, "layer 0 never landed during the forward"
        time.sleep(0.01)
    for layer in range(1, LAYERS):
        assert torch.equal(decode.caches[0][f"layer.{layer}"], before[0][f"layer.{layer}"]), layer
    for layer in range(1, LAYERS):
        connectors[0].save_kv_layer(f"layer.{layer}", None, None)  # type: ignore[arg-type]
    end_step(connectors)
    finished(decode, "d11")
    assert_pushed(decode, prefill, [(2, 3), (7, 5)])
    assert_untouched(decode, before, {3, 5})


def test_decode_is_told_as_the_last_layer_lands_not_at_the_forwards_end(made: list[Ranks]) -> None:
    """After the last step's last layer is computed, the rest of the model still runs before vLLM calls
    ``wait_for_save``: decode hears the push landed meanwhile (its data all in), and the step's end after
    changes nothing."""
    prefill = Ranks(spec(2, 1), False, 44000, seed=44)
    decode = Ranks(spec(2, 2), True, 45000, seed=45)
    made += [prefill, decode]
    before = decode.snapshot()
    granted(decode, prefill, "d19", 95, [3, 5])
    connectors = vllm_step(prefill.workers, StepMetadata(pushes=[PushStep("p19", 95, [2, 7], 0, 6, True)]), end=False)
    finished(decode, "d19")  # before the step's end
    assert_pushed(decode, prefill, [(2, 3), (7, 5)])
    end_step(connectors)
    assert_untouched(decode, before, {3, 5})
    assert all(not w.take_failed_blocks() for w in decode.workers)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs 2 CPUs and affinity")
def test_the_push_threads_are_not_bound_to_vllms_compute_core(made: list[Ranks]) -> None:
    """vLLM binds the thread that registers the cache to its compute core: the receiver's and the pusher's
    threads, started then, may run on every CPU (bound there, they would wait behind vLLM's compute and its
    busy-waiting: see hixl.vllm._affinity)."""
    everything = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(everything)})  # as vLLM binds its main thread
    try:
        worker = Ranks(spec(2, 1), True, 46000, seed=46)  # serves and takes KV: a pusher and a receiver
        made.append(worker)
    finally:
        os.sched_setaffinity(0, everything)
    (w,) = worker.workers
    assert w.receiver is not None and w.pusher is not None
    for thread in (w.receiver._thread, w.pusher._finisher):
        assert thread.native_id is not None and os.sched_getaffinity(thread.native_id) == everything, thread.name


def test_a_write_outside_the_grants_is_refused(made: list[Ranks], transport: str) -> None:
    """Decode's cache is read-only to peers but for granted windows: a WRITE beside one is AccessDenied,
    on every transport, and lands nothing; into the window it lands."""
    decode = Ranks(spec(2, 1), True, 5000, seed=5, transport=transport, shared=transport == "shm")
    prefill = Ranks(spec(2, 1), False, 6000, seed=6, transport=transport, shared=transport == "shm")
    made += [decode, prefill]
    granted(decode, prefill, "d3", 73, [4])
    before = decode.snapshot()
    tensor = decode.caches[0]["layer.1"]
    row = tensor[0].numel() * 4
    with Engine("127.0.0.1", {"transport": transport}) as eng:
        buf = hixl.empty(row, shared=transport == "shm")
        buf[:] = 0xAB
        eng.register_mem(buf)
        eng.connect(decode.workers[0].datadist.local_ip_info)
        assert eng.transport_of(decode.workers[0].datadist.local_ip_info) == transport
        base = tensor.data_ptr()
        for block in (3, 5, 0):
            with pytest.raises(AccessDenied):
                eng.transfer_sync(decode.workers[0].datadist.local_ip_info, Op.WRITE, [(int(buf.ctypes.data), base + block * row, row)])
        with pytest.raises(AccessDenied):  # straddling the window's end
            eng.transfer_sync(decode.workers[0].datadist.local_ip_info, Op.WRITE, [(int(buf.ctypes.data), base + 4 * row + 8, row)])
        assert_untouched(decode, before)
        eng.transfer_sync(decode.workers[0].datadist.local_ip_info, Op.WRITE, [(int(buf.ctypes.data), base + 4 * row, row)])
    assert (tensor[4].numpy().view(np.uint8) == 0xAB).all()
    assert_untouched(decode, [{n: (t if n != "layer.1" else tensor) for n, t in before[0].items()}])


def test_a_push_revoked_mid_way_never_lands_in_the_reused_blocks(made: list[Ranks], caplog: pytest.LogCaptureFixture) -> None:
    """Layer 0 written, then decode revokes the grant (the request was aborted) and gives its blocks to
    another request, which fills them; prefill writes the later layers anyway: every element of every
    block is untouched, and prefill's writes fail with AccessDenied."""
    prefill = Ranks(spec(2, 1), False, 7000, seed=7)
    decode = Ranks(spec(2, 1), True, 8000, seed=8)
    made += [prefill, decode]
    granted(decode, prefill, "d4", 74, [2, 3, 5, 6])
    step = PushStep("p4", 74, [1, 2, 3, 4], 0, 14, True)
    p = prefill.workers[0]
    (pc,) = vllm_step([p], StepMetadata(pushes=[step]), range(1), end=False)
    vllm_step(decode.workers, StepMetadata(revokes=["d4"]), range(0))
    finished(decode, "d4", sending=True)  # withdrawn: vLLM may reuse the blocks now
    for tensor in decode.caches[0].values():  # another request's KV in them
        tensor[[2, 3, 5, 6]] = 42.0
    after_reuse = decode.snapshot()
    with caplog.at_level("WARNING", logger="vllm.hixl"):
        for layer in range(1, LAYERS):
            pc.save_kv_layer(f"layer.{layer}", None, None)  # type: ignore[arg-type]
        end_step([pc])
    assert_untouched(decode, after_reuse)
    assert any("push 74 to decode" in r.getMessage() and "read-only" in r.getMessage() for r in caplog.records), caplog.text


def test_a_revoke_racing_a_stream_of_writes_leaves_no_byte_after_it(made: list[Ranks]) -> None:
    """Prefill keeps writing the granted blocks (many rounds, in a thread) while decode revokes: once the
    revoke is reported, the blocks are refilled, and after prefill stopped, not one element changed."""
    prefill = Ranks(spec(2, 1), False, 9000, seed=9)
    decode = Ranks(spec(2, 1), True, 10000, seed=10)
    made += [prefill, decode]
    granted(decode, prefill, "d5", 75, [1, 2, 3, 4])
    p = prefill.workers[0]
    vllm_step([p], StepMetadata(pushes=[PushStep("p5", 75, [5, 6, 7, 8], 0, 14, True)]), range(0), end=False)  # links to decode
    manager, cache = p.datadist.cache_manager, p._local_cache()

    stop, writes, refused = threading.Event(), [0], []

    def stream() -> None:
        while not stop.is_set():
            try:
                manager.push_blocks(BlocksCacheKey(10000), cache, [5, 6, 7, 8], [1, 2, 3, 4], tensor_num_per_layer=1, timeout=5)
                writes[0] += 1
            except Exception as exc:  # noqa: BLE001 - what the refused writes raise is checked below
                refused.append(exc)

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while writes[0] < 20:
            assert not refused and time.monotonic() < deadline, refused
            time.sleep(0.005)
        vllm_step(decode.workers, StepMetadata(revokes=["d5"]), range(0))
        finished(decode, "d5", sending=True)
        for tensor in decode.caches[0].values():
            tensor[[1, 2, 3, 4]] = -7.0
        reused = decode.snapshot()
        time.sleep(0.3)  # prefill keeps trying
    finally:
        stop.set()
        thread.join(10)
    assert refused, "prefill's writes after the revoke were not refused"
    assert_untouched(decode, reused)


def test_push_timeout_fails_the_request_and_withdraws_its_windows(made: list[Ranks]) -> None:
    prefill = Ranks(spec(2, 1), False, 11000, seed=11)
    decode = Ranks(spec(2, 1), True, 12000, seed=12, push_timeout=0.5)
    made += [prefill, decode]
    granted(decode, prefill, "d6", 76, [2, 3])
    assert finished(decode, "d6", timeout=5) < 2  # nothing was pushed: failed after push_timeout
    assert decode.workers[0].take_failed_blocks() == {2, 3}
    before = decode.snapshot()
    prefill_step(prefill, PushStep("p6", 76, [1, 4], 0, 8, True))  # the late push is refused, the DONE too (decode forgot the push)
    assert_untouched(decode, before)


def test_an_idle_decode_waits_for_its_pending_push_instead_of_spinning(made: list[Ranks]) -> None:
    """Decode's only request waits for a push (every link up): a step that runs nothing waits for the push to
    end, up to the worker's pace (50 ms), instead of returning at once for vLLM to step again without pause;
    once the push ended, the next step returns at once and reports it."""
    prefill = Ranks(spec(2, 1), False, 22000, seed=22)
    decode = Ranks(spec(2, 1), True, 23000, seed=23)
    made += [prefill, decode]
    granted(decode, prefill, "d12", 82, [1, 2])
    steps, began = 0, time.monotonic()
    while time.monotonic() - began < 0.5:
        vllm_step(decode.workers, StepMetadata(idle=True), range(0))
        steps += 1
    assert 5 <= steps <= 15, steps  # ~10 paced steps, not thousands
    prefill_step(prefill, PushStep("p12", 82, [3, 4], 0, 6, True))
    assert finished(decode, "d12") < 2
    began = time.monotonic()
    vllm_step(decode.workers, StepMetadata(idle=True), range(0))  # nothing pending: no wait for a push
    assert time.monotonic() - began < 0.04


def test_an_idle_prefill_waiting_for_grants_paces_its_steps_and_a_grant_wakes_it(made: list[Ranks]) -> None:
    """Prefill's requests wait for decode's grants: a step that runs nothing waits up to the worker's pace (50 ms)
    for a grant instead of returning at once (vLLM steps again without pause, and two prefills spinning so
    starved a decode on two cores of the CPU its grants needed); a grant that comes ends the wait at once,
    and one that came since the scheduler last heard which are in does not let it begin."""
    prefill = Ranks(spec(2, 1), False, 26000, seed=26)
    decode = Ranks(spec(2, 1), True, 27000, seed=27)
    made += [prefill, decode]
    for w in prefill.workers:
        w.link_report()  # (what the scheduler heard last)
    steps, began = 0, time.monotonic()
    while time.monotonic() - began < 0.5:
        vllm_step(prefill.workers, StepMetadata(idle=True, awaiting=True), range(0))
        steps += 1
    assert 5 <= steps <= 15, steps  # ~10 paced steps, not thousands
    began = time.monotonic()
    vllm_step(prefill.workers, StepMetadata(idle=True), range(0))  # nothing awaited: no wait
    assert time.monotonic() - began < 0.04
    granted(decode, prefill, "d13", 83, [1])  # came since the last report: the next step does not wait
    for w in prefill.workers:
        w.pusher.grants.on_notify(PushMessage(PushOp.GRANT, 84, w.endpoint(), 0, 1, (1,), 0, 1, None))  # type: ignore[union-attr]
    began = time.monotonic()
    vllm_step(prefill.workers, StepMetadata(idle=True, awaiting=True), range(0))
    assert time.monotonic() - began < 0.04


def test_a_push_between_caches_of_other_block_sizes_fails_at_once(made: list[Ranks], caplog: pytest.LogCaptureFixture) -> None:
    """Prefill's KV blocks of another size (or any other difference but TP): decode grants nothing — no window
    opens, the load fails at once with the difference named, its blocks listed failed — as a pull refuses."""
    prefill = Ranks(spec(2, 1), False, 28000, seed=28)
    decode = Ranks(spec(2, 1), True, 29000, seed=29)
    made += [prefill, decode]
    other = dataclasses.replace(prefill.workers[0].kv, block_size=2 * BLOCK_SIZE)
    before = decode.snapshot()
    grant = PushGrant("d14", source([w.endpoint() for w in prefill.workers], other, 85), [3, 4], 0, 14)
    vllm_step(decode.workers, StepMetadata(grants=[grant]), range(0))
    assert finished(decode, "d14") < 1
    assert decode.workers[0].take_failed_blocks() == {3, 4}
    assert f"block_size: prefill {2 * BLOCK_SIZE}, decode {BLOCK_SIZE}" in caplog.text, caplog.text
    assert 85 not in functools.reduce(LinkReport.aggregate, [w.link_report() for w in prefill.workers]).granted  # type: ignore[arg-type]
    assert_untouched(decode, before)


def test_a_grant_ends_a_wait_for_one_at_once() -> None:
    """GrantTable.wait_for_grant: back as a grant comes, not at its timeout."""
    from hixl.vllm._push import GrantTable

    table = GrantTable()
    since = table.heard()
    timer = threading.Timer(0.05, table.on_notify, [PushMessage(PushOp.GRANT, 9, Endpoint("127.0.0.1:1", 1, (0, 2)), 0, 1, (1,), 0, 1, None)])
    timer.start()
    began = time.monotonic()
    table.wait_for_grant(since, 10.0)
    assert 0.04 < time.monotonic() - began < 5.0
    assert table.complete() == {9}


def test_an_abort_crossing_a_landed_push_is_listed_once(made: list[Ranks]) -> None:
    """A request aborted at decode just as its push landed (the revoke comes before, or just after, the landing
    is listed in finished_recving) is listed once, in finished_recving, never in finished_sending too: vLLM
    frees an ended request's blocks from either listing and asserts the request is still there (a second
    listing crashed decode's engine in CI)."""
    prefill = Ranks(spec(2, 1), False, 30000, seed=30)
    decode = Ranks(spec(2, 1), True, 31000, seed=31)
    made += [prefill, decode]
    receiver = decode.workers[0].receiver
    assert receiver is not None
    for request_id, push_id, drained_first in (("d16", 86, False), ("d17", 87, True)):
        granted(decode, prefill, request_id, push_id, [1, 2])
        prefill_step(prefill, PushStep("p" + request_id, push_id, [3, 4], 0, 6, True))
        deadline = time.monotonic() + 10
        while request_id not in receiver._recving:  # landed, withdrawn, not listed yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        listed = decode.workers[0].finished_pushes() if drained_first else (set(), set())
        vllm_step(decode.workers, StepMetadata(revokes=[request_id]), range(0))
        later = decode.workers[0].finished_pushes()
        sending, recving = listed[0] | later[0], listed[1] | later[1]
        assert request_id in recving and request_id not in sending, (request_id, sending, recving)


def test_each_push_is_recorded_at_both_ends_landed_revoked_or_failed(made: list[Ranks], tmp_path: Path) -> None:
    """With ``records`` set, decode writes one record per pushed request and rank (its grant, the grants sent,
    the last DONE, the windows withdrawn; the outcome) and prefill one per request and rank (each layer
    computed, handed to the engine and landed, in the prompt's last step; the bytes written), under the
    client's id; a revoked or a cancelled push is recorded as such, at both ends where it started."""
    records = tmp_path / "records.jsonl"
    prefill = Ranks(spec(2, 2), False, 40000, seed=40, records=str(records))
    decode = Ranks(spec(2, 1), True, 41000, seed=41, records=str(records))
    made += [prefill, decode]
    granted(decode, prefill, "cmpl-order-7-0-abcd1234", 91, [7, 8, 0], first_block=1)
    prefill_step(prefill, PushStep("cmpl-order-7-0-wxyz5678", 91, [3, 1, 4, 6], 0, 6, False))
    prefill_step(prefill, PushStep("cmpl-order-7-0-wxyz5678", 91, [3, 1, 4, 6], 6, 14, True))
    finished(decode, "cmpl-order-7-0-abcd1234")

    def written(role: str, count: int) -> list[dict]:
        deadline = time.monotonic() + 10
        while len(found := [r for r in map(json.loads, records.read_text().splitlines()) if r["role"] == role]) < count:
            assert time.monotonic() < deadline, (role, found)
            time.sleep(0.01)
        return found

    (landed,) = written("decode", 1)
    assert landed["mode"] == "push" and landed["outcome"] == "ok" and landed["client_id"] == "order-7" and landed["transport"] == "cma"
    assert landed["start"] <= landed["issued"] <= landed["usable"] <= landed["reported"] and landed["layers"] == []
    row_bytes = decode.caches[0]["layer.0"][0].numel() * 4
    assert landed["nbytes"] == 3 * row_bytes * LAYERS
    pushed = sorted(written("prefill", 2), key=lambda r: r["rank"])
    assert [r["rank"] for r in pushed] == [0, 1] and all(r["request"] == "cmpl-order-7-0-wxyz5678" for r in pushed)
    for record in pushed:
        assert record["outcome"] == "ok" and record["client_id"] == "order-7" and record["transport"] == "cma"
        assert len(record["layers"]) == LAYERS and record["usable"] == record["layers"][-1][0]
        for landed_at, asked, issued in record["layers"]:  # each layer computed, then handed over (cma: landed on the way)
            assert record["start"] <= asked <= min(issued, landed_at) and max(issued, landed_at) <= record["reported"]
        # One head of two per rank: block 1 by the first step, blocks 1 (again), 4 and 6 by the second.
        assert record["nbytes"] == 4 * (row_bytes // 2) * LAYERS
    granted(decode, prefill, "d-revoked-12345678", 92, [2])
    vllm_step(decode.workers, StepMetadata(revokes=["d-revoked-12345678"]), range(0))
    finished(decode, "d-revoked-12345678", sending=True)
    assert written("decode", 2)[1]["outcome"] == "revoked"
    granted(decode, prefill, "d-cancelled-12345678", 93, [5])
    prefill_step(prefill, PushStep("p-cancelled-12345678", 93, [2], 0, 2, False))
    vllm_step(prefill.workers, StepMetadata(cancels=[93]), range(0))
    finished(decode, "d-cancelled-12345678")
    assert written("decode", 3)[2]["outcome"].startswith("failed: prefill cluster")
    assert [r["outcome"] for r in written("prefill", 4)[2:]] == ["failed: cancelled at prefill"] * 2


def test_a_failed_done_fails_the_request_and_garbage_is_refused(made: list[Ranks]) -> None:
    """prefill cancels the push (the request ended there): decode fails it at once; a malformed message, or a
    DONE for a push nobody granted, is refused."""
    prefill = Ranks(spec(2, 1), False, 13000, seed=13)
    decode = Ranks(spec(2, 1), True, 14000, seed=14)
    made += [prefill, decode]
    granted(decode, prefill, "d7", 77, [8])
    vllm_step(prefill.workers, StepMetadata(cancels=[77]), range(0))
    assert finished(decode, "d7") < 2
    assert decode.workers[0].take_failed_blocks() == {8}
    target = decode.workers[0].datadist.local_ip_info
    engine = prefill.workers[0].datadist.engine
    for msg in ("{", json.dumps({"op": "grant", "push_id": 1}), PushMessage(PushOp.DONE, 999, cluster_id=13000).encode()):
        with pytest.raises(hixl.HixlError):
            engine.send_notify(target, hixl.NotifyDesc(PUSH_NOTIFY, msg), 2)


# -- real processes: a side killed mid-push ---------------------------------------------------------------
class Peer:
    """push_peer.py in a child process: one prefill or decode rank driven over its stdin/stdout."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        )

    def ask(self, **order: object) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(order) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"push_peer exited ({self.proc.poll()})"
        return json.loads(line)  # type: ignore[no-any-return]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        if peer.proc.poll() is None:
            peer.kill()


def test_prefill_killed_mid_push_fails_the_request_fast(made: list[Ranks], peers: list[Peer]) -> None:
    decode = Ranks(spec(2, 1), True, 15000, seed=15)
    made.append(decode)
    peers.append(prefill := Peer("prefill", "16000"))
    endpoint = prefill.ask(op="endpoint")
    ranks = [Endpoint(endpoint["ip_info"], endpoint["cluster_id"], (endpoint["heads"][0], endpoint["heads"][1]))]
    grant = PushGrant("d8", source(ranks, spec(2, 1), 78), [2, 3, 4, 5], 0, 14)
    vllm_step(decode.workers, StepMetadata(grants=[grant]), range(0))
    assert prefill.ask(op="wait_granted", push_id=78)["granted"]
    prefill.ask(op="push_layers", push_id=78, layers=[0])  # layer 0 written, the forward goes on ...
    prefill.kill()  # ... and prefill dies
    assert finished(decode, "d8", timeout=10) < 5  # failed (not the 30 s push_timeout), windows withdrawn
    assert decode.workers[0].take_failed_blocks() == {2, 3, 4, 5}


def test_decode_killed_mid_push_leaves_prefills_other_pushes_going(made: list[Ranks], peers: list[Peer], caplog: pytest.LogCaptureFixture) -> None:
    prefill = Ranks(spec(2, 1), False, 17000, seed=17)
    survivor = Ranks(spec(2, 1), True, 18000, seed=18)
    made += [prefill, survivor]
    peers.append(doomed := Peer("decode", "19000"))
    ranks = [w.endpoint() for w in prefill.workers]
    doomed.ask(op="grant", request_id="d9", push_id=79, blocks=[1, 2, 3, 4], prefill=[[e.ip_info, e.cluster_id, list(e.heads)] for e in ranks])
    granted(survivor, prefill, "d10", 80, [5, 6, 7, 8])
    deadline = time.monotonic() + 10
    while 79 not in prefill.workers[0].link_report().granted:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    meta = StepMetadata(pushes=[PushStep("p9", 79, [1, 2, 3, 4], 0, 14, True), PushStep("p10", 80, [5, 6, 7, 8], 0, 14, True)])
    (pc,) = vllm_step(prefill.workers, meta, range(1), end=False)
    doomed.kill()
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="vllm.hixl"):
        for layer in range(1, LAYERS):
            pc.save_kv_layer(f"layer.{layer}", None, None)  # type: ignore[arg-type]
        end_step([pc])
    assert time.monotonic() - started < 8
    assert any("push 79 to decode" in r.getMessage() for r in caplog.records), caplog.text
    finished(survivor, "d10")
    assert_pushed(survivor, prefill, [(5, 5), (6, 6), (7, 7), (8, 8)])
