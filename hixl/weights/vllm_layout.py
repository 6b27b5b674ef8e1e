"""Which bytes of each published (Hugging Face named) tensor a vLLM tensor-parallel rank needs.

vLLM's weight loaders take each checkpoint tensor whole and cut the rank's part out
of it (``loaded_weight.narrow(dim, start, size)``), fusing some on the way:
``q/k/v_proj`` into ``qkv_proj``, ``gate/up_proj`` into ``gate_up_proj``. To read
only that part, this module states, per layer class, the same cut the loader makes —
from the layer's own attributes (its ``tp_rank``, heads per rank, ``output_sizes``,
vocabulary shard) and each parameter's ``output_dim`` / ``input_dim``, as vLLM
recorded them when it created the parameters — so a rank's read is its shard and
nothing more. The cut is the only thing derived here: the bytes read still go
through vLLM's own loaders (see :mod:`hixl.weights.vllm_worker`), so where they land
inside fused or padded parameters, and any repacking after loading, is vLLM's.

The rules, by layer class (checked in this order; tests/weights/test_vllm.py proves
them byte for byte against vLLM's loaders at TP 1 and TP 2):

=============================  ==========================================================
``QKVParallelLinear``          q: rows ``tp_rank·q`` .. +q (q = heads per rank · head size);
                               k, v: rows ``(tp_rank // kv_replicas)·kv`` .. +kv
                               (KV heads replicated when tp > KV heads)
``MergedColumnParallelLinear`` part i: rows ``tp_rank·s_i`` .. +s_i, s_i = output_sizes[i] / tp
``ColumnParallelLinear``       ``output_dim``: ``tp_rank·n`` .. +n (n: the rank's size)
``RowParallelLinear``          ``input_dim``: ``tp_rank·n`` .. +n; its bias whole
``VocabParallelEmbedding``     rows ``org_vocab_start_index`` .. ``org_vocab_end_index``
(``ParallelLMHead`` too)       (the padding vLLM adds is not published: the loader zeroes it)
anything else                  the whole tensor (norms: replicated on every rank)
=============================  ==========================================================

Quantized or packed parameters (``packed_dim``) are refused: their cut is not one slice.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .._exceptions import ParamInvalid

__all__ = ["Cut", "checkpoint_params", "cuts_of", "share_nbytes"]


@dataclass(frozen=True)
class Cut:
    """The part of one published tensor a rank needs: ``tensor[index]`` along ``dim`` (None: all of it)."""

    dim: int | None
    start: int = 0
    size: int = 0

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The numpy basic index of the part, for a tensor of ``ndim`` dimensions."""
        if self.dim is None:
            return ()
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.size),)


def _meta_params(layer: Any) -> Mapping[str, Any]:
    """The layer's parameters as vLLM created them, before any repacking (vLLM keeps them, on the
    meta device, to reload weights in place; on CPU a linear layer's live weight is emptied after
    its GEMM is prepared, so the live parameter says nothing of its layout)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params, _ = get_layerwise_info(layer).restore_metadata
    return params if params else dict(layer.named_parameters(recurse=False))


def _cut(layer: Any, param: Any, shard_id: Any) -> Cut:
    """The rule table of the module docstring, for one parameter of ``layer`` and one checkpoint tensor."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    if getattr(param, "packed_dim", None) is not None:
        raise ParamInvalid(f"{type(layer).__name__}: packed (quantized) parameters are not supported")
    output_dim, input_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
    if isinstance(layer, QKVParallelLinear) and output_dim is not None:
        if shard_id == "q":
            size, rank = layer.num_heads * layer.head_size, layer.tp_rank
        elif shard_id in ("k", "v"):
            head = layer.head_size if shard_id == "k" else layer.v_head_size
            size, rank = layer.num_kv_heads * head, layer.tp_rank // layer.num_kv_head_replicas
        else:
            raise ParamInvalid(f"QKVParallelLinear has no part {shard_id!r}")
        return Cut(output_dim, rank * size, size)
    if isinstance(layer, MergedColumnParallelLinear) and output_dim is not None:
        size = layer.output_sizes[shard_id] // layer.tp_size
        return Cut(output_dim, layer.tp_rank * size, size)
    if shard_id is not None:
        raise ParamInvalid(f"{type(layer).__name__} is not a fused layer this module knows")
    if isinstance(layer, ColumnParallelLinear) and output_dim is not None:
        size = param.shape[output_dim]
        return Cut(output_dim, layer.tp_rank * size, size)
    if isinstance(layer, RowParallelLinear) and input_dim is not None:
        size = param.shape[input_dim]
        return Cut(input_dim, layer.tp_rank * size, size)
    if isinstance(layer, VocabParallelEmbedding) and output_dim is not None:
        shard = layer.shard_indices
        return Cut(output_dim, shard.org_vocab_start_index, shard.org_vocab_end_index - shard.org_vocab_start_index)
    return Cut(None)


def checkpoint_params(model: Any) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(checkpoint name, layer, parameter as created, part)`` for each checkpoint tensor ``model``
    (a vLLM model) loads; ``part`` is the fused module's part it fills (``"q"``, ``"k"``, ``"v"``
    or 0, 1, ...), None for an unfused one.

    Checkpoint names are vLLM's parameter names with each fused module's parts spelt out
    (the model's ``packed_modules_mapping``: ``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``).
    """
    from vllm.model_executor.layers.linear import QKVParallelLinear

    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    for module_name, layer in model.named_modules():
        prefix, _, last = module_name.rpartition(".")
        parts = packed.get(last)
        for param_name, param in _meta_params(layer).items():
            if parts is None:
                yield f"{module_name}.{param_name}", layer, param, None
                continue
            for i, part in enumerate(parts):
                name = f"{prefix}.{part}.{param_name}" if prefix else f"{part}.{param_name}"
                yield name, layer, param, ("qkv"[i] if isinstance(layer, QKVParallelLinear) else i)


def cuts_of(model: Any) -> dict[str, Cut]:
    """Each checkpoint tensor's name (see :func:`checkpoint_params`) -> the :class:`Cut` this rank needs."""
    return {name: _cut(layer, param, part) for name, layer, param, part in checkpoint_params(model)}


def share_nbytes(model: Any) -> int:
    """The bytes of this rank's parameters as vLLM created them (padding included): its share."""
    total = 0
    for _, layer in model.named_modules():
        for param in _meta_params(layer).values():
            total += param.numel() * param.element_size()
    return total
