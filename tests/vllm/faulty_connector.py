"""A :class:`~hixl.vllm.HixlConnector` that misbehaves on demand, for the negative tests.

The extra config's ``fault_file`` names a file the test writes before each
request; this connector reads it at every layer it waits for:

* ``zeros`` — pull as usual, then zero the pulled blocks of that layer before
  attention reads them: the control that shows the pulled KV matters.
  ``zeros:H`` zeroes only KV head ``H`` (the model's index; only the TP rank
  holding it acts): with TP, the heads one prefill rank sent.
* ``die`` — SIGKILL this whole process while it waits for layer 1 of a
  layer-by-layer pull: a decode dying mid-pull. Its completion notifications
  are dropped first: DataDist may send one the moment the last layer lands,
  which on this machine can be before attention reaches layer 1 — and then
  prefill would rightly free the blocks at once, and the test would show
  nothing.
* ``droplink`` — close this worker's connections to the prefill ranks of the
  step's first pull just before it starts, as a link declared dead does
  (DataDist and the lease keeper still count it up), then clear the file: the
  fault strikes once.
* anything else — behave.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from hixl.vllm import HixlConnector


class FaultyConnector(HixlConnector):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        # The scheduler's and the worker's connectors share this dict: hide the key
        # from HixlConnector (it rejects unknown settings) only while it reads them.
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.fault_file = Path(extra.pop("fault_file"))
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            extra["fault_file"] = str(self.fault_file)
        self.kv_caches: dict[str, Any] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self.kv_caches = kv_caches

    def _fault(self) -> str:
        return self.fault_file.read_text().strip() if self.fault_file.exists() else ""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        fault = self._fault()
        if fault == "die":
            self.worker.datadist.engine.send_notify = lambda *args, **kwargs: None  # type: ignore[method-assign]
        loads = self._get_connector_metadata().loads  # type: ignore[attr-defined]
        if fault == "droplink" and loads:
            for rank in loads[0].remote.ranks:
                self.worker.datadist.engine.disconnect(rank.ip_info)
            self.fault_file.write_text("")
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._fault() == "die" and self.loading_block_ids() and self.worker.layers[layer_name] == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        super().wait_for_layer_load(layer_name)
        blocks, fault = self.loading_block_ids(), self._fault()
        if fault == "zeros" and blocks:
            self.kv_caches[layer_name][blocks] = 0
        elif fault.startswith("zeros:") and blocks:
            head, held = int(fault.removeprefix("zeros:")), self.worker.heads
            if head in held:
                self.kv_caches[layer_name][blocks, head - held.start] = 0
