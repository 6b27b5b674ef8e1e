"""One push-mode worker (a prefill or a decode rank, TP 1) in its own process, for tests that kill it.

``python push_peer.py prefill|decode CLUSTER_ID``; reads one JSON order a line on stdin, answers one JSON
line on stdout. Its KV cache has the shapes test_push_worker.py's instances have (2 KV heads).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from hixl.vllm import ConnectorConfig, Mode
from hixl.vllm._params import (
    CPU_LAYOUT,
    Endpoint,
    KvSpec,
    PushGrant,
    PushSource,
    PushStep,
    StepMetadata,
)
from hixl.vllm._worker import WorkerSide

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_SIZE, HEADS = 3, 10, 4, 4, 2


def main() -> None:
    role, cluster_id = sys.argv[1], int(sys.argv[2])
    kv = KvSpec("tiny", "float32", LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE, CPU_LAYOUT, 1)
    worker = WorkerSide(ConnectorConfig(mode=Mode.PUSH, cluster_id=cluster_id), True, role == "decode", BLOCKS, kv)
    worker.register({f"layer.{i}": torch.randn(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE) for i in range(LAYERS)})
    for line in sys.stdin:
        order = json.loads(line)
        answer: dict[str, object] = {}
        if order["op"] == "endpoint":
            endpoint = worker.endpoint()
            assert endpoint is not None
            answer = {"ip_info": endpoint.ip_info, "cluster_id": endpoint.cluster_id, "heads": list(endpoint.heads)}
        elif order["op"] == "wait_granted":  # prefill
            deadline = time.monotonic() + 10
            while order["push_id"] not in worker.link_report().granted and time.monotonic() < deadline:  # type: ignore[union-attr]
                time.sleep(0.01)
            answer = {"granted": order["push_id"] in worker.link_report().granted}  # type: ignore[union-attr]
        elif order["op"] == "push_layers":  # prefill: one step's first layers, the rest never comes
            worker.take_push_orders(StepMetadata(pushes=[PushStep("p", order["push_id"], [1, 2, 3, 4], 0, 14, True)]))
            for layer in order["layers"]:
                worker.save_layer(f"layer.{layer}")
        elif order["op"] == "grant":  # decode
            ranks = tuple(Endpoint(ip, cid, (heads[0], heads[1])) for ip, cid, heads in order["prefill"])
            grant = PushGrant(order["request_id"], PushSource(ranks, kv, order["push_id"]), order["blocks"], 0, 14)
            worker.take_push_orders(StepMetadata(grants=[grant]))
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
