"""The ``kv`` scenario: a Llama-70B-shaped KV cache pulled with :mod:`hixl.datadist`.

The prompt's KV cache — by default 80 layers x (K, V) x 4096 tokens x 8 KV
heads x 128 dims, fp16: 1.25 GiB — lives in a prefill instance in a child
process (:mod:`hixl.bench.kv_prefill`); this process is the decode instance
and pulls it. On both sides the prompt occupies a *shuffled subset* of a pool
twice its size, as a paged allocator hands out blocks, so the transfer is one
descriptor per block per tensor and next to nothing merges.

For each transport (forced through the decode side's ``LLMConfig``; when shm
is among them the prefill's cache and contiguous buffer are pool memory,
``hixl.empty(..., shared=True)``, the only memory shm maps) and each
block size (16, 32 and 128 tokens by default), three contenders are timed
interleaved over the same two processes and the same connection
(:func:`hixl.bench.timing.interleaved_reps`):

* ``pull_blocks`` — the synchronous pull of every block of every layer;
* the *baseline*: the engine's own ``transfer_sync`` of one descriptor of the
  same byte count between two contiguous registered buffers — what the bytes
  cost when nothing is scattered and nothing is KV-specific;
* ``pull_blocks_async`` + ``synchronize`` — the layer-by-layer pull, which
  also yields the *time to first layer*: ``landed_at(first layer) - start``
  over ``landed_at(last layer) - start``, ``start`` being just before the call.

Rows: pull_blocks bandwidth / contiguous bandwidth (target >= 0.9x); on cma,
for diagnosis, the same scattered ranges copied by bare ``process_vm_readv``
calls (IOV_MAX iovecs each, no hixl) against the same baseline — the kernel's
own ceiling for this layout; pull_blocks_async bandwidth / contiguous (no
target, for diagnosis); and the
first layer's share of the async pull's time, in percent, against an even
share of ``100 / layers`` % — so the ratio is "how many layers' worth of time
the first layer took", and the issue's target ``share <= 1.5 / layers`` reads
``ratio <= 1.5x``. Figures are medians over ``repeat`` repetitions.

The ``kv-vllm`` scenario is the same measurement on vLLM's CPU layout
(:attr:`KvShape.fused_kv`: one tensor per layer, K and V interleaved inside
each block, as hixl's vLLM connector registers it) at a Llama-3-8B shape —
32 layers x 8 KV heads x 128, fp16, a 4096-token prompt, 32-token blocks —
with the same targets.

Before anything is timed, each configuration is checked: a sample of
destination blocks is poisoned, pulled (sync, then async) and compared byte
for byte with the pattern the prefill side was filled with; the contiguous
baseline is checked the same way. A mismatch aborts the run. That checked pass
is also the warm-up. The descriptor count in the notes is what the engine
issues after merging, computed here with :func:`hixl._memory.merge_adjacent`
over the same descriptors DataDist builds (block order as given, tensors K0,
V0, K1, ...), not observed inside the library.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any

import numpy as np

from .. import Op, TransferOpDesc, empty
from .._memory import merge_adjacent
from ..datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)
from ..datadist._layout import in_remote_order
from .baselines import IOV_MAX, Copier, cma_batch_copier
from .config import BenchConfig, format_size
from .kv_prefill import CONTIGUOUS_SALT, POOL_SALT, PREFILL_CLUSTER, KvShape, PrefillProcess, pattern
from .progress import Progress
from .results import Row, ScenarioResult, Target, median
from .timing import interleaved_reps

__all__ = [
    "FULL_SHAPE",
    "PRESETS",
    "QUICK_SHAPE",
    "VLLM_FULL_SHAPE",
    "VLLM_QUICK_SHAPE",
    "describe",
    "issued_descriptors",
    "pull_descriptors",
    "run",
    "run_vllm",
    "shape_of",
]

DECODE_CLUSTER = 2

#: The issue's shape, at full size; ``--layers`` / ``--tokens`` / ``--block-sizes`` scale it.
FULL_SHAPE = KvShape()
#: ``--quick``: a few layers, a short prompt, one block size (a few MiB, well under a second).
QUICK_SHAPE = KvShape(layers=4, tokens=1024, block_sizes=(16,))
#: ``kv-vllm``: vLLM's CPU layout of a Llama-3-8B cache, 32-token blocks.
VLLM_FULL_SHAPE = KvShape(layers=32, tokens=4096, block_sizes=(32,), fused_kv=True)
VLLM_QUICK_SHAPE = KvShape(layers=4, tokens=1024, block_sizes=(32,), fused_kv=True)
#: Scenario name -> (full shape, ``--quick`` shape).
PRESETS = {"kv": (FULL_SHAPE, QUICK_SHAPE), "kv-vllm": (VLLM_FULL_SHAPE, VLLM_QUICK_SHAPE)}

# The targets.
PULL_BANDWIDTH = Target(">=", 0.9)  # pull_blocks vs one contiguous transfer_sync
FIRST_LAYER = Target("<=", 1.5)  # first layer's share of the async pull, in even per-layer shares

TIMEOUT = 300.0  # seconds per transfer: generous, a slow machine is not a failure here
SAMPLE_BLOCKS = 32  # blocks checked byte for byte per configuration (plus the first and the last)


def shape_of(config: BenchConfig, scenario: str = "kv") -> KvShape:
    """The cache shape ``config`` asks for: the scenario's preset, with ``kv_*`` keys of ``config.extra`` applied."""
    full, quick = PRESETS[scenario]
    shape = quick if config.quick else full
    overrides: dict[str, Any] = {}
    for key, field_name in (("kv_layers", "layers"), ("kv_tokens", "tokens"), ("kv_block_sizes", "block_sizes")):
        if key in config.extra:
            overrides[field_name] = config.extra[key]
    if "block_sizes" in overrides:
        overrides["block_sizes"] = tuple(overrides["block_sizes"])
    return replace(shape, **overrides)


