"""One side of the PD demo — a prefill or a decode instance — in its own process.

Run by :mod:`hixl.demo.run` as ``python -m hixl.demo.worker FD``; it answers
``(command, kwargs)`` messages over the pipe until told to ``exit``. Each
instance holds the same seeded model and a paged KV cache in one page-aligned
storage, registered with DataDist as a blocks cache (the per-layer K/V
tensors are views into that storage).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from .. import empty
from .._tools.child import child_connection, serve_commands
from ..datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    TransferConfig,
)
from .model import ModelSpec, PagedKVCache, build_model, decode, prefill

MODEL_ID = 0


class _LayerGate:
    """A LayerSynchronizer fed by prefill's per-layer callback."""

    def __init__(self, num_layers: int) -> None:
        self.ready = [threading.Event() for _ in range(num_layers)]

    def synchronize_layer(self, layer_index: int, timeout: float | None) -> bool:
        return self.ready[layer_index].wait(timeout)


class DemoWorker:
    """A prefill (PROMPT) or decode (DECODER) instance; methods are the pipe's commands."""

    def __init__(
        self,
        role: str,
        cluster_id: int,
        spec: dict[str, Any],
        num_blocks: int,
        block_size: int,
        transport: str,
        listen: bool,
        threads: int,
        ip: str,
        engine_options: dict[str, Any],
    ) -> None:
        torch.set_num_threads(threads)
        self.spec = ModelSpec(**spec)
        self.model = build_model(self.spec)
        shape = (num_blocks, block_size, self.spec.num_kv_heads, self.spec.head_dim)
        storage = empty((self.spec.num_layers, 2, *shape), np.float32)
        self.cache = PagedKVCache(self.spec, num_blocks, block_size, storage=torch.from_numpy(storage))
        # Warm up (first forward passes in a process are slow), as the colocated run is warm too.
        warm = prefill(self.model, [1, 2, 3], self.cache, [0])
        decode(self.model, warm, 3, self.cache, [0], 2)
        self.datadist = LLMDataDist(LLMRole[role], cluster_id)
        config = LLMConfig(
            listen_ip_info=f"{ip}:0" if listen else None, local_ip=ip, transport=transport, engine_options=engine_options
        )
        self.datadist.init(config)
        desc = CacheDesc(2 * self.spec.num_layers, shape, DataType.DT_FLOAT)
        self.kv = self.datadist.cache_manager.register_blocks_cache(
            desc, self.cache.layer_tensors(), BlocksCacheKey(cluster_id, MODEL_ID)
        )

    def info(self) -> dict[str, Any]:
        """Where peers can link to, and the KV cache's size."""
        listening = ":" in self.datadist.engine.local_engine
        return {"ip_info": self.datadist.local_ip_info if listening else None, "kv_bytes": self.cache.storage.nbytes}

    def link(self, ip_info: str, cluster_id: int) -> dict[str, Any]:
        """Link to a peer instance; reports the status and the transport chosen."""
        status = self.datadist.link_clusters([LLMClusterInfo(cluster_id, ip_info)])[0]
        return {"status": status.name, "transport": self.datadist.engine.transport_of(ip_info)}

    def prefill(
        self, prompt: list[int], block_ids: list[int], push_to: dict[str, Any] | None, req_id: int
    ) -> dict[str, Any]:
        """Compute the prompt's KV into ``block_ids``; with ``push_to``, push each layer as it is done."""
        layer_done: list[float] = []
        gate = _LayerGate(self.spec.num_layers)
        task = None
        if push_to is not None:
            config = TransferConfig(push_to["cluster_id"], BlocksCacheKey(push_to["cluster_id"], MODEL_ID))
            task = self.datadist.cache_manager.transfer_cache_async(
                self.kv, gate, [config], block_ids, push_to["dst_blocks"], req_id=req_id
            )

        def on_layer_done(layer: int) -> None:
            layer_done.append(time.monotonic())
            gate.ready[layer].set()

        start = time.monotonic()
        first_token = prefill(self.model, prompt, self.cache, block_ids, on_layer_done)
        computed = time.monotonic()
        landed: list[float] = []
        if task is not None:
            task.synchronize()
            landed = [task.landed_at(layer) or 0.0 for layer in task.layers]
        return {"first_token": first_token, "start": start, "computed": computed, "layer_done": layer_done, "landed": landed}

    def decode(
        self,
        first_token: int,
        prompt_len: int,
        block_ids: list[int],
        num_tokens: int,
        pull_from: dict[str, Any] | None,
        req_id: int,
    ) -> dict[str, Any]:
        """Generate; with ``pull_from``, pull the prompt's KV layer by layer while decoding starts."""
        start = time.monotonic()
        usable: dict[int, float] = {}
        token_times: list[float] = []
        task = None
        if pull_from is not None:
            task = self.datadist.cache_manager.pull_blocks_async(
                BlocksCacheKey(pull_from["cluster_id"], MODEL_ID),
                self.kv,
                pull_from["src_blocks"],
                block_ids,
                req_id=req_id,
            )

        def wait_layer(layer: int) -> None:
            if task is not None:
                task.wait_layer(layer)
            usable[layer] = time.monotonic()

        tokens = decode(
            self.model, first_token, prompt_len, self.cache, block_ids, num_tokens,
            wait_layer=wait_layer, on_token=lambda _: token_times.append(time.monotonic()),
        )
        landed: list[float] = []
        if task is not None:
            task.synchronize()
            landed = [task.landed_at(layer) or 0.0 for layer in task.layers]
        return {"tokens": tokens, "start": start, "usable": usable, "token_times": token_times, "landed": landed}

    def completed(self) -> list[tuple[int, int, str]]:
        """Completion notifications received (pulled from us / pushed to us)."""
        return [(d.cluster_id, d.req_id, d.op) for d in self.datadist.cache_manager.completed_requests()]

    def close(self) -> None:
        """Finalize DataDist."""
        self.datadist.finalize()


def main() -> None:
    """Serve commands from the parent until ``exit``; errors are sent back, not raised."""
    conn = child_connection()
    worker = DemoWorker(**conn.recv())
    conn.send(worker.info())
    try:
        serve_commands(conn, lambda command, kwargs: getattr(worker, command)(**kwargs))
    finally:
        worker.close()


if __name__ == "__main__":
    main()
