"""A vLLM worker extension: each worker pulls a published version of the weights, then applies it.

Start vLLM with ``--worker-extension-cls hixl.weights.vllm_worker.WeightsExtension``
(offline: ``LLM(..., worker_extension_cls=...)``); :func:`hixl.weights.update_weights`
then drives these methods through ``collective_rpc``, which vLLM runs in every worker
between two engine steps. An update is two calls, so that no rank applies a version
unless every rank has it:

1. ``hixl_weights_pull``: each rank pulls its part of the version (the
   :mod:`~hixl.weights.vllm_layout` cut of each tensor) into its :class:`Staging`
   buffers — the live weights are not touched, so a failed pull leaves them serving;
2. ``hixl_weights_apply``, only once every rank's pull returned the same version: each
   rank hands the staged tensors to vLLM's own in-place reload (``Worker.reload_weights``,
   which runs the model's loaders — fusing q/k/v and gate/up, zeroing vocabulary padding
   — and repacks for the CPU kernels), then drops nothing: the staging is reused.

Overlapping updates. A pull that succeeds leaves the rank *holding* that update's
ticket until its apply (or until the hold ends: ``hold_until``, set by the caller).
Another update's pull is refused while the hold lasts, so it can neither overwrite
the staged version nor make the holder's apply fail half-way. Every decision a rank
takes here depends only on its state and the request — the caller's clock travels in
the request (``now``) — and vLLM hands every rank the same calls in the same order,
so all ranks decide alike: they hold, refuse and apply the same update.

A rank whose ``reload_weights`` raised is *broken*: vLLM's in-place reload takes
each layer off its weights before loading it and puts it back only once all of its
tensors arrived, so the layers loaded before the error hold the new version and the
one being loaded is left without its weights — the rank cannot compute. It reports
this in :meth:`WeightsExtension.hixl_weights_state` and refuses every later update
(a reload over a half-loaded layer would mix versions): restart vLLM.

Every method takes one JSON string and returns a JSON-able dict — the form the dev-mode
HTTP ``/collective_rpc`` passes — and reports failure in it (``"error"``) rather than
raising, so a failed rank never takes the engine down.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from typing import Any

import hixl

from .._exceptions import ParamInvalid
from .staging import Staging
from .subscriber import Subscriber
from .vllm_layout import cuts_of, share_nbytes

__all__ = ["WeightsExtension"]


class _RankWeights:
    """One worker's state: its engine, its staging per publisher, the version it serves."""

    def __init__(self, local: str) -> None:
        self.engine = hixl.Engine(local)  # client-only: pulls need no listener
        self.staging: Staging | None = None
        self.ticket: str | None = None  # the update whose pull is staged and not yet applied
        self.hold_until = -math.inf  # until when (the callers' clock) that ticket keeps other pulls out
        self.serving = 0  # 0: the weights vLLM loaded at start-up
        self.broken: str | None = None  # why this rank cannot serve: its reload raised half-way

    def admit(self, ticket: str, now: float) -> None:
        """Raise unless an update with ``ticket`` may pull now (the module docstring's rules)."""
        if self.broken is not None:
            raise ParamInvalid(f"this rank is broken ({self.broken}): restart vLLM")
        if self.ticket is not None and self.ticket != ticket and now < self.hold_until:
            staged = self.staging.version if self.staging is not None else None
            raise ParamInvalid(
                f"held by another update: version {staged} is staged for it and not applied yet"
                f" (its hold ends in {self.hold_until - now:.1f} s); retry after it"
            )

    def staging_for(self, model: Any, address: str, timeout: float) -> Staging:
        if self.staging is None or self.staging.subscriber.address != address:
            if self.staging is not None:
                self.staging.close()
                self.staging = None
            self.staging = Staging(Subscriber(self.engine, address, timeout=timeout), cuts_of(model))
        return self.staging


