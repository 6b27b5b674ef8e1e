"""A DataDist instance in a child process, driven over a pipe (see :class:`DataDistProcess`).

The child is a fresh interpreter started with ``python -m`` (as for
:class:`~hixl.testing.TargetProcess`), so a test's prefill and decode sides
really are two processes with two engines, and a transfer between them
crosses a process boundary on whichever transport the config forces. The
child allocates and owns its cache tensors; the parent names them by a
string and reads or writes them through the pipe to check what landed.
"""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .._tools.child import ChildProcess, serve_commands
from ..datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    LLMClusterInfo,
    LLMConfig,
    LLMRole,
    LLMStatusCode,
    TransferDone,
)

__all__ = ["CacheRef", "DataDistProcess", "PeerError", "pattern"]


def pattern(desc: CacheDesc, seed: int) -> np.ndarray:
    """Seeded test data for a whole cache, shaped ``(num_tensors, *desc.shape)``.

    Small integers, so every value is exact in float16 as well as in the wider
    types, and element-wise equality is the right check after a transfer.
    """
    dtype = np.dtype(desc.data_type.value)
    low = 0 if dtype.kind == "u" else -100
    values = np.random.default_rng(seed).integers(low, 100, (desc.num_tensors, *desc.shape), dtype=np.int64)
    return values.astype(dtype)


@dataclass(frozen=True)
class CacheRef:
    """Stands for the child's cache registered as ``name`` in :meth:`DataDistProcess.cache_manager` calls."""

    name: str


class PeerError(Exception):
    """An exception raised in the child, carried back as type name, message and status code."""

    def __init__(self, type_name: str, message: str, status_code: LLMStatusCode | None, remote_traceback: str) -> None:
        super().__init__(f"{type_name} in the DataDist child: {message}")
        self.type_name = type_name
        self.status_code = status_code
        self.remote_traceback = remote_traceback


# -- the child ------------------------------------------------------------------------------
class _Child:
    """What the child process keeps: its DataDist and its caches by name."""

    def __init__(self, role: LLMRole, cluster_id: int, config: LLMConfig) -> None:
        from ..datadist import LLMDataDist  # imported in the child only

        self.dd = LLMDataDist(role, cluster_id)
        self.dd.init(config)
        self.caches: dict[str, tuple[Cache, list[np.ndarray]]] = {}
        self.retired: dict[str, list[np.ndarray]] = {}  # tensors of unregistered caches, kept alive

    def register(self, name: str, desc: CacheDesc, keys: Any, blocks: bool, layout: str, seed: int | None) -> int:
        from .. import empty

        if name in self.caches:
            raise ValueError(f"a cache named {name!r} exists already")
        dtype = np.dtype(desc.data_type.value)
        if layout.startswith("reuse:"):  # the memory of an unregistered cache, for stale-address tests
            tensors = self.retired.pop(layout[len("reuse:") :])
        elif layout == "shared":  # per-layer tensors are views into one storage
            storage = empty((desc.num_tensors, *desc.shape), dtype)
            tensors = list(storage)
        elif layout == "separate":
            tensors = [empty(desc.shape, dtype) for _ in range(desc.num_tensors)]
        else:
            raise ValueError(f"layout must be 'shared', 'separate' or 'reuse:NAME', not {layout!r}")
        if seed is not None:
            for tensor, values in zip(tensors, pattern(desc, seed)):
                tensor[...] = values
        manager = self.dd.cache_manager
        if blocks:
            cache = manager.register_blocks_cache(desc, tensors, keys)
        else:
            cache = manager.register_cache(desc, tensors, keys)
        self.caches[name] = (cache, tensors)
        return cache.cache_id

    def unregister(self, name: str, keep_memory: bool) -> None:
        cache, tensors = self.caches.pop(name)
        self.dd.cache_manager.unregister_cache(cache.cache_id)
        if keep_memory:
            self.retired[name] = tensors

    def read(self, name: str, index: Any) -> np.ndarray:
        tensors = self.caches[name][1]
        if index is None:
            return np.stack(tensors)
        if isinstance(index, int):
            return tensors[index].copy()
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        picked = [tensors[i] for i in range(len(tensors))[first]] if isinstance(first, slice) else [tensors[i] for i in first]
        return np.stack(picked)[(slice(None), *rest)]

    def write(self, name: str, value: Any) -> None:
        tensors = self.caches[name][1]
        values = np.broadcast_to(np.asarray(value), (len(tensors), *tensors[0].shape))
        for tensor, v in zip(tensors, values):
            tensor[...] = v

    def call(self, target: str, method: str, args: tuple, kwargs: dict) -> Any:
        obj = self.dd.cache_manager if target == "cache_manager" else self.dd

        def resolve(arg: Any) -> Any:
            return self.caches[arg.name][0] if isinstance(arg, CacheRef) else arg

        result = getattr(obj, method)(*map(resolve, args), **{k: resolve(v) for k, v in kwargs.items()})
        # A transfer's result (an async CacheTask) can't cross the pipe; it runs on in the child.
        return None if target == "cache_manager" and method.startswith(("pull", "push")) else result

    def local_mems(self) -> list[tuple[int, int]]:
        return [(m.addr, m.len) for m in self.dd.engine.local_mems()]


def _serve(conn: Connection) -> None:
    role, cluster_id, config = conn.recv()
    try:
        child = _Child(role, cluster_id, config)
    except Exception as exc:  # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(("error", _error_tuple(exc)))
        return
    conn.send(("ok", (child.dd.local_ip_info, os.getpid())))
    try:
        serve_commands(conn, lambda command, args: getattr(child, command)(*args), _error_tuple)
    finally:
        child.dd.finalize()


