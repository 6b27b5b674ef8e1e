"""The ``weights`` scenario's processes: one publisher and N subscriber nodes, each a child process.

The publisher (``role="publisher"``) holds a Llama-shaped set of fp16 tensors
(:class:`LlamaShape`) in pool memory (the shm transport maps only that: zero-copy
versions go over it too), filled with a pattern, and a
:class:`~hixl.weights.Publisher` on a listening engine. Before each version it
stamps the version number into the first 8 bytes of every tensor, so each
version's bytes differ.

A node (``role="node"``, index 1..N) holds the model's tensors as a serving
process would — one allocation per tensor — and one contiguous buffer of the
same bytes for the contiguous baseline. Per transport it has a listening engine
that forces that transport and a :class:`~hixl.weights.Subscriber` of the
publisher (*flat*: everyone pulls from the publisher) and, for the relay *tree*,
nodes 1 and 2 pull from the publisher and node ``i >= 3`` from node
``(i - 1) // 2`` (:func:`upstream_of`), which serves it through a
:class:`~hixl.weights.Relay` on an engine of its own.

Every contender (what the bench times) is started by a command and stamped with
``time.monotonic_ns()`` — ``CLOCK_MONOTONIC``, one clock for every process of
the machine — where it begins and where the version is held:

* ``arm`` + the publisher's ``publish``: a node waits (in a thread) for version
  ``v`` and pulls it (flat: into its tensors; tree: a relay node into its relay's
  slot, a leaf from its upstream relay into its tensors; zero-copy: into its
  tensors, from a second publisher, on an engine of its own, that publishes the
  publisher's tensors where they are — ``Publisher(mode="zero-copy")`` — retiring
  each version before the tensors are stamped again; bare: the same from a third,
  ``Publisher(mode="zero-copy", checksums=False)``);
* ``contiguous``: one ``transfer_sync`` READ of the newest version's whole slot
  into the contiguous buffer;
* ``gloo``: ``torch.distributed.broadcast`` of every tensor from the publisher
  (rank 0) over gloo, in a group of the publisher and the first N nodes;
* ``save`` (publisher) + ``load`` (nodes): a safetensors file in the default temp
  dir, read back tensor by tensor into each node's tensors (``safe_open``, as
  serving frameworks load checkpoints).

``digest`` gives the CRC-32 of what a node holds after a contender, tensor by
tensor in the publisher's order: the bench compares it with the publisher's
digest of its own tensors, so a wrong byte anywhere on any path is caught.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .._memory import empty
from .._tools.child import ChildProcess, CommandChild, child_connection, serve_commands
from .._types import Op
from ..engine import Engine
from .kv_prefill import fill_pattern

__all__ = [
    "CONTENDERS",
    "LlamaShape",
    "Node",
    "NodeProcess",
    "PublisherProcess",
    "PublisherSide",
    "digest",
    "serve",
    "upstream_of",
]

SALT = 0x5EED_0003
TIMEOUT = 300.0  # seconds per wait or transfer: generous, a slow machine is not a failure here
CONTENDERS = ("flat", "tree", "zero-copy", "bare", "contiguous", "gloo", "safetensors")
#: The module a node or the publisher runs as (``python -m``); the tests swap in a faulty node.
CHILD_MODULE = "hixl.bench._weights_peer_main"


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-style decoder's weights, Hugging Face names, fp16 (see :meth:`tensors`)."""

    layers: int
    hidden: int
    intermediate: int
    kv_dim: int
    vocab: int

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor: embeddings, per layer attention, MLP and norms, final norm, head."""
        h, kv, mlp = self.hidden, self.kv_dim, self.intermediate
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (mlp, h),
                p + "mlp.up_proj.weight": (mlp, h),
                p + "mlp.down_proj.weight": (h, mlp),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        return shapes | {"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)}

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor together (fp16)."""
        return 2 * sum(int(np.prod(s)) for s in self.tensors().values())


def upstream_of(node: int) -> int:
    """Whom node ``node`` (1-based) pulls from in the relay tree: 0 (the publisher) for nodes 1 and 2,
    else node ``(node - 1) // 2`` — a binary tree, each relay feeding two nodes."""
    return 0 if node <= 2 else (node - 1) // 2


def digest(arrays: Sequence[np.ndarray]) -> int:
    """CRC-32 of the arrays' bytes, one after the other."""
    crc = 0
    for array in arrays:
        crc = zlib.crc32(array.reshape(-1).view(np.uint8).data, crc)
    return crc