def describe(config: BenchConfig, scenario: str = "kv") -> str:
    """One line for the run's header: the shape and what one pull moves."""
    shape = shape_of(config, scenario)
    layout = "K|V fused per layer (vLLM CPU)" if shape.fused_kv else "K+V"
    return (
        f"{scenario} cache {shape.layers} layers x {shape.tokens} tokens x {shape.kv_heads}x{shape.head_dim} fp16 "
        f"{layout} ({format_size(shape.prompt_bytes)}), blocks of {','.join(map(str, shape.block_sizes))} tokens"
    )


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Run the ``kv`` scenario (see the module docstring) and return its rows."""
    return _run(config, progress, "kv")


def run_vllm(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Run the ``kv-vllm`` scenario: the same, on vLLM's CPU layout at a Llama-3-8B shape."""
    return _run(config, progress, "kv-vllm")


def _run(config: BenchConfig, progress: Progress, scenario: str) -> ScenarioResult:
    shape = shape_of(config, scenario)
    progress.expect(1 + len(config.transports) * len(shape.block_sizes))
    rows: list[Row] = []
    notes: list[str] = []
    with progress.step(f"kv prefill: fill {format_size(shape.prompt_bytes * shape.pool_factor)} of KV"):
        prefill = PrefillProcess(shape, shared="shm" in config.transports)
    with prefill:
        storage = empty(shape.storage_shape, np.float16)
        contiguous = empty(shape.prompt_bytes)
        contiguous.fill(0)  # every page resident before anything is timed
        storage.view(np.uint8).fill(0)
        for transport in config.transports:
            decode = _DecodeSide(scenario, transport, shape, prefill, storage, contiguous)
            if not decode.linked:
                notes.append(f"{transport}: skipped, decode could not link to prefill this way ({decode.status.name})")
                decode.close()
                progress.skip(len(shape.block_sizes))
                continue
            try:
                for bs in shape.block_sizes:
                    with progress.step(f"{scenario} {transport} pull {bs}-token blocks"):
                        rows += decode.measure(bs, config)
            finally:
                decode.close()
    full = PRESETS[scenario][0]
    if shape.layers != full.layers or shape.tokens != full.tokens:
        notes.append(
            f"{scenario}: scaled-down cache ({describe(config, scenario)}); "
            f"the issue's shape is {full.layers} layers x {full.tokens} tokens"
        )
    return ScenarioResult(rows, notes)


