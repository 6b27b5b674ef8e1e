"""Prefix-aware routing: each hop to the instance that has the longest part of the prompt cached, weighed against load.

The proxy follows the KV-cache events of the instances named in ``kv_events``
(one :class:`EventFeed` per instance, in both roles if it serves both) and picks,
among a role's instances that are up (and have not failed the request), the one
with the least **cost**::

    cost = (prompt tokens - tokens of the prompt's prefix it holds) + prefix_load_weight * outstanding requests

— the tokens it would compute, plus a price per request it is serving for this
proxy now; equal costs go to the fewest outstanding, then in turn
(``Pool.pick`` among them). With ``prefix_load_weight`` 0 the longest cached
prefix wins whatever the load; a large one makes it least-loaded routing with
cache hits as the tie-breaker.

A role is routed this way only while **every** candidate's events are live
(:meth:`EventLog.live`): an instance whose events stopped, or whose index is
being rebuilt, might hold the prefix, or might not, and comparing it with the
others would be a guess. Otherwise — and for a request whose prompt's tokens are
unknown — the hop goes to the least loaded (``Pool.pick``), as without
``kv_events``.

The prompt's token ids: a ``prompt`` of token ids is used as it is; a text
``prompt`` or chat ``messages`` is tokenized by an instance's ``/tokenize`` (a
prefill's that is up, the least busy; the request's fields that shape the
tokens go with it: the model, the chat template and its arguments, tools,
special tokens), so the proxy needs no tokenizer, no chat template and no
model files of its own, and gets what the instance will get. It costs one HTTP
round trip per request, bounded by ``tokenize_timeout``; a tokenization that
fails or times out routes that request by load. Only where prefix routing can
apply (some instance's events live) is anything tokenized.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import ClientError, ClientSession, ClientTimeout

from .metrics import Counter, Gauge
from .options import ProxyOptions, unknown_sources
from .upstreams import Pool, Role, Upstream, describe

if TYPE_CHECKING:
    from .event_feed import EventFeed

__all__ = ["PrefixRouter", "Rule"]

log = logging.getLogger("hixl.proxy")

#: The request fields that go to ``/tokenize`` with a chat's messages: what vLLM's chat endpoint renders them with.
CHAT_FIELDS = (
    "model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs",
)  # fmt: skip
#: The same with a text prompt.
TEXT_FIELDS = ("model", "prompt", "add_special_tokens")


class Rule:
    """How a hop's instance was chosen (the ``rule`` label of ``hixl_proxy_routed_total``)."""

    PREFIX = "prefix"
    LOAD = "load"


class _Read(Gauge):
    """A count read from its owner at each scrape."""

    kind = "counter"


