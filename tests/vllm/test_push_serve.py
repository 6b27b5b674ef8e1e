"""Push mode served: real ``vllm serve`` processes in push mode behind ``hixl proxy --kv-mode push``.

Three vLLM servers, shared by every test here (one start of them all: a
minute or two on two cores; pull mode's following is tested here too, on the
proxy's first request to a prefill, which is pulled): prefills P1 and P2, decode D1, and two proxies
over them — **1P1D** (P1 -> D1) and **2P1D** (P1, P2 -> D1). Every server
records its transfers (``records``) and traces to this module's OTLP receiver,
as an operator following requests would run them. The reference
text is D1's own, for the same request without ``kv_transfer_params``
(computed there, no connector involved); the fleet and the request helpers
are test_xpyd.py's. The tests run in file order: the
last one kills P2 for good.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from hixl.testing.otlp import Receiver  # noqa: E402
from instances import ROOT  # noqa: E402
from test_serve import free_ports, healthy  # noqa: E402
from test_xpyd import FLAGS, PULLED, STARTUP_TIMEOUT, Fleet, Stream, body, post, reference, send_raw, texts_ok, through  # noqa: E402
from tiny_model import build, words  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PUSH_TIMEOUT_S = 30.0
# name -> (role, the core vLLM binds its OpenMP threads to).
VLLMS = {"p1": ("kv_producer", 0), "p2": ("kv_producer", 1), "d1": ("kv_consumer", 1)}
PROXIES = {"proxy_1p1d": (["p1"], ["d1"]), "proxy_2p1d": (["p1", "p2"], ["d1"])}
LANDED = re.compile(r"hixl: request \S+: push \d+ landed")
FAILED = re.compile(r"hixl: request \S+: push \d+ failed: (.*)")
PULL_FAILED = "hixl: pull of request"  # decode's warning for a failed pull


class PushFleet(Fleet):
    """test_xpyd's fleet, of this module's servers: every vLLM in push mode, every proxy ``--kv-mode push``."""

    def __init__(self, model: Path, logs: Path, otlp: str) -> None:  # noqa: PLW0231 - the same parts, other servers
        self.model, self.logs = model, logs
        names = [*VLLMS, *PROXIES]
        self.ports = dict(zip(names, free_ports(len(names))))
        env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name, (role, cpu) in VLLMS.items():
            config = {
                "kv_connector": "HixlConnector",
                "kv_connector_module_path": "hixl.vllm",
                "kv_role": role,
                "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {"mode": "push", "push_timeout": PUSH_TIMEOUT_S, "records": str(self.records(name))},
            }
            cmd = (
                f"{shlex.quote(sys.executable)} -m vllm.entrypoints.openai.api_server --model {shlex.quote(str(model))} "
                f"--port {self.ports[name]} {FLAGS} --otlp-traces-endpoint {otlp} --kv-transfer-config {shlex.quote(json.dumps(config))}"
            )
            self._start(name, f"exec env VLLM_CPU_OMP_THREADS_BIND={cpu} {cmd}", env)
        for name, (prefills, decodes) in PROXIES.items():
            ups = " ".join([*(f"--prefill {self.url(p)}" for p in prefills), *(f"--decode {self.url(d)}" for d in decodes)])
            cmd = (
                f"exec {shlex.quote(sys.executable)} -m hixl.cli proxy {ups} --port {self.ports[name]} --health-interval 1 --kv-mode push "
                f"--otlp-traces-endpoint {otlp}"
            )
            self._start(name, cmd, env)

    def records(self, name: str) -> Path:
        """The file server ``name``'s connector appends its transfers' records to."""
        return self.logs / f"{name}.records.jsonl"

    def recorded(self, name: str, client_id: str, timeout: float = 10) -> list[dict[str, Any]]:
        """Server ``name``'s records of the request the client named ``client_id`` (waiting for the first)."""
        deadline = time.monotonic() + timeout
        while True:
            path = self.records(name)
            found = [r for r in map(json.loads, path.read_text().splitlines()) if r["client_id"] == client_id] if path.exists() else []
            if found:
                return found
            assert time.monotonic() < deadline, f"{name} recorded nothing of {client_id}"
            time.sleep(0.2)

    def wait_ready(self) -> dict[str, float]:
        """Until every vLLM and every proxy answers /health; seconds until each vLLM did."""
        start, ready = time.monotonic(), {}
        while len(ready) < len(VLLMS) or not all(healthy(self.url(p)) for p in PROXIES):
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)[-4000:]}")
            ready.update({name: time.monotonic() - start for name in VLLMS if name not in ready and healthy(self.url(name))})
            if time.monotonic() - start > STARTUP_TIMEOUT:
                raise RuntimeError(f"not ready after {STARTUP_TIMEOUT} s: {sorted(set(VLLMS) - set(ready))}")
            time.sleep(0.5)
        return ready


