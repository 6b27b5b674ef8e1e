"""The caller's side of a weight update of a running vLLM: :func:`update_weights`, :func:`served_version`.

The target is an offline ``vllm.LLM`` or the URL of a server started with
``VLLM_SERVER_DEV_MODE=1`` (its ``/collective_rpc``, ``/update_weight_version`` and
``/reset_prefix_cache``); either must run the :class:`~hixl.weights.vllm_worker.WeightsExtension`.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from typing import Any

from .._exceptions import HixlTimeout, ParamInvalid
from ._errors import UpdateFailed

__all__ = ["served_version", "update_weights"]

_SLACK = 30.0
"""Seconds a collective_rpc may take beyond the pull's own timeout (waiting for the engine step to end)."""


class _Offline:
    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def rpc(self, method: str, request: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc(method, timeout=timeout, args=(json.dumps(request),)))

    def label(self, version: int) -> None:
        self.llm.llm_engine.set_weight_version(str(version))

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class _Http:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> Any:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            data = answer.read()
        return json.loads(data) if data else None

    def rpc(self, method: str, request: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        doc = self._post("/collective_rpc", {"method": method, "args": [json.dumps(request)], "timeout": timeout}, timeout + _SLACK)
        return list(doc["results"])

    def label(self, version: int) -> None:
        self._post("/update_weight_version", {"new_version": str(version)}, _SLACK)

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache", {}, _SLACK)


def _target(llm_or_url: Any) -> _Offline | _Http:
    if isinstance(llm_or_url, str):
        if not llm_or_url.startswith(("http://", "https://")):
            raise ParamInvalid(f"a server is named by its URL (http://host:port), not {llm_or_url!r}")
        return _Http(llm_or_url)
    if not hasattr(llm_or_url, "collective_rpc"):
        raise ParamInvalid(f"expected a vllm.LLM or a server's URL, got {type(llm_or_url).__name__}")
    return _Offline(llm_or_url)


def _pull(target: _Offline | _Http, request: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Phase 1 on every rank; :class:`UpdateFailed` (no rank applies anything) if any rank failed.

    The request carries the caller's clock (``now``) and the end of this update's hold: every rank
    then decides from the same numbers (see :mod:`hixl.weights.vllm_worker`). The hold lasts the
    pull's ``timeout`` and as long again for the other ranks' pulls and the apply.
    """
    now = time.time()
    request = dict(request, now=now, hold_until=now + 2 * timeout)
    try:
        results = target.rpc("hixl_weights_pull", request, timeout + _SLACK)
    except TimeoutError as exc:
        raise HixlTimeout(f"vLLM did not answer the pull within {timeout + _SLACK} s") from exc
    errors = {int(r["rank"]): r["error"] for r in results if r["error"] is not None}
    if errors:  # ranks that did pull hold this update: let the next one in at once
        target.rpc("hixl_weights_release", {"ticket": request["ticket"]}, _SLACK)
        raise UpdateFailed(f"{len(errors)} of {len(results)} rank(s) could not pull: {errors}", errors)
    return results


def update_weights(llm_or_url: Any, publisher_address: str, version: int | None = None, timeout: float = 60.0) -> int:
    """Make a running vLLM serve ``version`` (None: the newest) of the weights ``publisher_address``
    publishes; return the version it serves now.

    ``llm_or_url``: an offline ``vllm.LLM`` or a dev-mode server's URL, started with the
    ``hixl.weights.vllm_worker.WeightsExtension`` worker extension. Every rank first pulls its
    part into staging buffers (``timeout`` seconds); only if all of them hold the same version
    does each load it, between two engine steps. Then vLLM's weight-version label is set to the
    version and the prefix cache (KV computed with the old weights) is dropped.

    Raises :class:`~hixl.weights.UpdateFailed` if a rank could not pull — among other reasons
    because another update pulled first and has not applied yet (its hold lasts twice its
    timeout): no rank applied anything, the old weights still serve. Also raised, with
    ``broken`` naming the ranks, if vLLM's own reload raised on some rank: those ranks cannot
    serve (see :func:`served_version`), the others serve the new version.
    """
    if not timeout > 0:
        raise ParamInvalid(f"timeout must be a positive number of seconds, not {timeout!r}")
    target = _target(llm_or_url)
    ticket = secrets.token_hex(8)
    request = {"address": publisher_address, "version": version, "timeout": timeout, "ticket": ticket}
    results = _pull(target, request, timeout)
    versions = {int(r["version"]) for r in results}
    if len(versions) > 1:  # "the newest" moved between ranks' pulls: stage the newest on all of them
        results = _pull(target, dict(request, version=max(versions)), timeout)
        versions = {int(r["version"]) for r in results}
    (staged,) = versions
    applied = target.rpc("hixl_weights_apply", {"ticket": ticket, "version": staged}, _SLACK)
    errors = {int(r["rank"]): r["error"] for r in applied if r["error"] is not None}
    broken = sorted(int(r["rank"]) for r in applied if r.get("broken"))
    if errors and not broken:  # every rank refused alike: this update's hold ended and another took over
        raise UpdateFailed(f"no rank applied version {staged} (another update pulled after this one's hold ended): {errors}", errors)
    if errors:
        loaded = sorted(int(r["rank"]) for r in applied if r["error"] is None)
        raise UpdateFailed(
            f"vLLM's reload of version {staged} raised on rank(s) {sorted(errors)}: rank(s) {broken} are broken"
            f" (cannot serve: restart vLLM), rank(s) {loaded} serve version {staged}: {errors}",
            errors,
            broken=broken,
        )
    target.label(staged)
    target.reset_prefix_cache()
    return staged


def served_version(llm_or_url: Any) -> int:
    """The version every rank of the vLLM serves (0: the weights it started with).

    Raises :class:`~hixl.weights.UpdateFailed` (``broken``: those ranks) if a rank is broken —
    vLLM's reload raised on it half-way — or if the ranks disagree.
    """
    results = _target(llm_or_url).rpc("hixl_weights_state", {}, _SLACK)
    broken = {int(r["rank"]): r["broken"] for r in results if r.get("broken")}
    if broken:
        raise UpdateFailed(f"rank(s) {sorted(broken)} cannot serve (restart vLLM): {broken}", broken, broken=sorted(broken))
    versions = {int(r["version"]) for r in results}
    if len(versions) != 1:
        raise UpdateFailed(f"the ranks serve different versions: {sorted(versions)}")
    return versions.pop()
