"""Versioned weights published one-sidedly, and parameter-server row reads.

A :class:`Publisher` publishes versions 1, 2, ... of a set of named tensors from
a listening engine; a :class:`Subscriber` hears of each version by notification
and pulls it — whole, or only the shards a tensor-parallel rank needs
(:class:`Shard`, :class:`BytePlan`) — with one batched READ, and every pull that
returns is bit-identical to exactly one published version (or raises
:class:`Superseded`). A :class:`Relay` re-serves what a subscriber pulled, so a
fleet is fed by a tree. A :class:`Table` is a parameter server's table of rows
that workers gather one-sidedly (:meth:`Subscriber.pull_rows`) while the server
updates them. :func:`publish_module` and :func:`update_weights` switch the weights of a
running vLLM (with the :mod:`~hixl.weights.vllm_worker` extension). See docs/weights.md.
"""

from ._errors import ManifestError, Superseded, TornRows, UpdateFailed
from ._manifest import Manifest, TensorSpec
from ._plan import BytePlan, Shard
from .publisher import Publisher
from .relay import Relay
from .subscriber import Subscriber
from .table import Table
from .trainer import publish_module
from .vllm_update import served_version, update_weights

__all__ = [
    "BytePlan",
    "Manifest",
    "ManifestError",
    "Publisher",
    "Relay",
    "Shard",
    "Subscriber",
    "Superseded",
    "Table",
    "TensorSpec",
    "TornRows",
    "UpdateFailed",
    "publish_module",
    "served_version",
    "update_weights",
]