@pytest.fixture(scope="module")
def otlp() -> Iterator[Receiver]:
    with Receiver() as started:
        yield started


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, otlp: Receiver) -> Iterator[PushFleet]:
    model = build(tmp_path_factory.mktemp("model"))
    running = PushFleet(model, tmp_path_factory.mktemp("push-serve-logs"), otlp.url)
    try:
        print("\nvLLM serve start-up, s (3 at once):", {k: round(v, 1) for k, v in running.wait_ready().items()})
        yield running
    finally:
        running.close()


def landed(fleet: Fleet) -> int:
    return len(LANDED.findall(fleet.log("d1")))


# Prompt lengths with BOS: 2 (one token pushed), 20 (part of a block), 64 (two blocks), 100 (part of a fourth).
SHAPES = [(1, 5), (19, 1), (63, 2), (99, 3)]


def complete(fleet: Fleet, proxy: str, prompt: str, headers: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """One completion through ``proxy`` with ``headers``: its answer and the answer's headers."""
    request = urllib.request.Request(
        fleet.url(proxy) + "/v1/completions", json.dumps(body(fleet, prompt)).encode(), {"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def test_a_pulled_request_is_recorded_and_traced_under_the_clients_id(fleet: PushFleet, otlp: Receiver) -> None:
    """The proxy's first request to P1 is pulled (it learns where P1's KV lives from the answer), as in pull
    mode: sent with the client's ``X-Request-Id``, it comes back under that id, decode's record and log line
    name it, and one trace holds the proxy's request and hop spans, vLLM's, and decode's ``hixl.kv_load``
    under the decode hop with a span per layer. A request without the header gets an id the proxy made."""
    who, prompt = "pull-follow-1", words(70, offset=5)
    answer, headers = complete(fleet, "proxy_1p1d", prompt, {"X-Request-Id": who})
    assert answer["choices"][0]["text"] == reference(fleet, prompt) and headers["X-Request-Id"] == who
    assert answer["id"] == f"cmpl-{who}"  # vLLM named it after the header, as the connector's records do
    (record,) = fleet.recorded("d1", who)
    assert record["mode"] in ("whole", "layerwise") and record["outcome"] == "ok" and not record["retried"], record
    assert record["request"].startswith(f"cmpl-{who}-0-") and record["transport"] in ("cma", "shm", "tcp")
    assert record["nbytes"] > 0 and len(record["layers"]) == 4 and record["start"] <= record["usable"] and record["sync_ref"] is None
    assert f"(client request id {who})" in fleet.log("d1")

    def ours(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
        roots = [s for s in spans if s["name"] == "hixl.proxy.request" and s["attributes"].get("hixl.client_request_id") == who]
        names = {s["name"]: s for s in spans if roots and s["trace"] == roots[0]["trace"]}
        wanted = {"hixl.proxy.request", "hixl.proxy.prefill", "hixl.proxy.decode", "hixl.kv_load", "hixl.kv_layer"}
        return names if wanted <= set(names) else None

    spans = otlp.wait_for("the pull's trace", ours)
    request, prefill, decode, load = (spans[n] for n in ("hixl.proxy.request", "hixl.proxy.prefill", "hixl.proxy.decode", "hixl.kv_load"))
    assert request["service"] == "hixl.proxy" and load["service"] == "hixl.vllm"
    assert request["parent"] == "" and prefill["parent"] == decode["parent"] == request["id"]
    assert load["parent"] == decode["id"]  # vLLM passed the decode hop's traceparent on to the connector
    assert load["attributes"]["hixl.client_request_id"] == who and load["attributes"]["hixl.bytes"] == record["nbytes"]
    assert load["attributes"]["hixl.outcome"] == "ok" and decode["start"] <= load["start"] <= load["end"] <= decode["end"]
    layers = [s for s in otlp.spans if s["name"] == "hixl.kv_layer" and s["parent"] == load["id"]]
    assert sorted(s["attributes"]["hixl.layer"] for s in layers) == [0, 1, 2, 3]
    answer, headers = complete(fleet, "proxy_1p1d", words(40, offset=9), {})
    made = headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made) and answer["id"] == f"cmpl-{made}"
    assert [r["outcome"] for r in fleet.recorded("d1", made)] == ["ok"]


def test_1p1d_pushed_tokens_equal_the_reference(fleet: Fleet) -> None:
    """Every request to P1 after the proxy learned it (from the first test's pull) is pushed."""
    first = [words(30, offset=0)]
    texts_ok(fleet, first, through(fleet, "proxy_1p1d", first))
    assert PULL_FAILED not in fleet.log("d1")  # a push-mode decode pulls the learning request (read-only to peers only)
    before = landed(fleet)
    prompts = [words(n, offset=10 + off) for n, off in SHAPES] * 2
    texts_ok(fleet, prompts, through(fleet, "proxy_1p1d", prompts))
    assert landed(fleet) - before == len(prompts), fleet.log("d1")[-3000:]
    assert not FAILED.search(fleet.log("d1"))


def test_a_push_is_recorded_and_traced_at_both_ends_under_the_clients_id(fleet: PushFleet, otlp: Receiver) -> None:
    """One pushed request with the client's ``X-Request-Id``: decode's and prefill's records and log lines
    name it, with bytes, times, transport and outcome, and its trace holds the proxy's hops, decode's
    ``hixl.kv_load`` (mode push) under the decode hop and prefill's ``hixl.kv_push`` under the prefill
    hop, with a span per layer's writes."""
    who, prompt = "push-follow-1", words(63, offset=31)
    status, answer = post(fleet, "proxy_1p1d", body(fleet, prompt), headers={"X-Request-Id": who})
    assert status == 200 and answer["choices"][0]["text"] == reference(fleet, prompt), answer
    (landed,) = fleet.recorded("d1", who)
    (pushed,) = fleet.recorded("p1", who)
    assert landed["role"] == "decode" and landed["mode"] == "push" and landed["outcome"] == "ok", landed
    assert landed["start"] <= landed["issued"] <= landed["usable"] <= landed["reported"] and landed["nbytes"] > 0
    assert pushed["role"] == "prefill" and pushed["outcome"] == "ok" and len(pushed["layers"]) == 4, pushed
    assert pushed["nbytes"] == landed["nbytes"] and pushed["transport"] == landed["transport"] in ("cma", "shm", "tcp")
    # Causal order across the two processes: granted, then computed at prefill; every write landed, then DONE.
    assert landed["start"] <= pushed["layers"][0][1] and pushed["usable"] <= landed["usable"]
    assert f"client request id {who})" in fleet.log("d1") and f"client request id {who})" in fleet.log("p1")

    def ours(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
        roots = [s for s in spans if s["name"] == "hixl.proxy.request" and s["attributes"].get("hixl.client_request_id") == who]
        trace = [s for s in spans if roots and s["trace"] == roots[0]["trace"]]
        names = {s["name"]: s for s in trace}
        wanted = {"hixl.proxy.request", "hixl.proxy.prefill", "hixl.proxy.decode", "hixl.kv_load", "hixl.kv_grant", "hixl.kv_push", "hixl.kv_layer"}
        return names if wanted <= set(names) else None

    spans = otlp.wait_for("the push's trace", ours)
    load, push = spans["hixl.kv_load"], spans["hixl.kv_push"]
    assert load["parent"] == spans["hixl.proxy.decode"]["id"] and push["parent"] == spans["hixl.proxy.prefill"]["id"]
    assert load["attributes"]["hixl.mode"] == "push" and push["attributes"]["hixl.bytes"] == pushed["nbytes"]
    assert spans["hixl.kv_grant"]["parent"] == load["id"]
    layers = [s for s in otlp.spans if s["name"] == "hixl.kv_layer" and s["parent"] == push["id"]]
    assert sorted(s["attributes"]["hixl.layer"] for s in layers) == [0, 1, 2, 3]


def test_2p1d_pushes_from_both_prefills_land(fleet: Fleet) -> None:
    """Two prefills push into one decode, in turn and at once: every push lands, no link is declared dead."""
    pulled = {name: fleet.log(name).count(PULLED) for name in ("p1", "p2")}
    for round_ in range(5):  # the 2P1D proxy learns each prefill's ranks from a first request to it (a pull)
        learn = [words(30, offset=40 + 4 * round_ + i) for i in range(4)]
        texts_ok(fleet, learn, through(fleet, "proxy_2p1d", learn))
        if all(fleet.log(name).count(PULLED) > n for name, n in pulled.items()):
            break
    else:
        pytest.fail("the 2P1D proxy never sent both prefills a request")
    before = landed(fleet)
    prompts = [words(n, offset=50 + off + i) for i in range(3) for n, off in SHAPES]
    for prompt in prompts[:4]:
        texts_ok(fleet, [prompt], through(fleet, "proxy_2p1d", [prompt]))
    texts_ok(fleet, prompts[4:], through(fleet, "proxy_2p1d", prompts[4:]))
    assert landed(fleet) - before == len(prompts), fleet.log("d1")[-3000:]
    assert not FAILED.search(fleet.log("d1"))
    for name in ("p1", "p2"):
        assert "no sign of life" not in fleet.log(name), fleet.log(name)[-3000:]


def test_requests_aborted_mid_push_leave_every_other_answer_right(fleet: Fleet) -> None:
    """Under concurrent load, clients leave some requests while their pushes are under way (vLLM aborts them
    at decode, whose grant is revoked, and at prefill): every other answer still equals the reference, and
    D1 ends with nothing running or waiting."""
    kept = [words(n, offset=80 + off + i) for i in range(2) for n, off in SHAPES]
    for prompt in kept:
        reference(fleet, prompt)
    aborted = [Stream(send_raw(fleet, "proxy_1p1d", body(fleet, words(99, offset=120 + i), max_tokens=64, stream=True)))
               for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = pool.submit(through, fleet, "proxy_1p1d", kept)
        for i, stream in enumerate(aborted):
            time.sleep(0.02 * i)  # at different points of their pushes
            stream.sock.close()
        texts_ok(fleet, kept, answers.result(timeout=300))
    deadline = time.monotonic() + 30
    while (busy := _gauges(fleet, "d1")) != (0, 0):
        assert time.monotonic() < deadline, f"D1 still holds requests {busy}:\n{fleet.log('d1')[-3000:]}"
        time.sleep(0.2)
    after = [words(19, offset=140 + i) for i in range(4)]
    texts_ok(fleet, after, through(fleet, "proxy_1p1d", after))


def _gauges(fleet: Fleet, name: str) -> tuple[int, int]:
    """(running, waiting) requests of vLLM server ``name`` (its /metrics)."""
    with urllib.request.urlopen(fleet.url(name) + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    running, waiting = (sum(int(float(n)) for n in re.findall(rf"^vllm:num_requests_{kind}\{{[^}}]*\}} (\S+)$", text, re.M)) for kind in ("running", "waiting"))
    return running, waiting


def test_a_prefill_killed_mid_push_fails_decodes_request_fast_and_hangs_nothing(fleet: Fleet) -> None:
    """P2 stops (SIGSTOP) with a pushed request granted by D1, then is SIGKILLed: D1 fails the request within
    seconds (the link is dead: not its push_timeout), the client gets an error, and requests through 2P1D
    still succeed (on P1)."""
    prompt = words(40, offset=200)
    status, learned = post(fleet, "p2", body(fleet, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200, learned
    source = {k: learned["kv_transfer_params"][k] for k in ("remote_ranks", "remote_kv")}
    fleet.signal("p2", signal.SIGSTOP)
    push_id = 7_000_001
    failed_before = len(FAILED.findall(fleet.log("d1")))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        began = time.monotonic()
        decoded = pool.submit(post, fleet, "d1", body(fleet, prompt, kv_transfer_params={"do_remote_prefill": True, "push_id": push_id, **source}))
        time.sleep(2.0)  # D1 granted the push: P2 never computes it
        fleet.signal("p2", signal.SIGKILL)
        status, answer = decoded.result(timeout=PUSH_TIMEOUT_S)
    took = time.monotonic() - began
    assert status != 200 or answer["choices"][0]["finish_reason"] == "error", answer
    assert took < PUSH_TIMEOUT_S / 2, took
    failures = FAILED.findall(fleet.log("d1"))[failed_before:]
    assert failures and "push_timeout" not in failures[0], failures
    print(f"\nprefill killed: decode's request ended after {took:.1f} s ({failures[0]})")
    prompts = [words(19, offset=210 + i) for i in range(4)]
    texts_ok(fleet, prompts, through(fleet, "proxy_2p1d", prompts))
