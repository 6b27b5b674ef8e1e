"""One offline ``vllm.LLM`` with hixl's weights extension, driven over stdin/stdout by the tests.

``python -m tests.weights.vllm_main MODEL_DIR JSON_SETTINGS`` (settings: ``tp``). Prints
``@@answer {"ready": ..., "startup_s": ...}`` once up, then answers each JSON line:
``{"cmd": "generate", "prompts": [...], "max_tokens": n}`` -> token ids and weight versions per prompt;
``{"cmd": "update", "address": a, "version": v, "timeout": t}`` -> ``{"version": v}`` or ``{"error": ..., "type": ...}``;
``{"cmd": "state"}`` -> each rank's ``hixl_weights_state``; ``{"cmd": "label"}`` -> vLLM's weight-version label;
``{"cmd": "checksums"}`` -> vLLM's own per-parameter checksums (every rank's);
``{"cmd": "reload", "path": p}`` -> vLLM's own ``reload_weights`` from a checkpoint directory;
``{"cmd": "loaders_agree", "path": p}`` -> :func:`tests.weights.vllm_checks.loaders_agree` on every rank;
``{"cmd": "served"}`` -> ``{"version": v}`` from ``served_version`` or ``{"error": ..., "type": ...}``;
``{"cmd": "rpc", "method": m, "request": {...}}`` -> each rank's answer to the extension's method ``m``;
``{"cmd": "race", "updates": [{"address", "version", "timeout"}, ...]}`` -> what each update answers,
the updates run at once, each in its thread, with every pull done before any apply (:class:`Raced`).
EOF on stdin ends it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

MARK = "@@answer "  # answers are the lines starting with this; anything else on stdout is noise
EXTENSION = "tests.weights.vllm_checks.CheckedExtension"  # hixl's, plus the tests' check


def answer(doc: object) -> None:
    print(MARK + json.dumps(doc), flush=True)


class Raced:
    """An ``LLM`` for several ``update_weights`` threads at once, interleaved the worst way: each
    update's apply waits (up to 120 s) until all ``updates`` pulls have returned. Each call holds
    a lock: the LLM's client socket is not thread-safe (the updates interleave, not its frames)."""

    def __init__(self, llm: Any, updates: int) -> None:
        self._llm, self._updates, self._pulled = llm, updates, 0
        self._lock, self._all_pulled = threading.Lock(), threading.Condition()
        self.llm_engine = llm.llm_engine

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = ()) -> list[Any]:
        if method == "hixl_weights_apply":
            with self._all_pulled:
                self._all_pulled.wait_for(lambda: self._pulled >= self._updates, timeout=120)
        with self._lock:
            answers = self._llm.collective_rpc(method, timeout=timeout, args=args)
        if method == "hixl_weights_pull":
            with self._all_pulled:
                self._pulled += 1
                self._all_pulled.notify_all()
        return answers  # type: ignore[no-any-return]

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self._llm.reset_prefix_cache()


def update(llm: Any, order: dict[str, Any]) -> dict[str, Any]:
    """``update_weights`` as ``order`` says, its outcome answered (the test checks errors too)."""
    import hixl.weights

    try:
        return {"version": hixl.weights.update_weights(llm, order["address"], order.get("version"), order["timeout"])}
    except Exception as exc:  # noqa: BLE001  (answered to the test, which checks it)
        return {"error": str(exc), "type": type(exc).__name__}


def race(llm: Any, orders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run the updates at once through :class:`Raced`; each one's outcome, in ``orders``' order."""
    raced = Raced(llm, len(orders))
    outcomes: list[dict[str, Any]] = [{} for _ in orders]

    def one(i: int) -> None:
        outcomes[i] = update(raced, orders[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(orders))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return outcomes


def main() -> None:
    model, settings = sys.argv[1], json.loads(sys.argv[2])
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout carries the answers
    tp = int(settings.get("tp", 1))
    if tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: starts faster
    started = time.monotonic()
    from vllm import LLM, SamplingParams

    import hixl.weights

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        block_size=32,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        distributed_executor_backend="uni" if tp == 1 else "mp",
        worker_extension_cls=EXTENSION,
    )
    answer({"ready": True, "startup_s": time.monotonic() - started})
    for line in sys.stdin:
        order = json.loads(line)
        cmd = order["cmd"]
        if cmd == "generate":
            sampling = SamplingParams(temperature=0, max_tokens=order["max_tokens"], ignore_eos=True)
            outs = llm.generate(order["prompts"], sampling, use_tqdm=False)
            answer([{"token_ids": list(o.outputs[0].token_ids)} for o in outs])
        elif cmd == "update":
            answer(update(llm, order))
        elif cmd == "race":
            answer(race(llm, order["updates"]))
        elif cmd == "served":
            try:
                answer({"version": hixl.weights.served_version(llm)})
            except hixl.weights.UpdateFailed as exc:
                answer({"error": str(exc), "type": type(exc).__name__, "broken": exc.broken})
        elif cmd == "rpc":
            answer(llm.collective_rpc(order["method"], args=(json.dumps(order["request"]),)))
        elif cmd == "state":
            answer(llm.collective_rpc("hixl_weights_state", args=("{}",)))
        elif cmd == "label":
            answer(llm.llm_engine.get_weight_version())
        elif cmd == "checksums":
            answer(llm.collective_rpc("compute_weight_checksums"))
        elif cmd == "reload":
            llm.collective_rpc("reload_weights", kwargs={"weights_path": order["path"], "is_checkpoint_format": True})
            llm.reset_prefix_cache()
            answer({"reloaded": order["path"]})
        elif cmd == "loaders_agree":
            answer(llm.collective_rpc("hixl_test_loaders_agree", args=(order["path"],)))


if __name__ == "__main__":
    main()
