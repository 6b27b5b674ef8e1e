"""``hixl bench --scenario weights``: publish a version, time until every subscriber holds it.

A publisher and ``N`` subscriber nodes, each its own process
(:mod:`hixl.bench.weights_peers`), hold a Llama-shaped set of fp16 tensors —
by default 9 layers of TinyLlama's shape (2048 hidden, 5632 MLP, 4 KV heads of
64, a 32000-token vocabulary): 84 tensors, 0.98 GiB. For each transport and
each ``N`` (1, 2, 4 by default), these contenders are timed interleaved
(:func:`hixl.bench.timing.interleaved_reps`), each repetition from its start to
the moment the last node holds the bytes (``CLOCK_MONOTONIC``, one clock for
every process):

* ``flat`` — hixl: ``publish`` (the snapshot copy, fused with its checksum),
  the notification, every node's ``pull`` of the version (its READ, the header
  word, the checksum check). Snapshot mode pays that copy by design (the trainer
  may write its tensors again as soon as ``publish`` returns);
* ``zero-copy`` — the same from a ``Publisher(mode="zero-copy")``: ``publish``
  checksums the trainer's tensors where they are and nodes read them there;
* ``bare`` — zero-copy from a publisher made with ``checksums=False``: no pass
  over the bytes but the READ (leases and the header word still prove every
  pull whole), so it is what can approach one contiguous read (the issue's 0.9x);
* ``contiguous`` — every node's single ``transfer_sync`` READ of the newest
  version's whole slot into a contiguous buffer: what the bytes cost when
  nothing is versioned, checked or split into tensors;
* ``tree`` (``N >= 3``) — hixl with relays: nodes 1 and 2 pull from the
  publisher, node ``i >= 3`` from node ``(i - 1) // 2``'s
  :class:`~hixl.weights.Relay` (which serves a version once it has pulled it
  whole);
* ``gloo`` — ``torch.distributed.broadcast`` of every tensor from the publisher
  over gloo on 127.0.0.1, the CPU path RL frameworks fall back to;
* ``safetensors`` — the publisher saves a safetensors file in the default temp
  dir and the nodes read it back tensor by tensor into their tensors.

gloo and safetensors do not depend on the transport: they are timed once per
``N``, interleaved with the first transport's contenders, and their medians are
the baselines of every transport's rows.

Rows (values in GiB/s of the model's bytes over the time until all ``N`` hold
them): hixl (snapshot, zero-copy and bare: rows of their own) against
``contiguous`` (target >= 0.9x with one subscriber), against ``gloo`` (>= 3x)
and ``safetensors`` (>= 5x); their notes split publish->held into publish (copy
and checksum), pull and verify (node 1's checksum of its tensors, timed apart);
and with ``N >= 3`` the
tree's aggregate (``N`` x the model over its time) against the flat fan-out's.

Before anything is timed, each contender runs once more, checked: every node's
CRC-32 of what it holds must equal the publisher's of its tensors (stamped with
the version number, so every version differs). A mismatch aborts the run.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from contextlib import ExitStack

from .config import BenchConfig, format_size
from .progress import Progress
from .results import Row, ScenarioResult, Target, median
from .timing import SelfTimed, interleaved_reps
from .weights_peers import LlamaShape, NodeProcess, PublisherProcess, upstream_of

__all__ = [
    "FULL_SHAPE",
    "FULL_SUBSCRIBERS",
    "QUICK_SHAPE",
    "QUICK_SUBSCRIBERS",
    "describe",
    "filesystem_of",
    "knobs",
    "run",
]

#: TinyLlama-1.1B's dimensions, 9 of its 22 layers: about 1 GiB of fp16 (``--layers`` changes the count).
FULL_SHAPE = LlamaShape(layers=9, hidden=2048, intermediate=5632, kv_dim=256, vocab=32000)
#: ``--quick``: the same structure, a few MiB.
QUICK_SHAPE = LlamaShape(layers=2, hidden=256, intermediate=688, kv_dim=64, vocab=4000)
FULL_SUBSCRIBERS = (1, 2, 4)
QUICK_SUBSCRIBERS = (1, 3)  # 3: the smallest count with a relay in the tree

# The targets.
VS_CONTIGUOUS = Target(">=", 0.9)  # one subscriber
VS_GLOO = Target(">=", 3.0)
VS_SAFETENSORS = Target(">=", 5.0)

_GIB = 1 << 30


def knobs(config: BenchConfig) -> tuple[LlamaShape, tuple[int, ...]]:
    """The weights' shape and the subscriber counts ``config`` asks for (``weights_*`` keys of ``extra``)."""
    shape = QUICK_SHAPE if config.quick else FULL_SHAPE
    layers = config.extra.get("weights_layers")
    if layers is not None:
        shape = LlamaShape(int(layers), shape.hidden, shape.intermediate, shape.kv_dim, shape.vocab)  # type: ignore[call-overload]
    counts = config.extra.get("weights_subscribers") or (QUICK_SUBSCRIBERS if config.quick else FULL_SUBSCRIBERS)
    return shape, tuple(sorted({int(n) for n in counts}))  # type: ignore[attr-defined]


