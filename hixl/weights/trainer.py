"""The trainer's side of RL weight switching: publish a torch module's parameters in one call."""

from __future__ import annotations

from typing import Any

from .publisher import Publisher

__all__ = ["publish_module"]


def publish_module(publisher: Publisher, module: Any) -> int:
    """Publish ``module.named_parameters()`` (a torch module on the CPU) as the next version; return it.

    The names are the module's own: a Hugging Face model's are the checkpoint names vLLM loads
    (``model.layers.0.self_attn.q_proj.weight``, ...). Parameters are published detached, in
    their dtype: publish in the dtype the server computes in (``model.float()`` for a float32 vLLM).
    """
    return publisher.publish({name: param.detach() for name, param in module.named_parameters()})
