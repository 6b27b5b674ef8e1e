"""``hixl bench --scenario vllm``: 1P1D vLLM serving through ``hixl proxy``, with hixl's connector and with NIXL's.

For each connector, fresh servers: a prefill and a decode vLLM OpenAI server
(vLLM's ``api_server`` module, as the README runs it), each pinned to its own
half of this process's CPUs, and ``hixl proxy`` in front — the proxy speaks
vLLM's ``kv_transfer_params`` protocol, which NIXL's connector shares. One
warm-up request (it pays for the first link or handshake), then
``vllm_requests`` streamed completions through the proxy, one at a time, the
same for both connectors: a prompt of ``vllm_prompt_tokens`` token ids (no
tokenizer involved, so any model takes them) and ``vllm_max_tokens``
generated tokens (``ignore_eos``). Per request:

* **KV transfer** — read from decode's own ``/metrics``: how much the
  connector's transfer-time histogram's sum grew over the request,
  ``vllm:hixl_pull_seconds`` (from issuing the pull to its last layer
  landing) or ``vllm:nixl_xfer_time_seconds`` (NIXL's telemetry, from posting
  the transfer to its completion);
* **time to first token** — from sending the request to the proxy to its
  first streamed token;
* **decode throughput** — the tokens after the first over the time from it to the stream's end.

``--transport cma`` (or ``tcp``, or both) forces the hixl connector's
transport (one deployment each); by default it picks its own (``auto``).
Rows: the median of each (and the transfer's p90) per connector; hixl's rows
have NIXL's as their baseline (ratio hixl / NIXL). No targets: on a shared CPU
machine these figures are indications. NIXL is optional (the ``nixl`` extra):
without it the scenario measures hixl alone and says so in a note. Needs vLLM
(the ``vllm`` extra). The model: ``vllm_model`` in ``BenchConfig.extra``
(``--model``), else the tests' tiny Llama, built in a temporary folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from .config import BenchConfig
from .progress import Progress
from .results import Row, ScenarioResult, median, percentile

__all__ = ["AUTO", "CONNECTORS", "SERVER_FLAGS", "Connector", "contenders", "describe", "knobs", "nixl_missing", "run"]

MAX_MODEL_LEN = 1024
#: Every server's sizing: the README's (a small machine, a model up to Qwen3-0.6B at 1024 tokens).
SERVER_FLAGS = (
    "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "32", "--kv-cache-memory-bytes", "256M",
    "--enforce-eager", "--distributed-executor-backend", "uni",
)  # fmt: skip
AUTO = ("auto",)  # the scenario's default "transport": the hixl connector's own choice
STARTUP_TIMEOUT = 600.0  # seconds for both servers to load a model and answer /health
REQUEST_TIMEOUT = 300.0
DEFAULTS = {"vllm_requests": 10, "vllm_prompt_tokens": 256, "vllm_max_tokens": 32}
QUICK = {"vllm_requests": 2, "vllm_prompt_tokens": 64, "vllm_max_tokens": 8}
_TOKEN_IDS = range(16, 496)  # ids every vocabulary of 512 or more has, clear of the usual special tokens


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
        {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backends": ["UCX"]}},
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

    ValueError if a request would not fit the servers' ``--max-model-len``."""
    base = QUICK if config.quick else DEFAULTS
    chosen = {key: given if isinstance(given := config.extra.get(key), int) else value for key, value in base.items()}
    length = chosen["vllm_prompt_tokens"] + chosen["vllm_max_tokens"]
    if length > MAX_MODEL_LEN:
        raise ValueError(
            f"vllm: {chosen['vllm_prompt_tokens']} prompt + {chosen['vllm_max_tokens']} generated tokens "
            f"exceed the servers' --max-model-len {MAX_MODEL_LEN}"
        )
    return chosen