def describe(config: BenchConfig) -> str:
    """One line for the run's header: the weights and the subscriber counts."""
    shape, counts = knobs(config)
    return (
        f"weights {shape.layers}-layer Llama fp16 (hidden {shape.hidden}), {len(shape.tensors())} tensors, "
        f"{format_size(shape.nbytes)} ({shape.nbytes / _GIB:.2f} GiB) to {','.join(map(str, counts))} subscribers"
    )


def filesystem_of(path: str) -> str:
    """``"TYPE at MOUNTPOINT"`` of the filesystem ``path`` is on (from ``/proc/mounts``)."""
    real = os.path.realpath(path)
    best = ("?", "/")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1]
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[1]):
                    best = (fields[2], point)
    except OSError:
        pass
    return f"{best[0]} at {best[1]}"


def _tree(counts: int) -> str:
    """Who pulls from whom in the relay tree of ``counts`` nodes, in words."""
    parts = [f"{i}<-{upstream_of(i) or 'publisher'}" for i in range(1, counts + 1)]
    return "nodes " + ", ".join(parts)


class _Fleet:
    """The publisher and the nodes, and one repetition of each contender (nanoseconds, or a check)."""

    def __init__(self, publisher: PublisherProcess, nodes: list[NodeProcess]) -> None:
        self.publisher, self.nodes = publisher, nodes
        self.transport = ""
        self.publish_ns: dict[str, list[int]] = {"flat": [], "zero-copy": [], "bare": []}
        self.save_ns: list[int] = []

    def setup(self, transport: str) -> None:
        """Subscribe every node over ``transport``: flat to the publisher, tree to its upstream relay."""
        self.transport = transport
        self.zero_copies = self.publisher.do("zero_copy_addresses")
        relays: dict[int, str | None] = {0: self.publisher.address}
        count = len(self.nodes)
        for node in self.nodes:
            serves = any(upstream_of(j) == node.index for j in range(1, count + 1))
            upstream = upstream_of(node.index)
            relays[node.index] = node.do("setup", transport, self.zero_copies, relays[upstream] if upstream else None, serves)

    def teardown(self) -> None:
        """Close every node's engines for the transport."""
        for node in self.nodes:
            node.do("teardown")

    def _check(self, n: int, contender: str, expected: int) -> None:
        for node in self.nodes[:n]:
            got = node.do("digest", contender)
            if got is not None and got != expected:
                raise RuntimeError(
                    f"weights self-check failed on {self.transport}, {n} subscribers: node {node.index} holds "
                    f"wrong bytes after {contender} (CRC-32 {got:#010x}, the publisher's {expected:#010x})"
                )

    def pull(self, n: int, contender: str, check: bool) -> int:
        """hixl, ``flat``, ``zero-copy``, ``bare`` or ``tree``: publish the next version, every node pulls it."""
        version = self.publisher.do("stamp", contender)
        for node in self.nodes[:n]:
            node.do("arm", contender, version)
        published, start, end = self.publisher.do("publish", contender)
        if published != version:
            raise RuntimeError(f"the publisher published version {published}, the bench expected {version}")
        held = max(node.do("collect") for node in self.nodes[:n])
        if contender in self.publish_ns:
            self.publish_ns[contender].append(end - start)
        if check:
            self._check(n, contender, self.publisher.do("digest"))
        return held - start

    def contiguous(self, n: int, check: bool) -> int:
        """The baseline: every node's one ``transfer_sync`` of the newest slot, at once."""
        for node in self.nodes[:n]:
            node.start("contiguous_read")
        spans = [node.answer("contiguous_read") for node in self.nodes[:n]]
        if check:
            self._check(n, "contiguous", self.publisher.do("digest"))
        return max(end for _, end in spans) - min(start for start, _ in spans)

    def gloo(self, n: int, check: bool) -> int:
        """The baseline: a gloo broadcast of every tensor from the publisher to the first ``n`` nodes."""
        self.publisher.start("gloo", n)
        for node in self.nodes[:n]:
            node.start("gloo", n)
        start = self.publisher.answer("gloo")
        held = max(node.answer("gloo") for node in self.nodes[:n])
        if check:
            self._check(n, "gloo", self.publisher.do("digest"))
        return held - start

    def safetensors(self, n: int, check: bool) -> int:
        """The baseline: save a safetensors file, every node reads it back."""
        path, start, saved = self.publisher.do("save")
        for node in self.nodes[:n]:
            node.start("load", path)
        held = max(node.answer("load") for node in self.nodes[:n])
        self.save_ns.append(saved - start)
        if check:
            self._check(n, "safetensors", self.publisher.do("digest"))
        return held - start


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Run the ``weights`` scenario (see the module docstring) and return its rows."""
    shape, counts = knobs(config)
    progress.expect(1 + len(config.transports) * len(counts))
    rows: list[Row] = []
    notes: list[str] = []
    baselines: dict[int, dict[str, float]] = {}  # n -> gloo / safetensors median ns
    with ExitStack() as stack:
        with progress.step(f"weights: start a publisher and {max(counts)} subscribers ({format_size(shape.nbytes)} each)"):
            publisher = stack.enter_context(PublisherProcess(shape, max(counts) + 1))
            nodes = [stack.enter_context(NodeProcess(i, shape, publisher.address)) for i in range(1, max(counts) + 1)]
            port = publisher.do("open_store")
            publisher.start("join_gloo", counts)
            for node in nodes:
                node.start("join_gloo", port, max(counts) + 1, counts)
            for peer in (publisher, *nodes):
                peer.answer("join_gloo")
        fleet = _Fleet(publisher, nodes)
        for transport in config.transports:
            try:
                fleet.setup(transport)
            except RuntimeError as exc:
                notes.append(f"weights {transport}: skipped, a subscriber could not subscribe this way ({exc})")
                fleet.teardown()
                progress.skip(len(counts))
                continue
            try:
                for n in counts:
                    with progress.step(f"weights {transport}: {n} subscriber(s)"):
                        rows += _measure(fleet, n, config, baselines, shape.nbytes)
            finally:
                fleet.teardown()
    measured_in = next((t for t in config.transports if any(r.transport == t for r in rows)), None)
    if measured_in is not None:
        notes.append(
            f"weights: gloo broadcast and safetensors timed once per subscriber count, interleaved with {measured_in}'s "
            "contenders; their medians are every transport's baselines"
        )
    if max(counts) >= 3:
        notes.append(f"weights: relay tree {_tree(max(counts))} (a relay serves a version once it holds all of it)")
    if fleet.save_ns:
        tmp = tempfile.gettempdir()
        notes.append(
            f"weights: safetensors file in {tmp} ({filesystem_of(tmp)}), not fsynced: the reload reads the page "
            f"cache; saving took {median(fleet.save_ns) / 1e6:.0f} ms (median) of the baseline"
        )
    if shape != FULL_SHAPE:
        notes.append(f"weights: scaled-down weights ({describe(config)}); the issue's are about 1 GiB")
    return ScenarioResult(rows, notes)


def _measure(
    fleet: _Fleet, n: int, config: BenchConfig, baselines: dict[int, dict[str, float]], nbytes: int
) -> list[Row]:
    """Check, then time, every contender with ``n`` subscribers (the model: ``nbytes``); the rows."""
    contenders: dict[str, Callable[[bool], int]] = {
        "zero-copy": functools.partial(fleet.pull, n, "zero-copy"),
        "bare": functools.partial(fleet.pull, n, "bare"),
        "flat": functools.partial(fleet.pull, n, "flat"),
        "contiguous": functools.partial(fleet.contiguous, n),
    }
    if n >= 3:
        contenders["tree"] = functools.partial(fleet.pull, n, "tree")
    if n not in baselines:
        contenders["gloo"] = functools.partial(fleet.gloo, n)
        contenders["safetensors"] = functools.partial(fleet.safetensors, n)
    for contender in contenders.values():  # "flat" just before it: the contiguous read checks the newest snapshot
        contender(True)  # the checked pass, also the warm-up
    for samples in fleet.publish_ns.values():
        samples.clear()
    timed = {name: _unchecked(rep) for name, rep in contenders.items()}
    times = interleaved_reps(timed, 1, config.repeat, max(0, config.warmup - 1))
    ns = {name: float(median(samples)) for name, samples in times.items()}
    if n not in baselines:
        baselines[n] = {"gloo": ns["gloo"], "safetensors": ns["safetensors"]}

    def gib_per_s(seconds_ns: float, copies: int = 1) -> float:
        return copies * nbytes / (seconds_ns / 1e9) / _GIB

    verify_ms = fleet.nodes[0].do("verify_ns") / 1e6
    row = functools.partial(Row, transport=fleet.transport, op="pull", size=nbytes, unit="GiB/s", scenario="weights")
    out = []
    others = (("gloo", "torch.distributed broadcast, gloo", VS_GLOO), ("safetensors", "safetensors save + reload", VS_SAFETENSORS))
    for mode, prefix in (("flat", ""), ("zero-copy", "zero-copy "), ("bare", "zero-copy, no checksums, ")):
        hixl = gib_per_s(ns[mode])
        samples = fleet.publish_ns[mode][-config.repeat :]
        publish_ms, total_ms = (median(samples) / 1e6 if samples else float("nan")), ns[mode] / 1e6
        what = {"flat": "copy + checksum", "zero-copy": "checksum", "bare": "manifest"}[mode]
        verified = verify_ms if mode != "bare" else 0.0
        out.append(
            row(
                name=f"{prefix}publish->all held, {n} sub",
                value=hixl,
                baseline=gib_per_s(ns["contiguous"]),
                baseline_name=f"{n} contiguous transfer_sync at once" if n > 1 else "1 contiguous transfer_sync",
                target=VS_CONTIGUOUS if n == 1 else None,
                note=f"of {total_ms:.0f} ms: publish ({what}) {publish_ms:.0f}, pull {total_ms - publish_ms - verified:.0f}, "
                f"verify ~{verified:.0f} (node 1's checksums, timed apart)",
            )
        )
        for key, name, target in others:
            out.append(
                row(name=f"{prefix}publish->all held, {n} sub, vs {key}", value=hixl,
                    baseline=gib_per_s(baselines[n][key]), baseline_name=name, target=target)
            )
    if "tree" in ns:
        out.append(
            row(
                name=f"relay tree, {n} sub, aggregate",
                value=gib_per_s(ns["tree"], n),
                baseline=gib_per_s(ns["flat"], n),
                baseline_name="flat: all from the publisher",
                note=_tree(n),
            )
        )
    return out


def _unchecked(repetition: Callable[[bool], int]) -> SelfTimed:
    """A contender's timed form: one unchecked repetition, its nanoseconds (the bench makes one call a repetition)."""
    return SelfTimed(lambda _calls: repetition(False))