class PrefixRouter:
    """The choice of an instance for each hop; ``pools``: each role's pool with its URLs as given.

    ValueError if ``options.kv_events`` names a URL none of the pools has."""

    def __init__(self, options: ProxyOptions, pools: Sequence[tuple[Pool, Sequence[str]]]) -> None:
        urls = [url for _, given in pools for url in given]
        unknown = unknown_sources(options.kv_events, urls)
        if unknown:
            raise ValueError(f"kv_events names no prefill or decode instance: {', '.join(unknown)}")
        self.weight = options.prefix_load_weight
        self._pools = [pool for pool, _ in pools]
        self._tokenize_limit = ClientTimeout(total=options.tokenize_timeout)
        self._feeds: dict[Upstream, EventFeed] = {}  # upstream -> its instance's feed (one per instance, both roles)
        self._tasks: list[asyncio.Task[None]] = []
        self._context: Any = None  # a zmq.asyncio.Context from start() to stop()
        if options.kv_events:
            from .event_feed import EventFeed  # (here: a proxy without kv_events needs no pyzmq)

            feeds = {s.url: EventFeed(f"instance {s.url}", s.endpoint, s.replay, options.events_timeout) for s in options.kv_events}
            for pool, given in pools:
                for up, url in zip(pool.upstreams, given):
                    if url.rstrip("/") in feeds:
                        self._feeds[up] = feeds[url.rstrip("/")]
        self.routed = Counter(
            "hixl_proxy_routed_total",
            "Hops routed by cached prefix (rule=prefix) or by load alone (rule=load).",
            ("role", "rule"),
            [(r.value, rule) for r in Role for rule in (Rule.PREFIX, Rule.LOAD)],
        )
        followed = list(self._feeds.items())
        self.families = [
            self.routed,
            Gauge(
                "hixl_proxy_kv_events_live",
                "1 while an instance's KV events are followed and its index may route requests, 0 otherwise.",
                ("upstream", "role"),
                lambda: [((u.url, u.role.value), float(f.live())) for u, f in followed],
            ),
            Gauge(
                "hixl_proxy_prefix_blocks",
                "Blocks of an instance's prefix cache the proxy's index holds.",
                ("upstream", "role"),
                lambda: [((u.url, u.role.value), float(len(f.log.index))) for u, f in followed],
            ),
            _Read(
                "hixl_proxy_kv_events_resyncs_total",
                "Times an instance's index was dropped and rebuilt: it restarted, or its events could not be followed.",
                ("upstream", "role"),
                lambda: [((u.url, u.role.value), float(f.log.resyncs)) for u, f in followed],
            ),
        ]
        """The router's series for ``/metrics``."""

    async def start(self) -> None:
        """Start following the instances' events."""
        if not self._feeds:
            return
        import zmq.asyncio

        self._context = zmq.asyncio.Context()
        self._tasks = [asyncio.create_task(feed.run(self._context)) for feed in dict.fromkeys(self._feeds.values())]

    async def stop(self) -> None:
        """Stop following them; close their sockets."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # (each closes its sockets as it ends)
        if self._context is not None:
            self._context.term()  # (at once: every socket was closed, without lingering, as its task ended)
            self._context = None

    async def prompt_tokens(
        self, session: ClientSession, body: dict[str, Any], headers: Callable[[Upstream], dict[str, str]]
    ) -> list[int] | None:
        """The prompt's token ids where prefix routing may use them, else None (see the module docstring).

        ``headers``: what to send an instance with the request's tokenization (the client's forwarded ones)."""
        if not any(feed.live() for feed in self._feeds.values()):
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list):  # token ids; a list of several prompts is not routed by prefix
            return prompt if prompt and all(type(t) is int for t in prompt) else None
        if isinstance(prompt, str):
            asked = {k: body[k] for k in TEXT_FIELDS if k in body}
        elif isinstance(body.get("messages"), list):
            asked = {k: body[k] for k in CHAT_FIELDS if k in body}
        else:
            return None
        ups = [u for u in self._pools[0].upstreams if u.up]
        if not ups:
            return None
        up = min(ups, key=lambda u: u.outstanding)
        try:
            async with session.post(up.url + "/tokenize", json=asked, headers=headers(up), auth=up.auth, timeout=self._tokenize_limit) as resp:
                answer = await resp.json() if resp.status == 200 else None
        except (ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("%s could not tokenize a prompt, routed by load: %s", up.name, describe(exc, self._tokenize_limit.total))
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            log.warning("%s answered /tokenize with no tokens (status %d), routed by load", up.name, resp.status)
            return None
        return tokens

    def pick(self, pool: Pool, exclude: Collection[Upstream], tokens: Sequence[int] | None) -> Upstream | None:
        """The instance of ``pool`` for a hop of a prompt of ``tokens`` (None: unknown), not in ``exclude``; None if
        none is up. Lease it before the next ``await`` (as ``Pool.pick``'s)."""
        candidates = [u for u in pool.upstreams if u.up and u not in exclude]
        live = {u: feed for u in candidates if (feed := self._feeds.get(u)) is not None and feed.live()}
        if tokens is None or not candidates or len(live) < len(candidates):
            chosen, rule = pool.pick(exclude), Rule.LOAD
        else:
            costs = {u: len(tokens) - f.log.index.cached_tokens(tokens) + self.weight * u.outstanding for u, f in live.items()}
            best = min(costs.values())
            chosen, rule = pool.pick([u for u in pool.upstreams if costs.get(u) != best]), Rule.PREFIX
        if chosen is not None:
            self.routed.inc(pool.role.value, rule)
        return chosen

    def __repr__(self) -> str:
        return f"<PrefixRouter {list(dict.fromkeys(self._feeds.values()))}>"
