"""Bench only: vLLM's NIXL connector, timing each request's load as hixl's timeline does.

``hixl bench --scenario vllm`` loads it with ``kv_connector_module_path``. The
class keeps vLLM's name (``NixlConnector``) so that every check vLLM keys on
that name treats it as NIXL's own. Each request's load, on each decode rank,
is appended to the file :data:`hixl.vllm._timeline.ENV` names as a trace with
``start`` (``start_load_kv`` took the request: its reads are posted) and
``usable`` (the ``get_transfer_results`` — vLLM 0.32's ``get_finished`` — that
reports it received: when vLLM learns its KV is there) — the same ends as hixl's records, so the two compare.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata, NixlPullConnector

from ..vllm._timeline import ENV, Trace, append

__all__ = ["NixlConnector"]


class NixlConnector(NixlPullConnector):
    """vLLM's (pull) NIXL connector, appending a trace per received request to :data:`ENV`'s file."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._path = os.environ.get(ENV) or None
        self._started: dict[str, float] = {}
        self._rank = -1  # learnt on the worker, where vLLM's TP group exists

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Note when each new request's load starts, then post its reads."""
        meta = self._connector_metadata
        if self._path is not None and isinstance(meta, NixlConnectorMetadata):
            started = time.monotonic()
            for req_id in meta.reqs_to_recv:
                self._started.setdefault(req_id, started)
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """NIXL's answer; a trace for each request it reports received (not those it failed)."""
        results = super().get_transfer_results(finished_req_ids)
        recving = results.finished_recving - results.failed_recving
        if self._path is not None and recving:
            usable = time.monotonic()
            if self._rank < 0:
                from vllm.distributed.parallel_state import get_tp_group

                self._rank = get_tp_group().rank_in_group
            for req_id in recving:
                start = self._started.pop(req_id, None)
                if start is not None:
                    append(self._path, asdict(Trace("nixl", req_id, self._rank, start, "nixl", usable=usable)))
        return results
