"""XpYd serving: real ``vllm serve`` processes behind ``hixl proxy``, prefill and decode instances failing.

Four vLLM servers, shared by every test here (each start costs a minute or
two on two cores): prefills P1 and P2, decodes D1 and D2 (D2 runs one request
at a time, so that a second one waits in its queue), and two proxies over
them — **2P1D** (P1, P2 -> D1) and **1P2D** (P1 -> D1, D2); D1 recomputes a
prompt whose KV it cannot pull (``kv_load_failure_policy="recompute"``). The reference text
is D1's own, for the same request without ``kv_transfer_params`` (computed
there, no connector involved). Leases are short (:data:`LEASE_S`), so that
expiries show within seconds. The tests run in file order: the cold-link
test needs servers nobody has sent a request to yet, and each kill test
takes a server away for good.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hixl._tools.groups import stop_groups

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")

from instances import HERE, ROOT  # noqa: E402
from test_serve import free_ports, healthy  # noqa: E402
from tiny_model import build, words  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Shorter than the default (30 s), so that expiries show within seconds; not much shorter: with four
# vLLMs on two cores a prefill's hixl threads were seen waiting seconds for a CPU (4.7 s once), and a
# 6 s lease then ran out between two of decode's extensions, or before its release was heard.
LEASE_S = 15.0
ABORTED = "ended here unpulled; its blocks are released at prefill"  # decode's connector's line for an aborted request
STARTUP_TIMEOUT = 500.0
FLAGS = (
    "--dtype float32 --max-model-len 512 --block-size 32 --kv-cache-memory-bytes 64M "
    "--distributed-executor-backend uni --enforce-eager"
)
# name -> (role, the core vLLM binds its OpenMP threads to, extra flags, kv_load_failure_policy).
# D1 recomputes a prompt whose KV it cannot pull: in 2P1D it is the only decode, so when P2 dies
# under a request D1 was about to pull, the proxy has no other decode to retry it on.
VLLMS = {
    "p1": ("kv_producer", 0, "", "fail"),
    "p2": ("kv_producer", 1, "", "fail"),
    "d1": ("kv_consumer", 1, "", "recompute"),
    "d2": ("kv_consumer", 0, "--max-num-seqs 1", "fail"),
}
PROXIES = {"proxy_2p1d": (["p1", "p2"], ["d1"]), "proxy_1p2d": (["p1"], ["d1", "d2"])}
PULLED = "was pulled by decode; its blocks are released"


class Fleet:
    """The servers of this module, each in its own process group; logs in ``logs``."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.model, self.logs = model, logs
        names = [*VLLMS, *PROXIES]
        self.ports = dict(zip(names, free_ports(len(names))))
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name, (role, cpu, flags, policy) in VLLMS.items():
            config = {
                "kv_connector": "HixlConnector",
                "kv_connector_module_path": "hixl.vllm",
                "kv_role": role,
                "kv_load_failure_policy": policy,
                "kv_connector_extra_config": {"lease_s": LEASE_S},
            }
            cmd = (
                f"{shlex.quote(sys.executable)} -m vllm.entrypoints.openai.api_server --model {shlex.quote(str(model))} "
                f"--port {self.ports[name]} {FLAGS} {flags} --kv-transfer-config {shlex.quote(json.dumps(config))}"
            )
            self._start(name, f"exec env VLLM_CPU_OMP_THREADS_BIND={cpu} {cmd}", env)
        for name, (prefills, decodes) in PROXIES.items():
            ups = " ".join([*(f"--prefill {self.url(p)}" for p in prefills), *(f"--decode {self.url(d)}" for d in decodes)])
            self._start(name, f"exec {shlex.quote(sys.executable)} -m hixl.cli proxy {ups} --port {self.ports[name]} --health-interval 1", env)

    def _start(self, name: str, command: str, env: dict[str, str]) -> None:
        self.procs[name] = subprocess.Popen(
            ["bash", "-c", command], stdout=(self.logs / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
            env=env, start_new_session=True, cwd=HERE,
        )

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait_ready(self) -> dict[str, float]:
        """Until every proxy sees every upstream up (its /metrics); returns seconds until each vLLM answered /health."""
        start, ready = time.monotonic(), {}
        while len(ready) < len(VLLMS) or not all(self.all_up(p) for p in PROXIES):
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)[-4000:]}")
            for name in VLLMS:
                if name not in ready and self.healthy(name):
                    ready[name] = time.monotonic() - start
            if time.monotonic() - start > STARTUP_TIMEOUT:
                raise RuntimeError(f"not ready after {STARTUP_TIMEOUT} s: {sorted(set(VLLMS) - set(ready))}")
            time.sleep(0.5)
        return ready

    def healthy(self, name: str) -> bool:
        return healthy(self.url(name))

    def all_up(self, proxy: str) -> bool:
        try:
            with urllib.request.urlopen(self.url(proxy) + "/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return False
        gauges = re.findall(r"^hixl_proxy_upstream_up\{[^}]*\} (\S+)$", text, re.M)
        return bool(gauges) and all(float(g) == 1 for g in gauges)

    def signal(self, name: str, sig: signal.Signals) -> None:
        os.killpg(self.procs[name].pid, sig)

    def close(self) -> None:
        stop_groups(self.procs.values())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model = build(tmp_path_factory.mktemp("model"))
    running = Fleet(model, tmp_path_factory.mktemp("xpyd-logs"))
    try:
        print("\nvLLM serve start-up, s (4 at once):", {k: round(v, 1) for k, v in running.wait_ready().items()})
        yield running
    finally:
        running.close()


def post(fleet: Fleet, name: str, body: dict[str, Any], timeout: float = 120, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """POST /v1/completions to server ``name`` (with ``headers`` too); (HTTP status, JSON answer)."""
    request = urllib.request.Request(
        fleet.url(name) + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def body(fleet: Fleet, prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": str(fleet.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


_references: dict[str, str] = {}


def reference(fleet: Fleet, prompt: str) -> str:
    """D1's own text for ``prompt`` (no kv_transfer_params: computed there)."""
    if prompt not in _references:
        status, answer = post(fleet, "d1", body(fleet, prompt))
        assert status == 200, answer
        _references[prompt] = answer["choices"][0]["text"]
    return _references[prompt]


def through(fleet: Fleet, proxy: str, prompts: list[str], workers: int = 4) -> list[tuple[int, dict[str, Any]]]:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda p: post(fleet, proxy, body(fleet, p)), prompts))


def texts_ok(fleet: Fleet, prompts: list[str], answers: list[tuple[int, dict[str, Any]]]) -> None:
    for prompt, (status, answer) in zip(prompts, answers):
        assert status == 200, answer
        assert answer["choices"][0]["text"] == reference(fleet, prompt)


def test_first_requests_through_every_prefill_and_decode_succeed(fleet: Fleet) -> None:
    """The cold links: the very first requests, at once, through both proxies — no link exists yet."""
    first = [words(40, offset=i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda proxy: through(fleet, proxy, first[:4] if proxy == "proxy_2p1d" else first[4:]), PROXIES)
    texts_ok(fleet, first[:4], a)
    texts_ok(fleet, first[4:], b)
    # Spread: both prefills served 2P1D, both decodes 1P2D; nothing failed on the way. A prefill
    # logs the release once decode's completion reached it, which can be just after the answer.
    deadline = time.monotonic() + 20
    while not (fleet.log("p2").count(PULLED) >= 1 and fleet.log("p1").count(PULLED) >= 2):
        assert time.monotonic() < deadline, (fleet.log("p1").count(PULLED), fleet.log("p2").count(PULLED))
        time.sleep(0.2)
    assert fleet.log("d1").count("hixl: pulled request") >= 1 and fleet.log("d2").count("hixl: pulled request") >= 1
    for name in VLLMS:
        assert "pull of request" not in fleet.log(name) and "no complete handshake" not in fleet.log(name), name
    # Each decode linked (in the background, while its first requests were held back) once per prefill.
    for decode, prefills in (("d1", ["p1", "p2"]), ("d2", ["p1"])):
        linked = re.findall(r"hixl: linked to prefill 127\.0\.0\.1:\d+ \(cluster \d+\) in [\d.]+ ms, after 0 failed", fleet.log(decode))
        assert len(linked) == len(prefills), fleet.log(decode)[-3000:]
    retries = urllib.request.urlopen(fleet.url("proxy_2p1d") + "/metrics").read().decode()
    assert not re.search(r"^hixl_proxy_retries_total\{[^}]*\} [1-9]", retries, re.M)  # none needed a second try


def send_raw(fleet: Fleet, name: str, request: dict[str, Any]) -> socket.socket:
    """POST /v1/completions on a bare socket and return it unread: urlopen would wait for the answer."""
    sock = socket.create_connection(("127.0.0.1", fleet.ports[name]))
    payload = json.dumps(request).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    sock.sendall(head.encode() + payload)
    return sock


def waiting(fleet: Fleet, name: str) -> int:
    """Requests in vLLM server ``name``'s queue, not yet scheduled (its /metrics)."""
    with urllib.request.urlopen(fleet.url(name) + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(int(float(n)) for n in re.findall(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M))


class Stream:
    """A streamed answer on a socket from :func:`send_raw`, read only to see whether it ended."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._tail = b""
        sock.setblocking(False)

    def ended(self) -> bool:
        """Whether the server sent the stream's last event (``data: [DONE]``) yet."""
        try:
            while chunk := self.sock.recv(1 << 16):
                self._tail = (self._tail + chunk)[-16:]
        except BlockingIOError:
            pass
        return b"[DONE]" in self._tail


def test_abort_at_decode_releases_prefill_blocks_at_once(fleet: Fleet) -> None:
    """A request waits in D2's queue (D2 runs one at a time, long ones are ahead); its client
    leaves; P1 frees its blocks at once, long before their lease would have run out."""
    status, prefilled = post(fleet, "p1", body(fleet, words(40, offset=50), max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200
    pulled_before = fleet.log("d2").count("hixl: pulled request")
    # Eight, not five: on a loaded machine the victim can take seconds to reach D2's scheduler, and
    # the busy ones must still be ahead of it then (they are aborted when the test ends, not run out).
    busy = [Stream(send_raw(fleet, "d2", body(fleet, words(5, offset=i), max_tokens=480, stream=True))) for i in range(8)]

    deadline = time.monotonic() + 60

    def queued(extra: int) -> None:
        """Until D2's queue holds the busy requests still unanswered but the one running, and
        ``extra`` more, on two looks a quarter second apart (under load the first busy ones may
        be answered meanwhile, and the gauge can lag a step behind an answer)."""
        held = 0
        while held < 2:
            assert time.monotonic() < deadline, fleet.log("d2")[-3000:]
            ahead = sum(not stream.ended() for stream in busy)
            held = held + 1 if waiting(fleet, "d2") >= ahead - 1 + extra else 0
            time.sleep(0.25 if held else 0.05)

    try:
        queued(0)
        victim = send_raw(fleet, "d2", body(fleet, words(40, offset=50), stream=True, kv_transfer_params=prefilled["kv_transfer_params"]))
        # It reaches D2's scheduler (how soon depends on the load: not a fixed sleep) and waits behind
        # the busy ones, its lease extended.
        queued(1)
        assert sum(not stream.ended() for stream in busy) >= 2, "the busy requests were answered before the victim waited long"
        time.sleep(1.5)
        assert fleet.log("d2").count("hixl: pulled request") == pulled_before, "D2 ran the request already: no wait to abort"
        assert "released by decode" not in fleet.log("p1")
        aborts = fleet.log("d2").count(ABORTED)
        victim.close()  # the client leaves: vLLM aborts the request
        left = time.monotonic()
        aborted = None  # when D2's connector saw vLLM end it (how soon vLLM notices a client left is vLLM's, not hixl's)
        pattern = r"request \S+ was released by decode unpulled after ([\d.]+) s held, ([\d.]+) s before its lease would have expired"
        # Past a lease from the last extension, P1 would log the expiry instead: both show below.
        while not (found := re.search(pattern, fleet.log("p1"))):
            assert time.monotonic() < left + 2 * LEASE_S, f"P1:\n{fleet.log('p1')[-3000:]}\nD2:\n{fleet.log('d2')[-3000:]}"
            if aborted is None and fleet.log("d2").count(ABORTED) > aborts:
                aborted = time.monotonic()
            time.sleep(0.05)
        released = time.monotonic()
        aborted = aborted or released  # (both seen in one look)
        print(
            f"\nclient left -> D2's connector told: {aborted - left:.2f} s; -> prefill release: {released - aborted:.2f} s more "
            f"(lease {LEASE_S} s); prefill: {found.group(0)}"
        )
        assert released - aborted < LEASE_S / 2
        assert float(found.group(1)) > 1.5  # it was held (and extended) while it waited
        assert float(found.group(2)) > LEASE_S / 3  # well before the lease would have run out
        assert fleet.log("d2").count("hixl: pulled request") == pulled_before  # and never pulled
    finally:
        for stream in busy:
            stream.sock.close()


def test_a_prefill_killed_mid_run_costs_no_client_an_error(fleet: Fleet) -> None:
    """2P1D: SIGKILL P2 while requests flow; every request still succeeds (through P1)."""
    prompts = [words(40, offset=100 + i) for i in range(16)]
    for prompt in prompts:
        reference(fleet, prompt)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, fleet, "proxy_2p1d", body(fleet, p)) for p in prompts]
        time.sleep(1.0)
        fleet.signal("p2", signal.SIGKILL)
        answers = [f.result() for f in futures]
    texts_ok(fleet, prompts, answers)
    after = [words(40, offset=200 + i) for i in range(4)]
    texts_ok(fleet, after, through(fleet, "proxy_2p1d", after))


def test_a_decode_killed_mid_run_hangs_nothing_and_its_leases_run_out(fleet: Fleet) -> None:
    """1P2D: D2 hangs (SIGSTOP), takes requests, then is SIGKILLed: the proxy retries them on D1, and P1
    frees the blocks it held for D2 when their leases run out."""
    fleet.signal("d2", signal.SIGSTOP)
    prompts = [words(40, offset=300 + i) for i in range(4)]
    for prompt in prompts:
        reference(fleet, prompt)
    expired_before = fleet.log("p1").count("its lease expired")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, fleet, "proxy_1p2d", body(fleet, p)) for p in prompts]
        time.sleep(2.0)  # some went to D2 and hang there; P1 holds their blocks
        fleet.signal("d2", signal.SIGKILL)
        killed = time.monotonic()
        answers = [f.result() for f in futures]
    texts_ok(fleet, prompts, answers)
    deadline = killed + LEASE_S + 5
    while fleet.log("p1").count("its lease expired") == expired_before:
        assert time.monotonic() < deadline, "P1 never freed the blocks it held for the killed decode"
        time.sleep(0.2)
    print(f"\nP1 freed the dead decode's blocks {time.monotonic() - killed:.1f} s after the kill (lease {LEASE_S} s)")