def pull_descriptors(
    shape: KvShape, block_size: int, local_storage: int, remote_storage: int, src: np.ndarray, dst: np.ndarray
) -> np.ndarray:
    """The ``(tensors, len(src), 3)`` descriptors of a pull of blocks ``src`` into ``dst``.

    Built as DataDist builds them: tensor by tensor (K0, V0, K1, ..., or one per
    layer with ``fused_kv``), blocks in the remote blocks' order (``in_remote_order``),
    one (local, remote, length) per block per tensor.
    """
    dst, src = in_remote_order(np.asarray(dst, dtype=np.uint64), np.asarray(src, dtype=np.uint64), Op.READ)
    tensors = shape.tensors_per_layer * shape.layers
    tensor_bytes = np.uint64(shape.pool_tokens * shape.token_bytes)
    block = np.uint64(shape.block_bytes(block_size))
    bases = np.arange(tensors, dtype=np.uint64)[:, None] * tensor_bytes
    descs = np.empty((tensors, len(src), 3), dtype=np.uint64)
    descs[..., 0] = np.uint64(local_storage) + bases + np.asarray(dst, dtype=np.uint64)[None, :] * block
    descs[..., 1] = np.uint64(remote_storage) + bases + np.asarray(src, dtype=np.uint64)[None, :] * block
    descs[..., 2] = block
    return descs