def _allocate(shape: LlamaShape, shared: bool = False) -> dict[str, np.ndarray]:
    """One page-aligned allocation per tensor (``shared``: from hixl's pool, which the shm
    transport can map), every page touched now (not inside a timed pull)."""
    out = {name: empty(dims, np.float16, shared=shared) for name, dims in shape.tensors().items()}
    for array in out.values():
        array.view(np.uint8).fill(0)
    return out


def _gloo(store_port: int, rank: int, world: int, sizes: Sequence[int]) -> dict[int, Any]:
    """Join the gloo world (its store at the publisher) and make one group per subscriber count."""
    import torch.distributed as dist  # heavy: imported in the children that broadcast, when they do

    store = dist.TCPStore("127.0.0.1", store_port, world, False, datetime.timedelta(seconds=TIMEOUT))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT))
    return {n: dist.new_group(list(range(n + 1))) for n in sizes}  # every rank makes every group, in order


def _broadcast(tensors: dict[str, np.ndarray], group: Any) -> None:
    import torch
    import torch.distributed as dist

    for array in tensors.values():
        dist.broadcast(torch.from_numpy(array), src=0, group=group)


# -- the publisher -----------------------------------------------------------------------------------
class PublisherSide:
    """The publisher child's state and commands (see the module docstring)."""

    def __init__(self, shape: LlamaShape, world: int) -> None:
        from ..weights import Publisher

        self.engine = Engine("127.0.0.1:0")
        self.publisher = Publisher(self.engine, slots=2, lease=TIMEOUT)
        self.zero_engine = Engine("127.0.0.1:0")  # (one publisher per engine)
        self.zero = Publisher(self.zero_engine, lease=TIMEOUT, mode="zero-copy")
        self.bare_engine = Engine("127.0.0.1:0")
        self.bare = Publisher(self.bare_engine, lease=TIMEOUT, mode="zero-copy", checksums=False)
        self.live: dict[Any, int] = {}  # zero-copy publisher -> the version of the tensors it still serves
        self.weights = _allocate(shape, shared=True)  # pool memory: zero-copy versions can go over shm too
        for array in self.weights.values():
            fill_pattern(array, SALT)
        self.world = world
        self.stamped = 0
        self.published = {self.publisher: 0, self.zero: 0, self.bare: 0}  # the last version of each
        self.store: Any = None
        self.groups: dict[int, Any] = {}
        self.file = os.path.join(tempfile.gettempdir(), f"hixl-bench-weights-{os.getpid()}.safetensors")

    def open_store(self) -> int:
        """Start the gloo rendezvous store (port 0: the kernel picks a free one); its port."""
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, self.world, True, datetime.timedelta(seconds=TIMEOUT),
                                   wait_for_workers=False)
        return int(self.store.port)

    def join_gloo(self, sizes: Sequence[int]) -> None:
        """Rank 0 of the gloo world (see :func:`_gloo`)."""
        import torch.distributed as dist

        dist.init_process_group("gloo", store=self.store, rank=0, world_size=self.world,
                                timeout=datetime.timedelta(seconds=TIMEOUT))
        self.groups = {n: dist.new_group(list(range(n + 1))) for n in sizes}

    def zero_copy_addresses(self) -> tuple[str, str]:
        """The zero-copy publishers' engines: with checksums, without."""
        return self.zero_engine.local_engine, self.bare_engine.local_engine

    def _for(self, contender: str) -> Any:
        return {"zero-copy": self.zero, "bare": self.bare}.get(contender, self.publisher)

    def stamp(self, contender: str) -> int:
        """Make the tensors new bytes (a count in their first 8 bytes); the version ``contender``'s
        publisher will publish them as. The zero-copy version they were is retired first (its
        readers are done: the bench collected their pulls), as a trainer must before it writes."""
        for publisher, version in self.live.items():
            publisher.wait_released(version, TIMEOUT)
        self.live.clear()
        self.stamped += 1
        for array in self.weights.values():
            array.view(np.uint64)[0] = self.stamped
        return self.published[self._for(contender)] + 1

    def digest(self) -> int:
        """:func:`digest` of the tensors as they are now."""
        return digest(list(self.weights.values()))

    def publish(self, contender: str) -> tuple[int, int, int]:
        """Publish the tensors as ``contender`` reads them: ``(version, start_ns, end_ns)`` of the call."""
        publisher = self._for(contender)
        start = time.monotonic_ns()
        version = publisher.publish(self.weights)
        end = time.monotonic_ns()
        self.published[publisher] = version
        if publisher.mode == "zero-copy":
            self.live[publisher] = version
        return version, start, end

    def gloo(self, n: int) -> int:
        """Broadcast every tensor to the first ``n`` nodes; when it started (after a barrier)."""
        import torch.distributed as dist

        dist.barrier(group=self.groups[n])
        start = time.monotonic_ns()
        _broadcast(self.weights, self.groups[n])
        return start

    def save(self) -> tuple[str, int, int]:
        """Save the tensors as a safetensors file in the default temp dir: ``(path, start_ns, end_ns)``."""
        from safetensors.numpy import save_file

        start = time.monotonic_ns()
        save_file(self.weights, self.file)
        return self.file, start, time.monotonic_ns()

    def close(self) -> None:
        """Remove the file, stop publishing, leave gloo."""
        if os.path.exists(self.file):
            os.unlink(self.file)
        self.publisher.close()
        self.zero.close()
        self.bare.close()
        self.engine.finalize()
        self.zero_engine.finalize()
        self.bare_engine.finalize()
        if self.groups:
            import torch.distributed as dist

            dist.destroy_process_group()


