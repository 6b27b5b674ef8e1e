"""The vLLM of ``hixl bench --scenario weights-vllm``: an offline ``vllm.LLM`` in its own process.

``python -m hixl.bench._weights_vllm_main FD`` (see :mod:`hixl._tools.child`); its first
command is ``start(model)``. It runs hixl's weights extension and times, in this process,
each way of switching its weights — from the call to the first token generated with them:

* ``hixl(address, version, tokens)``: :func:`hixl.weights.update_weights` from a publisher;
* ``reload(path, tokens)``: vLLM's own ``reload_weights`` from a safetensors checkpoint
  directory (``collective_rpc``, as its docs show), then the prefix cache dropped — what
  ``update_weights`` does after its reload too.

Each returns ``(nanoseconds, token ids)``: the tokens let the parent check that the weights
generating them are the ones switched to.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .._tools.child import child_connection, serve_commands
from ..testing.tiny_llama import words

PROMPT = words(12, 5)
EXTENSION = "hixl.weights.vllm_worker.WeightsExtension"


class _Engine:
    def __init__(self) -> None:
        self.llm: Any = None

    def start(self, model: str) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=model, dtype="float32", max_model_len=256, block_size=32, enforce_eager=True,
            kv_cache_memory_bytes=32 << 20, worker_extension_cls=EXTENSION,
        )

    def _first_tokens(self, tokens: int) -> list[int]:
        from vllm import SamplingParams

        greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return list(self.llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids)

    def hixl(self, address: str, version: int, tokens: int) -> tuple[int, list[int]]:
        from hixl.weights import update_weights

        started = time.monotonic_ns()
        update_weights(self.llm, address, version, timeout=60.0)
        out = self._first_tokens(tokens)
        return time.monotonic_ns() - started, out

    def reload(self, path: str, tokens: int) -> tuple[int, list[int]]:
        started = time.monotonic_ns()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        out = self._first_tokens(tokens)
        return time.monotonic_ns() - started, out


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: nothing between call and clock
    engine = _Engine()
    serve_commands(child_connection(), lambda command, args: getattr(engine, command)(*args))
