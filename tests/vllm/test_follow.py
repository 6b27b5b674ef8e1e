"""Following one request end to end: two ``vllm serve`` servers and ``hixl proxy``, all tracing to an OTLP receiver.

The receiver is this test's own OTLP/HTTP endpoint (an ``http.server`` that
parses ``ExportTraceServiceRequest`` protobufs): the spans it gets are what
vLLM's, the connector's and the proxy's OpenTelemetry SDK exporters sent.
One request with the client's ``X-Request-Id`` must come back with that id,
be logged and recorded (decode's ``records`` file) under it, and have one
trace holding the proxy's request and hop spans and the connector's transfer
spans; a request without the header gets an id the proxy made, recorded alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hixl._tools.groups import stop_groups

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")
pytest.importorskip("aiohttp")
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from hixl.testing.otlp import Receiver  # noqa: E402
from instances import ROOT  # noqa: E402
from readme_serving import free_ports  # noqa: E402
from tiny_model import build, words  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STARTUP_TIMEOUT = 600.0
CLIENT_ID = "follow-me-1"


class Fleet:
    """Prefill and decode ``vllm serve`` (the README's sizing) and ``hixl proxy``, tracing to ``receiver``."""

    def __init__(self, model: Path, logs: Path, receiver: Receiver) -> None:
        self.logs, self.records = logs, logs / "records.jsonl"
        self.ports = dict(zip(("prefill", "decode", "proxy"), free_ports(3)))
        env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf")
        sizing = [
            "--dtype", "float32", "--max-model-len", "1024", "--block-size", "32", "--kv-cache-memory-bytes", "256M",
            "--enforce-eager", "--distributed-executor-backend", "uni", "--otlp-traces-endpoint", receiver.url,
        ]  # fmt: skip
        roles = {"prefill": ("kv_producer", {}, "0"), "decode": ("kv_consumer", {"records": str(self.records)}, "1")}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name, (role, extra, core) in roles.items():
            config = {"kv_connector": "HixlConnector", "kv_connector_module_path": "hixl.vllm", "kv_role": role, "kv_connector_extra_config": extra}
            command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(self.ports[name])]
            self._start(name, [*command, *sizing, "--kv-transfer-config", json.dumps(config)], dict(env, VLLM_CPU_OMP_THREADS_BIND=core))
        proxy = [
            sys.executable, "-m", "hixl.cli", "proxy", "--prefill", self.url("prefill"), "--decode", self.url("decode"),
            "--port", str(self.ports["proxy"]), "--otlp-traces-endpoint", receiver.url,
        ]  # fmt: skip
        self._start("proxy", proxy, env)

    def _start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        with (self.logs / f"{name}.log").open("w") as log:
            self.procs[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for name in ("prefill", "decode", "proxy"):
            while True:
                with contextlib.suppress(OSError), urllib.request.urlopen(self.url(name) + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
                exited = [n for n, p in self.procs.items() if p.poll() is not None]
                assert not exited and time.monotonic() < deadline, f"{exited or name} not up:\n{self.log(name)[-3000:]}"
                time.sleep(1)

    def complete(self, prompt: str, headers: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
        """One completion through the proxy: its answer and its headers."""
        body = {"model": self.model_id(), "prompt": prompt, "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            self.url("proxy") + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            return json.loads(resp.read()), dict(resp.headers)

    def model_id(self) -> str:
        with urllib.request.urlopen(self.url("proxy") + "/v1/models", timeout=30) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])

    def record(self, client_id: str, timeout: float = 10) -> dict[str, Any]:
        """Decode's record of the request the client named ``client_id``."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.records.read_text().splitlines() if self.records.exists() else []
            found = [r for r in map(json.loads, lines) if r["client_id"] == client_id]
            if found:
                (record,) = found
                return record
            assert time.monotonic() < deadline, f"no record of {client_id} in {lines}"
            time.sleep(0.2)

    def close(self) -> None:
        stop_groups(self.procs.values())


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as started:
        yield started


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[Fleet]:
    running = Fleet(build(tmp_path_factory.mktemp("model")), tmp_path_factory.mktemp("follow-logs"), receiver)
    try:
        running.wait_ready()
        yield running
    finally:
        running.close()


def test_one_trace_holds_the_proxys_routing_and_the_connectors_transfers(fleet: Fleet, receiver: Receiver) -> None:
    answer, headers = fleet.complete(words(70, offset=5), {"X-Request-Id": CLIENT_ID})
    assert answer["choices"][0]["text"] and headers["X-Request-Id"] == CLIENT_ID
    assert answer["id"] == f"cmpl-{CLIENT_ID}"  # vLLM named it after the header, as the connector's records do

    record = fleet.record(CLIENT_ID)
    assert record["outcome"] == "ok" and record["request"].startswith(f"cmpl-{CLIENT_ID}-0-") and not record["retried"]
    assert record["nbytes"] > 0 and record["transport"] in ("cma", "shm", "tcp") and len(record["layers"]) == 4
    assert record["start"] <= record["usable"] and "sync_ref" in record and record["sync_ref"] is None  # no reference pull
    assert f"(client request id {CLIENT_ID})" in fleet.log("decode")

    def ours(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
        roots = [s for s in spans if s["name"] == "hixl.proxy.request" and s["attributes"].get("hixl.client_request_id") == CLIENT_ID]
        if not roots:
            return None
        trace = [s for s in spans if s["trace"] == roots[0]["trace"]]
        names = {s["name"]: s for s in trace}
        wanted = {"hixl.proxy.request", "hixl.proxy.prefill", "hixl.proxy.decode", "hixl.kv_load", "hixl.kv_layer"}
        return names if wanted <= set(names) else None

    spans = receiver.wait_for("trace with the proxy's and the connector's spans", ours)
    request, prefill, decode, load = (spans[n] for n in ("hixl.proxy.request", "hixl.proxy.prefill", "hixl.proxy.decode", "hixl.kv_load"))
    assert request["service"] == "hixl.proxy" and load["service"] == "hixl.vllm"
    assert request["parent"] == "" and prefill["parent"] == decode["parent"] == request["id"]
    assert load["parent"] == decode["id"]  # vLLM passed the decode hop's traceparent on to the connector
    assert load["attributes"]["hixl.client_request_id"] == CLIENT_ID and load["attributes"]["hixl.bytes"] == record["nbytes"]
    assert load["attributes"]["hixl.outcome"] == "ok" and decode["start"] <= load["start"] <= load["end"] <= decode["end"]
    layers = [s for s in receiver.spans if s["name"] == "hixl.kv_layer" and s["parent"] == load["id"]]
    assert sorted(s["attributes"]["hixl.layer"] for s in layers) == [0, 1, 2, 3]


def test_a_request_without_an_id_gets_one_from_the_proxy(fleet: Fleet) -> None:
    answer, headers = fleet.complete(words(40, offset=9), {})
    made = headers["X-Request-Id"]
    assert len(made) == 32 and int(made, 16) >= 0 and answer["id"] == f"cmpl-{made}"
    assert fleet.record(made)["outcome"] == "ok"