# -- a node --------------------------------------------------------------------------------------------
class _Transport:
    """A node's engines and subscribers for one transport (see the module docstring)."""

    def __init__(
        self, transport: str, publisher: str, zero_copies: Sequence[str], upstream: str | None, serves: bool
    ) -> None:
        from ..weights import Relay, Subscriber

        self.engine = Engine("127.0.0.1:0", {"transport": transport})
        self.flat = Subscriber(self.engine, publisher, timeout=TIMEOUT)
        self.zero = Subscriber(self.engine, zero_copies[0], timeout=TIMEOUT)
        self.bare = Subscriber(self.engine, zero_copies[1], timeout=TIMEOUT)
        self.tree = self.flat if upstream is None else Subscriber(self.engine, upstream, timeout=TIMEOUT)
        self.relay_engine = Engine("127.0.0.1:0") if serves else None
        self.relay = None if self.relay_engine is None else Relay(self.tree, self.relay_engine, lease=TIMEOUT, follow=False)

    def close(self) -> None:
        if self.relay is not None and self.relay_engine is not None:
            self.relay.close()
            self.relay_engine.finalize()
        if self.tree is not self.flat:
            self.tree.close()
        self.zero.close()
        self.bare.close()
        self.flat.close()
        self.engine.finalize()


class Node:
    """A subscriber node child's state and commands (see the module docstring)."""

    def __init__(self, index: int, shape: LlamaShape, publisher: str) -> None:
        self.index = index
        self.publisher = publisher
        self.tensors = _allocate(shape)
        self.contiguous = empty(shape.nbytes + (1 << 20))  # the slot's padding between tensors fits
        self.contiguous.fill(0)
        self.groups: dict[int, Any] = {}
        self.side: _Transport | None = None
        self.manifest: Any = None
        self.thread: threading.Thread | None = None
        self.outcome: list[Any] = []

    def join_gloo(self, store_port: int, world: int, sizes: Sequence[int]) -> None:
        """Rank ``index`` of the gloo world (see :func:`_gloo`)."""
        self.groups = _gloo(store_port, self.index, world, sizes)

    def setup(self, transport: str, zero_copies: Sequence[str], upstream: str | None, serves: bool) -> str | None:
        """Subscribe over ``transport`` to both publishers (and the tree's ``upstream`` relay); the
        address of its relay if it ``serves``."""
        self.teardown()
        self.side = _Transport(transport, self.publisher, zero_copies, upstream, serves)
        self.side.engine.register_mem(self.contiguous)
        return None if self.side.relay_engine is None else self.side.relay_engine.local_engine

    def teardown(self) -> None:
        """Close this transport's engines and subscribers."""
        if self.side is not None:
            self.side.close()
            self.side = None

    def arm(self, contender: str, version: int) -> None:
        """Start waiting for ``version`` and pulling it as ``contender`` (flat, tree) does, in a thread."""
        side = self._side()
        ready = threading.Event()

        def receive() -> None:
            try:
                ready.set()
                if contender == "tree" and side.relay is not None:
                    side.tree.wait_version(version)
                    side.relay.pull(version=version)
                else:
                    sub = {"flat": side.flat, "zero-copy": side.zero, "bare": side.bare}.get(contender, side.tree)
                    sub.wait_version(version)
                    sub.pull(self.tensors, version=version)
                self.outcome[:] = [time.monotonic_ns()]
            except Exception as exc:  # noqa: BLE001  (re-raised by collect)
                self.outcome[:] = [exc]

        self.outcome = []
        self.thread = threading.Thread(target=receive, name="bench-weights-pull", daemon=True)
        self.thread.start()
        ready.wait(TIMEOUT)

    def collect(self) -> int:
        """When the armed pull ended (``monotonic_ns``); raises what it raised."""
        assert self.thread is not None
        self.thread.join(TIMEOUT)
        if not self.outcome:
            raise TimeoutError(f"node {self.index} did not pull within {TIMEOUT} s")
        (result,) = self.outcome
        if isinstance(result, Exception):
            raise result
        return int(result)

    def contiguous_read(self) -> tuple[int, int]:
        """The baseline: one ``transfer_sync`` READ of the newest version's slot, start to end: ``(start_ns, end_ns)``."""
        side = self._side()
        self.manifest = side.flat.manifest()
        span = max(t.offset + t.nbytes for t in self.manifest.tensors)
        region = self.manifest.regions[0]
        desc = [(int(self.contiguous.ctypes.data), region.addr, span)]
        start = time.monotonic_ns()
        side.engine.transfer_sync(self.publisher, Op.READ, desc, TIMEOUT)
        return start, time.monotonic_ns()

    def gloo(self, n: int) -> int:
        """Receive every tensor from the publisher's broadcast; when it ended."""
        import torch.distributed as dist

        dist.barrier(group=self.groups[n])
        _broadcast(self.tensors, self.groups[n])
        return time.monotonic_ns()

    def load(self, path: str) -> int:
        """Read the safetensors file back, tensor by tensor into this node's tensors; when it ended."""
        from safetensors import safe_open

        with safe_open(path, framework="numpy") as f:
            for name, array in self.tensors.items():
                np.copyto(array, f.get_tensor(name))
        return time.monotonic_ns()

    def held(self, contender: str) -> list[np.ndarray]:
        """What this node holds after ``contender``, tensor by tensor (none for a relay's tree pull:
        its leaves' pulls from it check it)."""
        if contender == "contiguous":
            return [self.contiguous[t.offset : t.offset + t.nbytes] for t in self.manifest.tensors]
        if contender == "tree" and self._side().relay is not None:
            return []
        return list(self.tensors.values())

    def verify_ns(self) -> int:
        """How long a subscriber's ``verify`` of this node's tensors takes (their checksums, timed here
        apart from any pull: the bench's estimate of that share of a pull)."""
        from ..weights._checks import checksum_of
        from ..weights._lanes import spread

        arrays = [array.reshape(-1).view(np.uint8) for array in self.tensors.values()]
        lanes = int(self._side().engine.options["copy_lanes"])
        start = time.monotonic_ns()
        spread(checksum_of, arrays, [len(a) for a in arrays], lanes)
        return time.monotonic_ns() - start

    def digest(self, contender: str) -> int | None:
        """:func:`digest` of :meth:`held` (None when it holds nothing to check)."""
        arrays = self.held(contender)
        return digest(arrays) if arrays else None

    def _side(self) -> _Transport:
        if self.side is None:
            raise RuntimeError("setup() a transport first")
        return self.side

    def close(self) -> None:
        """Leave gloo, close every engine."""
        self.teardown()
        if self.groups:
            import torch.distributed as dist

            dist.destroy_process_group()