class WeightsExtension:
    """Mixed into each vLLM worker by ``--worker-extension-cls``; called through ``collective_rpc``.

    The methods' argument is a JSON object (a string); :func:`hixl.weights.update_weights` is
    the caller to use.
    """

    def hixl_weights_pull(self, request: str) -> dict[str, Any]:
        """Pull a version into this rank's staging buffers. ``request``: ``address`` (the
        publisher's), ``version`` (null: the newest), ``timeout`` (seconds), ``ticket`` (names
        this update: apply checks it), ``now`` and ``hold_until`` (the caller's clock, seconds: a
        staged update keeps other pulls out until ``hold_until``), ``local`` (the host the worker's
        engine binds; default 127.0.0.1). Refused while another ticket's hold lasts, or if the rank
        is broken. Returns ``rank``, ``version`` (null on failure), ``error``, ``bytes`` (what the
        rank read), ``share`` (its parameters' bytes), ``seconds``."""
        started = time.monotonic()
        doc = json.loads(request)
        state = self._hixl_state(doc.get("local", "127.0.0.1"))
        staging = None
        try:
            state.admit(doc["ticket"], float(doc["now"]))
            state.ticket = None  # admitted: whatever was staged is being overwritten
            staging = state.staging_for(self._hixl_model(), doc["address"], float(doc["timeout"]))
            version = staging.pull(doc.get("version"), float(doc["timeout"]))
            state.ticket, state.hold_until = doc["ticket"], float(doc["hold_until"])
            error = None
        except Exception as exc:  # noqa: BLE001  (reported to the caller, which then applies nothing anywhere)
            version, error = None, f"{type(exc).__name__}: {exc}"
        return {
            "rank": self._hixl_rank(),
            "version": version,
            "error": error,
            "bytes": staging.nbytes if staging is not None else 0,
            "share": share_nbytes(self._hixl_model()),
            "seconds": time.monotonic() - started,
        }

    def hixl_weights_apply(self, request: str) -> dict[str, Any]:
        """Load the staged version into the live weights. ``request``: ``ticket`` and ``version``,
        which must be what :meth:`hixl_weights_pull` staged under that ticket; applying releases
        the hold. Returns ``rank``, ``version`` (null on failure), ``error``, ``broken`` (true if
        vLLM's reload raised: the rank cannot serve, see the module docstring), ``seconds``."""
        started = time.monotonic()
        doc = json.loads(request)
        state = self._hixl_state()
        staging = state.staging
        if staging is None or state.ticket != doc["ticket"] or staging.version != doc["version"]:
            refused = f"version {doc['version']} is not staged under this update: nothing applied"
            return {"rank": self._hixl_rank(), "version": None, "error": refused, "broken": False,
                    "seconds": time.monotonic() - started}
        state.ticket = None
        error: str | None = None
        try:
            self.reload_weights(weights_iterator=staging.tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
            version = doc["version"]
            state.serving = version
        except Exception as exc:  # noqa: BLE001  (reported: the rank is marked broken, never silently mixed)
            version, error = None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            state.broken = f"loading version {doc['version']} over version {state.serving} raised {type(exc).__name__}: {exc}"
        return {"rank": self._hixl_rank(), "version": version, "error": error, "broken": state.broken is not None,
                "seconds": time.monotonic() - started}

    def hixl_weights_release(self, request: str) -> dict[str, Any]:
        """Drop the hold of ``request``'s ``ticket`` if this rank holds it (its caller gave up
        after a failed pull on some rank). Returns ``rank`` and ``released``."""
        state = self._hixl_state()
        released = state.ticket is not None and state.ticket == json.loads(request)["ticket"]
        if released:
            state.ticket = None
        return {"rank": self._hixl_rank(), "released": released}

    def hixl_weights_state(self, request: str = "{}") -> dict[str, Any]:
        """This rank's ``version`` serving (0: the weights loaded at start-up; null if broken),
        ``broken`` (why it cannot serve, or null), ``staged``, ``bytes`` (what a pull reads) and
        ``share`` (its parameters' bytes)."""
        state = self._hixl_state()
        staging = state.staging
        return {
            "rank": self._hixl_rank(),
            "version": state.serving if state.broken is None else None,
            "broken": state.broken,
            "staged": staging.version if staging is not None else None,
            "bytes": staging.nbytes if staging is not None else 0,
            "share": share_nbytes(self._hixl_model()),
        }

    # -- helpers (prefixed: the extension's names must not clash with the worker's) -----------------
    def _hixl_state(self, local: str = "127.0.0.1") -> _RankWeights:
        state: _RankWeights | None = getattr(self, "_hixl_weights", None)
        if state is None:
            state = _RankWeights(local)
            self._hixl_weights = state
        return state

    def _hixl_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _hixl_rank(self) -> int:
        return int(getattr(self, "rank", 0))
