"""The tests' worker extension: hixl's, plus a check run in each worker through ``collective_rpc``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from hixl.weights.vllm_worker import WeightsExtension


class CheckedExtension(WeightsExtension):
    """hixl's extension with :meth:`hixl_test_loaders_agree` (offline instances of the tests use it)."""

    def hixl_test_loaders_agree(self, checkpoint: str) -> dict[str, Any]:
        return loaders_agree(self, checkpoint)

    def hixl_test_fail_reload(self, request: str) -> dict[str, Any]:
        """The fault: on rank ``rank``, the next apply's tensors raise after ``after`` of them were
        loaded — inside vLLM's reload, half-way through the model (needs a staging: update first)."""
        doc = json.loads(request)
        staging = self._hixl_weights.staging
        if self._hixl_rank() == doc["rank"]:
            staging.tensors = _failing(staging, staging.tensors, int(doc["after"]))
        return {"rank": self._hixl_rank()}


def _failing(staging: Any, tensors: Callable[[], Iterator[tuple[str, Any]]], after: int) -> Callable[[], Iterator[tuple[str, Any]]]:
    """``tensors``, once, raising after ``after`` items; then ``staging`` gets its own back."""

    def failing() -> Iterator[tuple[str, Any]]:
        del staging.tensors
        for i, item in enumerate(tensors()):
            if i == after:
                raise RuntimeError(f"injected: the tensor after {after} could not be read")
            yield item

    return failing


def loaders_agree(worker: Any, checkpoint: str) -> dict[str, Any]:
    """Run vLLM's own weight loaders twice into fresh copies of every parameter (as vLLM created
    them: fused, padded, this rank's shard): once with the checkpoint's full tensors, once with
    what hixl staged. Returns the parameters compared, the bytes, and the names that differ."""
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from hixl.weights.vllm_layout import checkpoint_params

    full = load_file(os.path.join(checkpoint, "model.safetensors"))
    staged = dict(worker._hixl_weights.staging.tensors())
    loaded: dict[int, tuple[Any, Any, str]] = {}  # id(param as created) -> (from checkpoint, from hixl, name)
    for name, _layer, param, part in checkpoint_params(worker.model_runner.get_model()):
        if id(param) not in loaded:
            fresh = [materialize_meta_tensor(param), materialize_meta_tensor(param)]
            for t in fresh:
                t.data.fill_(-7.0)  # what neither source would write
            loaded[id(param)] = (fresh[0], fresh[1], name)
        loader = getattr(param, "weight_loader", default_weight_loader)
        for target, source in zip(loaded[id(param)][:2], (full[name], staged[name])):
            loader(target, source) if part is None else loader(target, source, part)
    differ = [n for a, b, n in loaded.values() if not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))]
    nbytes = sum(a.numel() * a.element_size() for a, _, _ in loaded.values())
    return {"params": len(loaded), "bytes": nbytes, "differ": differ}