def issued_descriptors(descs: np.ndarray, tensors_per_layer: int = 2) -> tuple[int, int]:
    """How many descriptors the engine issues for :func:`pull_descriptors`: (sync, summed over async layers).

    The engine merges runs contiguous on both sides (:func:`merge_adjacent`);
    the sync pull is one transfer, the async one a transfer per layer.
    """
    sync = len(merge_adjacent(descs.reshape(-1, 3)))
    n = tensors_per_layer
    per_layer = sum(len(merge_adjacent(descs[n * i : n * i + n].reshape(-1, 3))) for i in range(len(descs) // n))
    return sync, per_layer


def _gib_per_s(nbytes: int, ns: float) -> float:
    return nbytes / (ns / 1e9) / (1 << 30)


class _DecodeSide:
    """The decode instance for one transport: linked to prefill, one blocks cache per block size."""

    def __init__(
        self,
        scenario: str,
        transport: str,
        shape: KvShape,
        prefill: PrefillProcess,
        storage: np.ndarray,
        contiguous: np.ndarray,
    ) -> None:
        self.scenario = scenario
        self.transport = transport
        self.shape = shape
        self.prefill = prefill
        self.storage = storage
        self.contiguous = contiguous
        self.datadist = LLMDataDist(LLMRole.DECODER, DECODE_CLUSTER)
        self.datadist.init(LLMConfig(transport=transport, sync_kv_timeout=TIMEOUT))
        self.status = self.datadist.link_clusters([LLMClusterInfo(PREFILL_CLUSTER, prefill.ip_info)])[0]
        self.linked = self.status is LLMStatusCode.SUCCESS
        self.caches: dict[int, Cache] = {}
        if self.linked:
            try:
                self._register()
            except BaseException:
                self.datadist.finalize()
                raise

    def _register(self) -> None:
        engine, shape, peer = self.datadist.engine, self.shape, self.prefill.ip_info
        if engine.transport_of(peer) != self.transport:  # the option forces it; never measure another
            raise RuntimeError(f"asked for {self.transport}, linked over {engine.transport_of(peer)}")
        engine.register_mem(self.contiguous)
        for bs in shape.block_sizes:
            desc = CacheDesc(shape.tensors_per_layer * shape.layers, shape.tensor_shape(bs), DataType.DT_FLOAT16)
            self.caches[bs] = self.datadist.cache_manager.register_blocks_cache(desc, shape.tensors(self.storage, bs))

    def close(self) -> None:
        """Finalize the decode instance (the buffers stay for the next transport)."""
        self.datadist.finalize()

    def measure(self, block_size: int, config: BenchConfig) -> list[Row]:
        """Check, then time, every contender at one block size; returns its rows."""
        pull = _Pull(self, block_size)
        contenders: dict[str, Copier] = {
            "pull_blocks": pull.sync,
            "contiguous": pull.contiguous,
            "pull_blocks_async": pull.async_,
        }
        if self.transport == "cma":
            # The kernel's own ceiling for this layout: the same ranges, bare syscalls, no hixl.
            iov = merge_adjacent(pull.descs.reshape(-1, 3))
            contenders["raw_scattered"] = cma_batch_copier(self.prefill.pid, Op.READ, iov[:, [0, 2]], iov[:, [1, 2]])
            lanes = int(self.datadist.engine.options["copy_lanes"])
            if lanes > 1:  # ... and split over as many threads as the engine's copy lanes
                contenders["raw_lanes"] = cma_batch_copier(
                    self.prefill.pid, Op.READ, iov[:, [0, 2]], iov[:, [1, 2]], lanes
                )
                contenders["raw_lanes"]()
            contenders["raw_scattered"]()  # its warm-up; the checked pass below warms the others
        pull.check()
        times = interleaved_reps(contenders, 1, config.repeat, max(0, config.warmup - 1))
        return pull.rows(times, pull.laps[-config.repeat :])


class _Pull:
    """One block size on one decode side: the blocks to pull, the contenders, the check and the rows."""

    def __init__(self, side: _DecodeSide, block_size: int) -> None:
        shape, bs = side.shape, block_size
        self.side, self.shape, self.bs = side, shape, bs
        rng = np.random.default_rng(bs)
        self.n, self.pool = shape.prompt_blocks(bs), shape.pool_blocks(bs)
        # A shuffled subset of each side's pool: what a paged allocator hands out after some churn.
        self.src, self.dst = rng.permutation(self.pool)[: self.n], rng.permutation(self.pool)[: self.n]
        self.src_list, self.dst_list = self.src.tolist(), self.dst.tolist()  # what a serving framework hands over
        self.key, self.cache = BlocksCacheKey(PREFILL_CLUSTER, model_id=bs), side.caches[bs]
        self.manager = side.datadist.cache_manager
        self.engine, self.peer = side.datadist.engine, side.prefill.ip_info
        self.one_desc = [TransferOpDesc(int(side.contiguous.ctypes.data), side.prefill.contiguous, shape.prompt_bytes)]
        self.descs = pull_descriptors(
            shape, bs, int(side.storage.ctypes.data), side.prefill.storage, self.src, self.dst
        )
        self.per_layer = shape.tensors_per_layer
        self.laps: list[tuple[float, float]] = []
        """Per async pull: (first layer landed, last layer landed), seconds after the call."""

    # -- the contenders ----------------------------------------------------------------------
    def sync(self) -> None:
        """``pull_blocks``: every block of every layer, one call."""
        self.manager.pull_blocks(self.key, self.cache, self.src_list, self.dst_list, tensor_num_per_layer=self.per_layer)

    def async_(self) -> None:
        """``pull_blocks_async`` + ``synchronize``, recording when the first and last layers landed."""
        start = time.monotonic()  # the clock of CacheTask.landed_at
        task = self.manager.pull_blocks_async(
            self.key, self.cache, self.src_list, self.dst_list, tensor_num_per_layer=self.per_layer
        )
        task.synchronize()
        first, last = task.landed_at(task.layers[0]), task.landed_at(task.layers[-1])
        if first is None or last is None:
            raise RuntimeError(f"pull_blocks_async synchronized but reports no landing time: {task!r}")
        self.laps.append((first - start, last - start))

    def contiguous(self) -> None:
        """The baseline: the engine's ``transfer_sync`` of one descriptor of the same byte count."""
        self.engine.transfer_sync(self.peer, Op.READ, self.one_desc, TIMEOUT)

    # -- the self-check ----------------------------------------------------------------------
    def check(self) -> None:
        """Poison a sample of destination blocks, pull, compare with the prefill pattern; same for the baseline.

        Raises ``RuntimeError`` on the first wrong byte: a broken transfer must not be timed.
        """
        shape, bs, transport = self.shape, self.bs, self.side.transport
        block_words = shape.block_bytes(bs) // 8
        per_layer = shape.tensors_per_layer
        words = self.side.storage.view(np.uint64).reshape(shape.layers, per_layer, self.pool, block_words)
        rng = np.random.default_rng(1000 + bs)
        sample = [(0, 0, 0), (shape.layers - 1, per_layer - 1, self.n - 1)] + [
            (int(rng.integers(shape.layers)), int(rng.integers(per_layer)), int(rng.integers(self.n)))
            for _ in range(SAMPLE_BLOCKS)
        ]
        for what, pull in (("pull_blocks", self.sync), ("pull_blocks_async", self.async_)):
            for layer, kv, i in sample:
                words[layer, kv, self.dst[i]] = 0
            pull()
            for layer, kv, i in sample:
                expected = pattern(shape.block_word(layer, kv, int(self.src[i]), bs), block_words, POOL_SALT)
                if not np.array_equal(words[layer, kv, self.dst[i]], expected):
                    raise RuntimeError(
                        f"kv self-check failed on {transport}, {bs}-token blocks: {what} left wrong bytes in layer "
                        f"{layer} tensor {kv} block {int(self.dst[i])} (prefill block {int(self.src[i])})"
                    )
        flat = self.side.contiguous.view(np.uint64)
        spans = [0, len(flat) - block_words] + [
            int(rng.integers(len(flat) - block_words)) for _ in range(SAMPLE_BLOCKS)
        ]
        for start in spans:
            flat[start : start + block_words] = 0
        self.contiguous()
        for start in spans:
            if not np.array_equal(flat[start : start + block_words], pattern(start, block_words, CONTIGUOUS_SALT)):
                raise RuntimeError(f"kv self-check failed on {transport}: the contiguous baseline left wrong bytes")

    # -- the rows ----------------------------------------------------------------------------
    def rows(self, times: dict[str, list[int]], laps: list[tuple[float, float]]) -> list[Row]:
        """The rows of this block size from the contenders' times (ns) and the async pulls' laps."""
        shape, bs, nbytes = self.shape, self.bs, self.shape.prompt_bytes
        sync_descs, async_descs = issued_descriptors(self.descs, self.per_layer)

        def gib_per_s(name: str) -> float:
            return _gib_per_s(nbytes, median(times[name]))

        row = functools.partial(
            Row,
            transport=self.side.transport,
            op="READ",
            size=nbytes,
            baseline=gib_per_s("contiguous"),
            baseline_name="1 contiguous transfer_sync",
            scenario=self.side.scenario,
        )
        blocks = f"{self.n} of {self.pool} {format_size(shape.block_bytes(bs))} blocks per tensor, shuffled"
        out = [
            row(
                name=f"pull_blocks bs={bs}",
                value=gib_per_s("pull_blocks"),
                unit="GiB/s",
                target=PULL_BANDWIDTH,
                note=f"{blocks}; {sync_descs} descriptors issued",
            )
        ]
        lanes = self.side.datadist.engine.options["copy_lanes"]
        raw = {
            "raw_scattered": ("raw scattered", f"bare process_vm_readv of the same {sync_descs} ranges, {IOV_MAX} per call, one thread"),
            "raw_lanes": ("raw lanes", f"the same calls split over {lanes} threads, as the copy lanes split them: kernel's ceiling"),
        }
        for contender, (name, note) in raw.items():
            if contender in times:
                out.append(row(name=f"{name} bs={bs}", value=gib_per_s(contender), unit="GiB/s", note=note))
        out.append(
            row(
                name=f"pull_async bs={bs}",
                value=gib_per_s("pull_blocks_async"),
                unit="GiB/s",
                note=f"pull_blocks_async + synchronize: {shape.layers} requests, {async_descs} descriptors",
            )
        )
        first_ms, last_ms = median([f for f, _ in laps]) * 1e3, median([t for _, t in laps]) * 1e3
        out.append(
            row(
                name=f"first layer bs={bs}",
                value=median([100.0 * f / t for f, t in laps]),
                unit="% of pull",
                baseline=100.0 / shape.layers,
                baseline_name=f"an even share, 1/{shape.layers}",
                target=FIRST_LAYER,
                note=f"layer 0 landed {first_ms:.2f} ms into a {last_ms:.1f} ms pull_blocks_async",
            )
        )
        return out