def serve(conn: Connection, node_class: type[Node] = Node) -> None:
    """The child's main loop: ``(role, args)`` in, then commands until ``exit`` (methods of the role's object)."""
    role, args = conn.recv()
    side: PublisherSide | Node = PublisherSide(*args) if role == "publisher" else node_class(*args)
    conn.send(("ready", os.getpid(), side.engine.local_engine if isinstance(side, PublisherSide) else None))
    try:
        serve_commands(conn, lambda command, call_args: getattr(side, command)(*call_args))
    finally:
        side.close()


# -- the parent's handles -------------------------------------------------------------------------------
class _Peer(CommandChild):
    """A weights child process; ``do(command, *args)`` runs a method of its role's object there."""

    answer_timeout = TIMEOUT

    def __init__(self, role: str, args: tuple[Any, ...], who: str) -> None:
        self.who = who
        self._child = ChildProcess(CHILD_MODULE, TIMEOUT, env={"GLOO_SOCKET_IFNAME": "lo"})
        try:
            _, self.pid, self.address = self._child.request((role, args))
        except BaseException:
            self._child.kill()
            raise


class PublisherProcess(_Peer):
    """The publisher child (see the module docstring); ``address`` is its engine's."""

    def __init__(self, shape: LlamaShape, world: int) -> None:
        super().__init__("publisher", (shape, world), "weights publisher")


class NodeProcess(_Peer):
    """Subscriber node ``index`` (1-based), a child process (see the module docstring)."""

    def __init__(self, index: int, shape: LlamaShape, publisher: str) -> None:
        super().__init__("node", (index, shape, publisher), f"weights node {index}")
        self.index = index


def main() -> None:
    """The child's entry point (``python -m hixl.bench._weights_peer_main FD``)."""
    serve(child_connection())
