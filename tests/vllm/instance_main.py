"""One offline ``vllm.LLM`` instance driven over stdin/stdout, for the end-to-end tests.

``python instance_main.py ROLE MODEL_DIR [JSON_SETTINGS]`` — ROLE is
``prefill``, ``decode`` or ``reference``; SETTINGS become the connector's
extra config, except ``connector`` / ``module`` (another connector class),
``kv_load_failure_policy``, ``tp`` (tensor-parallel size, 1 by default: more
runs vLLM's multiprocessing executor, one worker process per rank),
``block_size`` (32 by default) and ``env`` (variables set before vLLM starts). It prints ``{"ready": ..., "startup_s": ...}``
once the engine is up, then answers each JSON line
``{"prompts": [...], "max_tokens": n, "params": [kv_transfer_params or null, ...]}``
with one JSON line listing, per prompt: token ids, text, ``num_cached_tokens``
and the returned ``kv_transfer_params``. EOF on stdin ends it.

The engine runs in this process (no separate engine or worker process: it
starts faster) except for prefill, whose engine must keep stepping on its
own after a request finished, to hear that decode pulled its blocks.
"""

from __future__ import annotations

import json
import os
import sys
import time

MARK = "@@answer "  # answers are the lines starting with this; anything else on stdout is noise


def answer(doc: object) -> None:
    print(MARK + json.dumps(doc), flush=True)


if __name__ == "__main__":
    role, model = sys.argv[1], sys.argv[2]
    settings = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    if role != "prefill":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout carries the answers
    os.environ.update(settings.pop("env", {}))
    started = time.monotonic()
    from vllm import LLM, SamplingParams

    tp = int(settings.pop("tp", 1))
    block_size = int(settings.pop("block_size", 32))
    kwargs = {}
    if role != "reference":
        kwargs["kv_transfer_config"] = {
            "kv_load_failure_policy": settings.pop("kv_load_failure_policy", "fail"),
            "kv_connector": settings.pop("connector", "HixlConnector"),
            "kv_connector_module_path": settings.pop("module", "hixl.vllm"),
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": settings,
        }
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        block_size=block_size,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        enable_prefix_caching=False,  # so num_cached_tokens counts only what the connector loaded
        distributed_executor_backend="uni" if tp == 1 else "mp",
        **kwargs,
    )
    answer({"ready": True, "startup_s": time.monotonic() - started})
    for line in sys.stdin:
        order = json.loads(line)
        params = order.get("params") or [None] * len(order["prompts"])
        sampling = [
            SamplingParams(
                temperature=0,
                max_tokens=order["max_tokens"],
                ignore_eos=True,
                extra_args={"kv_transfer_params": p} if p else None,
            )
            for p in params
        ]
        outputs = llm.generate(order["prompts"], sampling, use_tqdm=False)
        answer(
            [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "text": o.outputs[0].text,
                    "prompt_tokens": len(o.prompt_token_ids or ()),
                    "num_cached_tokens": o.num_cached_tokens,
                    "kv_transfer_params": o.kv_transfer_params,
                }
                for o in outputs
            ]
        )