def _error_tuple(exc: BaseException) -> tuple[str, str, LLMStatusCode | None, str]:
    return type(exc).__name__, str(exc), getattr(exc, "status_code", None), traceback.format_exc()


# -- the parent -----------------------------------------------------------------------------
class DataDistProcess:
    """Start ``LLMDataDist(role, cluster_id).init(config)`` in a child process.

    ``config`` must listen (``listen_ip_info``), since peers link *to* the
    child. Once started: ``ip_info`` (the child's ``"ip:port"``), ``pid``,
    ``role``, ``cluster_id``, and :meth:`cluster_info` to link to it. Methods run in the
    child: :meth:`register_blocks_cache`, :meth:`register_cache`,
    :meth:`unregister`, :meth:`read`, :meth:`write`, :meth:`completed_requests`,
    :meth:`local_mems`, :meth:`cache_manager` and :meth:`datadist` (any
    method). Errors in the child come back as :class:`PeerError`. ``prefix`` runs the
    child under a command that execs it (as for :class:`~hixl.testing.TargetProcess`;
    :attr:`hixl.testing.hosts.Host.prefix` puts it on another host).
    """

    def __init__(
        self, role: LLMRole, cluster_id: int, config: LLMConfig, timeout: float = 30.0, prefix: Sequence[str] = ()
    ) -> None:
        self.role = role
        self.cluster_id = cluster_id
        self.timeout = timeout
        self._child = ChildProcess("hixl.testing._datadist_main", timeout, prefix)
        try:
            self.ip_info, self.pid = self._unwrap(self._child.request((role, cluster_id, config)))
        except BaseException:
            self.close()
            raise
        self.descs: dict[str, CacheDesc] = {}

    @staticmethod
    def _unwrap(reply: tuple[str, Any]) -> Any:
        status, value = reply
        if status == "error":
            raise PeerError(*value)
        return value

    def _do(self, command: str, *args: Any) -> Any:
        return self._unwrap(self._child.request((command, args)))

    def cluster_info(self) -> LLMClusterInfo:
        """What to pass to ``link_clusters`` to link to this child."""
        return LLMClusterInfo(self.cluster_id, self.ip_info)

    def register_blocks_cache(
        self, name: str, desc: CacheDesc, key: BlocksCacheKey | None, layout: str = "shared", seed: int | None = None
    ) -> int:
        """Allocate and register a blocks cache in the child; filled with :func:`pattern` if ``seed`` is given.

        ``layout`` is ``"shared"`` (tensors are views into one storage),
        ``"separate"`` (one allocation per tensor), or ``"reuse:NAME"`` (the
        tensors of cache NAME, unregistered with ``keep_memory=True``).
        Returns the cache id.
        """
        cache_id = self._do("register", name, desc, key, True, layout, seed)
        self.descs[name] = desc
        return cache_id  # type: ignore[no-any-return]

    def register_cache(
        self, name: str, desc: CacheDesc, keys: list[CacheKey], layout: str = "shared", seed: int | None = None
    ) -> int:
        """Like :meth:`register_blocks_cache`, for a plain cache named by ``keys``."""
        cache_id = self._do("register", name, desc, keys, False, layout, seed)
        self.descs[name] = desc
        return cache_id  # type: ignore[no-any-return]

    def unregister(self, name: str, keep_memory: bool = False) -> None:
        """Unregister the child's cache ``name``; its memory is freed unless ``keep_memory``."""
        self._do("unregister", name, keep_memory)

    def read(self, name: str, index: Any = None) -> np.ndarray:
        """The child's cache ``name`` as ``(num_tensors, *shape)``, or the part ``index`` selects.

        ``index`` indexes that stacked array (an int picks one tensor).
        """
        return self._do("read", name, index)  # type: ignore[no-any-return]

    def write(self, name: str, value: Any) -> None:
        """Set every tensor of the child's cache ``name`` (``value`` broadcasts to the stacked shape)."""
        self._do("write", name, value)

    def completed_requests(self) -> list[TransferDone]:
        """The child's ``cache_manager.completed_requests()``."""
        return self._do("call", "cache_manager", "completed_requests", (), {})  # type: ignore[no-any-return]

    def local_mems(self) -> list[tuple[int, int]]:
        """The child engine's registered regions as ``(addr, len)``."""
        return self._do("local_mems")  # type: ignore[no-any-return]

    def cache_manager(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``cache_manager.method`` in the child; pass :class:`CacheRef` for its caches."""
        return self._do("call", "cache_manager", method, args, kwargs)

    def datadist(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``LLMDataDist.method`` in the child (``link_clusters``, ``switch_role``, ...)."""
        return self._do("call", "datadist", method, args, kwargs)

    def stop(self, signum: int = signal.SIGSTOP) -> None:
        """Freeze (SIGSTOP) or resume (SIGCONT) the child."""
        self._child.signal(signum)

    def kill(self) -> None:
        """SIGKILL the child, as a crash would."""
        self._child.kill()

    def close(self) -> None:
        """Ask the child to finalize and exit; kill it if it doesn't."""
        self._child.close(goodbye=("exit", ()))

    @property
    def exitcode(self) -> int | None:
        """The child's exit code once it ended."""
        return self._child.process.poll()

    def __enter__(self) -> DataDistProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DataDistProcess cluster={self.cluster_id} {getattr(self, 'ip_info', '?')} pid={self._child.pid}>"
