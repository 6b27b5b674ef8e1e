"""The proxy's aiohttp application: two upstream hops per request, the second one streamed through.

Several prefill or decode URLs are used in turn (round robin). An upstream
that answers with an error has that answer passed to the client unchanged;
one that cannot be reached gives a 502 in OpenAI's error shape.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

__all__ = ["create_app"]

log = logging.getLogger("hixl.proxy")

#: What prefill is asked to do with a request: compute the prompt's KV, keep it for decode.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
_SESSION: web.AppKey[ClientSession] = web.AppKey("session", ClientSession)


def create_app(prefill: Sequence[str], decode: Sequence[str], timeout: float = 600.0) -> web.Application:
    """The proxy for these prefill and decode base URLs (e.g. ``http://127.0.0.1:8100``)."""
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode URL")
    prefills, decodes = _cycle(prefill), _cycle(decode)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        # No total limit for the decode hop: a long generation streams for as long as it takes.
        app[_SESSION] = ClientSession(timeout=ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout))
        yield
        await app[_SESSION].close()

    async def disaggregated(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        session, headers = request.app[_SESSION], _forwarded(request)
        try:
            async with session.post(next(prefills) + request.path, json=_prefill_body(body), headers=headers) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    return web.Response(body=payload, status=resp.status, content_type=resp.content_type)
                kv_params = json.loads(payload).get("kv_transfer_params")
            if kv_params is None:
                log.warning("prefill returned no kv_transfer_params: decode computes the prompt itself")
            async with session.post(
                next(decodes) + request.path, json={**body, "kv_transfer_params": kv_params}, headers=headers
            ) as resp:
                if not body.get("stream") or resp.status != 200:
                    return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)
                out = web.StreamResponse(status=200, headers={"Content-Type": resp.headers.get("Content-Type", "text/event-stream")})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (ClientError, TimeoutError) as exc:
            log.warning("upstream failed: %r", exc)
            return _error(502, f"upstream failed: {exc!r}")

    async def models(request: web.Request) -> web.StreamResponse:
        try:
            async with request.app[_SESSION].get(next(decodes) + "/v1/models", headers=_forwarded(request)) as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)
        except (ClientError, TimeoutError) as exc:
            return _error(502, f"upstream failed: {exc!r}")

    async def health(request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", disaggregated)
    app.router.add_post("/v1/chat/completions", disaggregated)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as prefill gets it: one token, not streamed, KV kept for decode."""
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    out.pop("stream_options", None)  # only valid with stream=True
    if "max_completion_tokens" in out:  # the chat API's newer name for max_tokens
        out["max_completion_tokens"] = 1
    return out


def _cycle(urls: Sequence[str]) -> Iterator[str]:
    return itertools.cycle([u.rstrip("/") for u in urls])


def _forwarded(request: web.Request) -> dict[str, str]:
    return {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "proxy_error", "code": status}}, status=status)
