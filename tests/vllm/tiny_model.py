"""The tests' model: :mod:`hixl.testing.tiny_llama` (there because ``hixl bench --scenario vllm`` serves it too)."""

from hixl.testing.tiny_llama import BLOCK_SIZE, build, words

__all__ = ["BLOCK_SIZE", "build", "words"]
