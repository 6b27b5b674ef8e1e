"""A publisher of the seed-1 tiny Llama in a child process, for the tests to stop and kill.

``python -m tests.weights.vllm_publisher DIR`` builds the model in DIR, publishes it once,
prints its engine's address and waits for EOF on stdin.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hixl
from hixl.testing.tiny_llama import build
from hixl.weights import Publisher, publish_module

if __name__ == "__main__":
    from transformers import LlamaForCausalLM

    module = LlamaForCausalLM.from_pretrained(str(build(Path(sys.argv[1]), seed=1))).float()
    with hixl.Engine("127.0.0.1:0") as engine, Publisher(engine) as publisher:
        publish_module(publisher, module)
        print(engine.local_engine, flush=True)
        sys.stdin.read()
