"""``hixl bench --scenario prefix``: ``hixl proxy``'s prefix-aware routing against its least-loaded routing.

The workload is chats: ``prefix_chats`` conversations, each opening with one of
``prefix_systems`` system prompts, ``prefix_turns`` turns each. A turn's prompt
is the chat's system prompt, the chat so far (each earlier turn's user message
and reply, ``prefix_turn_tokens`` tokens a turn) and its new user message (half
a turn). The system prompt is as long as a turn's tokens times half the turns,
so that over the run half the prompt tokens are a prefix shared between chats
(and much of the rest, each chat's history, is shared between its own turns).
Each turn's chats come in a shuffled order (the same every run): in a fixed order,
taking turns between two prefills would keep each chat on one of them by chance.
Prompts are token ids (any model takes them); the replies are fixed tokens, not
what the model generates, so that every run sends the same requests, in the
same order: turn 1 of every chat, then turn 2, ..., one at a time, each a
streamed completion of ``vllm_max_tokens`` tokens, after the run's warm-up
requests (as many per prefill as ``--scenario vllm`` sends, with prompts of their own).

For each routing policy, fresh servers (so both start with empty caches): two
prefills and one decode (``2p1d``, hixl's connector, as ``--scenario vllm``
runs them), every prefill publishing its KV-cache events (on ipc sockets in
the run's temp folder), and the proxy in front — following them (``prefix``:
``--kv-events`` for both prefills) or not (``load``: least outstanding
requests, which for one request at a time is taking turns). Per policy:

* **prefill tokens computed** — the prompt tokens the prefills did not find
  in their prefix caches: the growth of ``vllm:prefix_cache_queries`` minus that
  of ``vllm:prefix_cache_hits``, over both prefills' ``/metrics``;
* **prefix-cache hit rate** — hits over queries, the same counters;
* **time to first token** — from sending the request to the proxy to its first
  streamed token (the median and p90).

``prefix``'s rows have ``load``'s as their baseline; its prefill tokens
computed have a target: at most 0.6 of ``load``'s (at least 40 % fewer). The
model: ``vllm_model`` (``--model``), else the tests' tiny Llama. Needs vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .config import BenchConfig
from .progress import Progress
from .results import Row, ScenarioResult, Target, median, percentile
from .vllm_bench import _TOKEN_IDS, CONNECTORS, MAX_MODEL_LEN, SHAPES, Deployment, _tiny_model, first_token, scrape

__all__ = ["POLICIES", "describe", "knobs", "run", "workload"]

DEFAULTS = {"prefix_systems": 4, "prefix_chats": 16, "prefix_turns": 6, "prefix_turn_tokens": 64, "vllm_max_tokens": 8}
# Quick: a system prompt of one block, each seen 4 times. With 2 of them over 4 chats, load routing's taking
# turns could keep each on one prefill by chance and tie prefix routing (it did, once, in CI).
QUICK = {"prefix_systems": 4, "prefix_chats": 8, "prefix_turns": 2, "prefix_turn_tokens": 32, "vllm_max_tokens": 4}
POLICIES = ("load", "prefix")  # the baseline first
SHAPE = SHAPES["2p1d"]
CACHE = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
TARGET = Target("<=", 0.6)  # prefix routing computes at least 40 % fewer prefill tokens
LIVE_TIMEOUT = 120.0  # seconds for the proxy to follow both prefills' events once everything answers /health


def knobs(config: BenchConfig) -> dict[str, int]:
    """The workload's sizes: ``extra``'s ``prefix_*`` and ``vllm_max_tokens``, else the defaults (``--quick``'s)."""
    base = QUICK if config.quick else DEFAULTS
    return {key: given if isinstance(given := config.extra.get(key), int) else value for key, value in base.items()}


def describe(config: BenchConfig) -> str:
    """A few words for the run's header line."""
    k = knobs(config)
    return (
        f"prefix {SHAPE.label}: {k['prefix_chats']} chats x {k['prefix_turns']} turns over {k['prefix_systems']} system prompts, "
        f"routed by load and by prefix"
    )


def workload(sizes: dict[str, int]) -> list[list[int]]:
    """Every request's prompt (token ids), in the order sent (see the module docstring)."""
    turn, turns = sizes["prefix_turn_tokens"], sizes["prefix_turns"]
    systems = [_tokens(f"system {s}", turn * turns // 2) for s in range(sizes["prefix_systems"])]
    chats = [list(systems[c % len(systems)]) for c in range(sizes["prefix_chats"])]
    prompts = []
    order = random.Random("order")
    for t in range(turns):
        for c in order.sample(range(len(chats)), len(chats)):
            chat = chats[c]
            user, reply = _tokens(f"user {c} {t}", turn // 2), _tokens(f"reply {c} {t}", turn - turn // 2)
            prompts.append(chat + user)
            chat += user + reply
    return prompts


def _tokens(seed: str, count: int) -> list[int]:
    return random.Random(seed).choices(_TOKEN_IDS, k=count)


@dataclass(frozen=True)
class Figures:
    """One policy's run: prefill tokens computed, prefix-cache hits and queries, each request's TTFT (s)."""

    computed: float
    hits: float
    queries: float
    ttfts: list[float]


def _events_flags(deployment: Deployment, policy: str) -> dict[str, list[str]]:
    """Every prefill publishes its events; the ``prefix`` proxy follows them."""
    flags: dict[str, list[str]] = {"proxy": []}
    for name in deployment.names("prefill"):
        pub, replay = f"ipc://{deployment.folder}/{name}.pub", f"ipc://{deployment.folder}/{name}.replay"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
        flags[name] = ["--kv-events-config", json.dumps(config)]
        if policy == "prefix":
            flags["proxy"] += ["--kv-events", f"{deployment.url(name)}={pub},{replay}"]
    return flags


def _measure(
    policy: str, model: str, folder: Path, prompts: list[list[int]], max_tokens: int, tiny: bool, warmup: int, progress: Progress
) -> Figures:
    folder.mkdir()
    max_len = max(MAX_MODEL_LEN, max(map(len, prompts)) + max_tokens)
    with progress.step(f"prefix {policy}: start prefill0, prefill1, decode0, proxy"):
        deployment = Deployment(
            CONNECTORS["hixl"], SHAPE, model, folder, max_len, tiny, flags=lambda d: _events_flags(d, policy)
        )
    try:
        with progress.step(f"prefix {policy}: wait for /health"):
            deployment.wait_ready()
            if policy == "prefix":
                _wait_following(deployment)
        with progress.step(f"prefix {policy}: {len(prompts)} requests"):
            # Warm-ups first, as many per prefill as asked (each instance pays for its first link), prompts of their own.
            for w in range(warmup * len(SHAPE.prefills)):
                first_token(deployment.url("proxy"), model, _tokens(f"warm-up {w}", len(prompts[0])), max_tokens)
            prefills = deployment.names("prefill")
            before = [scrape(deployment.url(name), CACHE) for name in prefills]
            ttfts = [first_token(deployment.url("proxy"), model, prompt, max_tokens) for prompt in prompts]
            after = [scrape(deployment.url(name), CACHE) for name in prefills]
    finally:
        deployment.close()
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    return Figures(queries - hits, hits, queries, ttfts)


def _wait_following(deployment: Deployment) -> None:
    """Until the proxy follows every prefill's events; RuntimeError after :data:`LIVE_TIMEOUT`."""
    deadline = time.monotonic() + LIVE_TIMEOUT
    while scrape(deployment.url("proxy"), ("hixl_proxy_kv_events_live",))[0] < len(SHAPE.prefills):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy does not follow the prefills' KV events:\n{deployment.log_tail('proxy')}")
        time.sleep(0.5)


def _values(f: Figures) -> dict[str, tuple[float, str]]:
    return {
        "prefill tokens computed": (f.computed, "tok"),
        "prefix-cache hit rate": (100 * f.hits / f.queries if f.queries else 0.0, "%"),
        "time to first token, median": (median(f.ttfts) * 1e3, "ms"),
        "time to first token, p90": (percentile(f.ttfts, 90) * 1e3, "ms"),
    }


def _rows(figures: dict[str, Figures], note: str) -> list[Row]:
    """Each policy's figures; ``load``'s are the others' baseline."""
    base = _values(figures["load"])
    rows = []
    for policy, f in figures.items():
        compared = policy != "load"
        for label, (value, unit) in _values(f).items():
            rows.append(
                Row(
                    label, policy, SHAPE.label, None, value, unit,
                    baseline=base[label][0] if compared else None, baseline_name="load" if compared else "",
                    target=TARGET if compared and label == "prefill tokens computed" else None,
                    scenario="prefix", note=note,
                )
            )  # fmt: skip
    return rows


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Serve the workload routed by load, then by prefix; rows per policy, prefix's against load's."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("the prefix scenario needs vLLM: pip install 'hixl[vllm]' (see the README)")
    sizes = knobs(config)
    prompts = workload(sizes)
    progress.expect(3 * len(POLICIES) + 1)
    with tempfile.TemporaryDirectory(prefix="hixl-bench-prefix-") as tmp:
        tiny = not config.extra.get("vllm_model")
        with progress.step("prefix: the model"):
            model = str(config.extra.get("vllm_model") or _tiny_model(Path(tmp) / "model"))
        figures = {
            policy: _measure(policy, model, Path(tmp) / policy, prompts, sizes["vllm_max_tokens"], tiny, config.warmup, progress)
            for policy in POLICIES
        }
    tokens = sum(map(len, prompts))
    note = f"{len(prompts)} requests, {tokens} prompt tokens"
    system = sizes["prefix_turn_tokens"] * sizes["prefix_turns"] // 2
    notes = [
        f"prefix: {sizes['prefix_chats']} chats x {sizes['prefix_turns']} turns, {sizes['prefix_systems']} system prompts of "
        + f"{system} tokens (half the prompt tokens), one request at a time",
        "prefix: prefill tokens computed = growth of vllm:prefix_cache_queries - vllm:prefix_cache_hits over both prefills",
        "prefix: servers on a shared CPU machine: the TTFT figures are indications",
    ]
    return ScenarioResult(_rows(figures, note), notes)