def describe(config: BenchConfig) -> str:
    """A few words for the run's header line."""
    chosen = knobs(config)
    model = config.extra.get("vllm_model") or "the tiny test Llama"
    return (
        f"vllm 1P1D on {model}: {chosen['vllm_requests']} requests of {chosen['vllm_prompt_tokens']} prompt "
        f"+ {chosen['vllm_max_tokens']} generated tokens"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_halves() -> tuple[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND for prefill and decode: two servers must not share a core."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return str(cpus[0]), str(cpus[0])
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


class Deployment:
    """Prefill, decode and the proxy for one connector, each in its own process group; logs in ``folder``."""

    def __init__(self, connector: Connector, model: str, folder: Path) -> None:
        self.connector, self.folder = connector, folder
        self.ports = {name: _free_port() for name in ("prefill", "decode", "proxy")}
        binds = dict(zip(("prefill", "decode"), _cpu_halves()))
        commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        for name in ("prefill", "decode"):
            env = {"VLLM_CPU_OMP_THREADS_BIND": binds[name]}
            if connector.side_channel:
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(self.ports[name])]
            commands[name] = ([*cmd, *SERVER_FLAGS, "--kv-transfer-config", connector.transfer_config(name == "prefill")], env)
        proxy = [sys.executable, "-m", "hixl.cli", "proxy", "--prefill", self.url("prefill"), "--decode", self.url("decode")]
        commands["proxy"] = ([*proxy, "--port", str(self.ports["proxy"])], {})
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
        """The base URL of ``prefill``, ``decode`` or ``proxy``."""
        return f"http://127.0.0.1:{self.ports[name]}"

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of a process's log."""
        return (self.folder / f"{name}.log").read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Until each answers ``GET /health`` (the proxy's: both servers up); RuntimeError if one exits or time runs out."""
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            while not _healthy(self.url(name)):
                if proc.poll() is not None:
                    raise RuntimeError(f"{self.connector.name} {name} exited ({proc.returncode}):\n{self.log_tail(name)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.connector.name} {name} not ready after {timeout:.0f} s:\n{self.log_tail(name)}")
                time.sleep(1)

    def close(self) -> None:
        """SIGTERM each process group, SIGKILL what is left after 30 s."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for log in self._logs:
            log.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def histogram_sum(url: str, metric: str) -> tuple[float, float]:
    """(sum, count) of histogram ``metric`` on ``url``'s ``/metrics``, over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families  # comes with vLLM

    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    totals = {"_sum": 0.0, "_count": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            suffix = sample.name[len(metric) :]
            if sample.name.startswith(metric) and suffix in totals:
                totals[suffix] += sample.value
    return totals["_sum"], totals["_count"]


@dataclass(frozen=True)
class Sample:
    """One request's figures, seconds and tokens/s."""

    transfer: float
    ttft: float
    decode_rate: float


def one_request(deployment: Deployment, model: str, prompt: list[int], max_tokens: int) -> Sample:
    """A streamed completion through the proxy; its KV transfer time from decode's histogram."""
    metric, decode = deployment.connector.metric, deployment.url("decode")
    before, seen = histogram_sum(decode, metric)
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
        raise RuntimeError(f"{deployment.connector.name}: the proxy's stream had {tokens} tokens")
    # The stats reach /metrics with the step's output, by the first token; allow for a slow scrape.
    deadline = time.monotonic() + 10
    while (figures := histogram_sum(decode, metric))[1] <= seen:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{deployment.connector.name}: decode's {metric} counted no transfer for the request")
        time.sleep(0.1)
    return Sample(figures[0] - before, first - start, (tokens - 1) / (end - first))


def _measure(
    connector: Connector, model: str, folder: Path, knobs: dict[str, int], repeat_warmup: int, progress: Progress
) -> list[Sample]:
    prompts = [
        [_TOKEN_IDS[(7 * i + 13 * r) % len(_TOKEN_IDS)] for i in range(knobs["vllm_prompt_tokens"])]
        for r in range(repeat_warmup + knobs["vllm_requests"])
    ]  # a different prompt each time: no prefix-cache hits
    folder.mkdir()
    with progress.step(f"vllm {connector.name}: start prefill, decode, proxy"):
        deployment = Deployment(connector, model, folder)
    try:
        with progress.step(f"vllm {connector.name}: wait for /health"):
            deployment.wait_ready()
        with progress.step(f"vllm {connector.name}: {knobs['vllm_requests']} requests"):
            samples = [one_request(deployment, model, prompt, knobs["vllm_max_tokens"]) for prompt in prompts]
    finally:
        deployment.close()
    return samples[repeat_warmup:]


def _figures(samples: list[Sample]) -> dict[str, tuple[float, str]]:
    transfers = [s.transfer for s in samples]
    return {
        "KV transfer, median": (median(transfers) * 1e3, "ms"),
        "KV transfer, p90": (percentile(transfers, 90) * 1e3, "ms"),
        "time to first token, median": (median([s.ttft for s in samples]) * 1e3, "ms"),
        "decode throughput, median": (median([s.decode_rate for s in samples]), "tok/s"),
    }


def _rows(results: dict[str, list[Sample]]) -> list[Row]:
    """Each connector's figures; NIXL's are the baseline of the others'."""
    figures = {name: _figures(samples) for name, samples in results.items()}
    nixl = figures.get("nixl", {})
    return [
        Row(
            label, name, "1P1D", None, value, unit,
            baseline=nixl[label][0] if name != "nixl" and label in nixl else None,
            baseline_name="nixl" if name != "nixl" and label in nixl else "",
            scenario="vllm", note=f"{len(results[name])} requests",
        )
        for name, rows in figures.items()
        for label, (value, unit) in rows.items()
    ]  # fmt: skip


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
    """Measure each connector available here; rows per connector, hixl's against NIXL's."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("the vllm scenario needs vLLM: pip install 'hixl[vllm]' (see the README)")
    chosen = knobs(config)
    connectors, notes = contenders(config)
    progress.expect(3 * len(connectors) + 1)
    results: dict[str, list[Sample]] = {}
    with tempfile.TemporaryDirectory(prefix="hixl-bench-vllm-") as tmp:
        with progress.step("vllm: the model"):
            model = str(config.extra.get("vllm_model") or _tiny_model(Path(tmp) / "model"))
        for connector in connectors:
            results[connector.name] = _measure(connector, model, Path(tmp) / connector.name, chosen, config.warmup, progress)
    notes += [f"vllm: {c.name}'s KV transfer is decode's {c.metric}: {c.measures}" for c in connectors]
    notes.append("vllm: servers on a shared CPU machine: indicative figures, no targets")
    return ScenarioResult(_rows(results), notes)


def _tiny_model(path: Path) -> Path:
    from ..testing.tiny_llama import build

    return build(path)
