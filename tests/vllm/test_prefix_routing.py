"""Prefix-aware routing with real ``vllm serve`` processes: two prefills and a decode behind ``hixl proxy --kv-events``.

P1 and P2 (prefix caching on, as vLLM's default) publish their KV-cache events
on ipc sockets in the test's folder; the proxy follows P2's directly and P1's
through an :class:`EventsRelay`, which the test can cut: P1's events then stop
while P1 serves on. D1 decodes every request (its events are not followed). The
prompts are text (the tiny Llama's words), so the proxy tokenizes them with a
prefill's ``/tokenize``. The tests run in file order and share the servers:
the first puts two prefixes in the two prefills' caches, the next cuts P1's
events, the last restarts P2.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")
import test_xpyd as xpyd  # noqa: E402
import zmq  # noqa: E402
from instances import ROOT  # noqa: E402
from test_serve import free_ports, healthy  # noqa: E402
from test_xpyd import FLAGS  # noqa: E402
from tiny_model import BLOCK_SIZE, build, words  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STARTUP_TIMEOUT = 500.0
EVENTS_TIMEOUT = 3.0  # the proxy's --events-timeout
# name -> (kv_role, the core vLLM binds its OpenMP threads to)
VLLMS = {"p1": ("kv_producer", 0), "p2": ("kv_producer", 1), "d1": ("kv_consumer", 1)}
PREFIX = 192  # words of a shared prefix: with BOS, six whole blocks of 32 tokens
SHARED_BLOCKS = (PREFIX + 1) // BLOCK_SIZE


class EventsRelay:
    """Passes an instance's KV events and its replay socket's answers on to the proxy, until :attr:`cut` is set:
    then it drops both (a fault: the instance's events stop while it serves on)."""

    def __init__(self, pub: str, replay: str, folder: Path) -> None:
        self.endpoint, self.replay = f"ipc://{folder}/relay.pub", f"ipc://{folder}/relay.replay"
        self.cut = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pub, replay), name="events-relay", daemon=True)
        self._thread.start()

    def _run(self, pub: str, replay: str) -> None:
        context = zmq.Context()
        sub, out, front, back = (context.socket(kind) for kind in (zmq.SUB, zmq.PUB, zmq.ROUTER, zmq.DEALER))
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        out.bind(self.endpoint)
        front.bind(self.replay)
        back.connect(replay)
        asking: collections.deque[bytes] = collections.deque()  # who asked the replays forwarded, in order
        poller = zmq.Poller()
        for sock in (sub, front, back):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    frames = sock.recv_multipart()
                    if self.cut.is_set():
                        asking.clear()
                    elif sock is sub:
                        out.send_multipart(frames)
                    elif sock is front:  # [asker, b"", start]: vLLM's ROUTER takes [b"", start] from a DEALER
                        asking.append(frames[0])
                        back.send_multipart(frames[1:])
                    elif asking:  # [b"", topic, seq, batch], the end's seq being -1
                        front.send_multipart([asking[0], *frames])
                        if int.from_bytes(frames[2], "big", signed=True) == -1:
                            asking.popleft()
        finally:
            for sock in (sub, out, front, back):
                sock.close(linger=0)
            context.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


class Fleet(xpyd.Fleet):
    """P1, P2, D1 and the proxy, each in its own process group (started, logged and ended as test_xpyd's fleet);
    logs and ipc sockets in ``logs``."""

    def __init__(self, model: Path, logs: Path) -> None:  # (not the base's: other servers)
        self.model, self.logs = model, logs
        self.ports = dict(zip([*VLLMS, "proxy"], free_ports(len(VLLMS) + 1)))
        self.env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in VLLMS:
            self.start(name)
        self.relay = EventsRelay(*self.events("p1"), logs)
        events = [f"--kv-events {self.url('p1')}={self.relay.endpoint},{self.relay.replay}", f"--kv-events {self.url('p2')}={','.join(self.events('p2'))}"]
        self._start(
            "proxy",
            f"exec {shlex.quote(sys.executable)} -m hixl.cli proxy --prefill {self.url('p1')} --prefill {self.url('p2')} "
            f"--decode {self.url('d1')} --port {self.ports['proxy']} --health-interval 1 --events-timeout {EVENTS_TIMEOUT} "
            + " ".join(events),
            self.env,
        )

    def events(self, name: str) -> tuple[str, str]:
        """A prefill's PUB and replay endpoints."""
        return f"ipc://{self.logs}/{name}.pub", f"ipc://{self.logs}/{name}.replay"

    def start(self, name: str) -> None:
        """Start vLLM ``name`` (again)."""
        role, cpu = VLLMS[name]
        transfer = {"kv_connector": "HixlConnector", "kv_connector_module_path": "hixl.vllm", "kv_role": role}
        flags = f"{FLAGS} --kv-transfer-config {shlex.quote(json.dumps(transfer))}"
        if role == "kv_producer":
            pub, replay = self.events(name)
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
            flags += f" --kv-events-config {shlex.quote(json.dumps(events))}"
        self._start(
            name,
            f"exec env VLLM_CPU_OMP_THREADS_BIND={cpu} {shlex.quote(sys.executable)} -m vllm.entrypoints.openai.api_server "
            f"--model {shlex.quote(str(self.model))} --port {self.ports[name]} {flags}",
            self.env,
        )

    def wait(self, condition: Callable[[], bool], what: str, timeout: float = STARTUP_TIMEOUT) -> None:
        """Until ``condition`` holds; RuntimeError if a process exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not condition():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not within {timeout} s: {what}\n{self.log('proxy')[-3000:]}")
            time.sleep(0.5)

    def metrics(self, name: str) -> str:
        with urllib.request.urlopen(self.url(name) + "/metrics", timeout=30) as resp:
            return resp.read().decode()

    def value(self, name: str, sample: str, **labels: str) -> float:
        """Server ``name``'s ``sample``, summed over its label sets that have ``labels``."""
        found = 0.0
        for line in self.metrics(name).splitlines():
            match = re.fullmatch(rf"{re.escape(sample)}(?:\{{(.*)\}})? (\S+)", line)
            if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
                found += float(match.group(2))
        return found

    def proxy(self, sample: str, instance: str = "", **labels: str) -> float:
        """The proxy's ``sample`` (of ``instance``'s upstream, if given)."""
        return self.value("proxy", sample, **labels, **({"upstream": self.url(instance)} if instance else {}))

    def routing(self) -> str:
        """The proxy's routing series, for a failed assertion's message."""
        return "\n".join(line for line in self.metrics("proxy").splitlines() if re.match(r"hixl_proxy_(routed|kv_events|prefix|upstream_up)", line))

    def live(self, instance: str) -> bool:
        return self.proxy("hixl_proxy_kv_events_live", instance) == 1

    def up(self, instance: str) -> bool:
        """Whether the proxy's health checks have it up (only an up instance is a candidate)."""
        return self.proxy("hixl_proxy_upstream_up", instance) == 1

    def served(self) -> dict[str, float]:
        """Prefill requests each prefill served for the proxy."""
        return {p: self.proxy("hixl_proxy_requests_total", p, role="prefill", outcome="ok") for p in ("p1", "p2")}

    def ask(self, prompt: str) -> str:
        """A completion through the proxy; the prefill that served it."""
        before = self.served()
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(self.url("proxy") + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            assert resp.status == 200
        after = self.served()
        grown = [p for p in after if after[p] > before[p]]
        assert len(grown) == 1, (before, after)
        return grown[0]

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.procs.pop(name).wait(30)

    def close(self) -> None:
        self.relay.close()
        super().close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model = build(tmp_path_factory.mktemp("model"))
    # Not under pytest's own temp folder: a pytest run beside this one may remove it (it keeps three), ipc sockets and all.
    folder = Path(tempfile.mkdtemp(prefix="hixl-prefix-"))
    running = Fleet(model, folder)
    try:
        running.wait(
            lambda: healthy(running.url("proxy")) and all(running.up(p) and running.live(p) for p in ("p1", "p2")),
            "the proxy up, both prefills up and their events live",
        )
        yield running
    finally:
        running.close()
        shutil.rmtree(folder, ignore_errors=True)


def prompt(prefix: int, suffix: int) -> str:
    """A shared prefix (``prefix`` picks which) of :data:`PREFIX` words, then 40 words of its own (``suffix``)."""
    return f"{words(PREFIX, offset=prefix)} {words(40, offset=1000 + suffix)}"


def test_requests_sharing_a_prefix_go_to_the_prefill_that_cached_it(fleet: Fleet) -> None:
    x = [fleet.ask(prompt(1, s)) for s in range(3)]
    y = [fleet.ask(prompt(2, s)) for s in range(2)]
    assert len(set(x)) == len(set(y)) == 1 and x[0] != y[0], (x, y, fleet.routing())  # (least loaded would have taken turns)
    hits = {p: fleet.value(p, "vllm:prefix_cache_hits_total") for p in ("p1", "p2")}
    assert hits[x[0]] >= 2 * SHARED_BLOCKS * BLOCK_SIZE and hits[y[0]] >= SHARED_BLOCKS * BLOCK_SIZE, hits
    assert fleet.proxy("hixl_proxy_routed_total", role="prefill", rule="prefix") == 5
    assert fleet.proxy("hixl_proxy_prefix_blocks", x[0]) >= SHARED_BLOCKS


def test_an_idle_prefill_stays_live_and_one_whose_events_stop_is_routed_around(fleet: Fleet) -> None:
    time.sleep(2 * EVENTS_TIMEOUT)  # no events meanwhile: vLLM's replay socket answers the probes
    assert fleet.live("p1") and fleet.live("p2")
    owner = fleet.ask(prompt(1, 10))  # the first prefix's: the other holds only the second
    fleet.relay.cut.set()
    fleet.wait(lambda: not fleet.live("p1"), "p1's events noticed stopped", timeout=4 * EVENTS_TIMEOUT)
    load = fleet.proxy("hixl_proxy_routed_total", role="prefill", rule="load")
    assert sorted(fleet.ask(prompt(2, 11 + s)) for s in range(2)) == ["p1", "p2"]  # least loaded: in turn
    assert fleet.proxy("hixl_proxy_routed_total", role="prefill", rule="load") == load + 2
    fleet.relay.cut.clear()
    fleet.wait(lambda: fleet.live("p1"), "p1's events followed again", timeout=4 * EVENTS_TIMEOUT)
    assert fleet.proxy("hixl_proxy_kv_events_resyncs_total", "p1") == 0  # the same history: the index kept ...
    assert fleet.proxy("hixl_proxy_prefix_blocks", "p1") >= 2 * SHARED_BLOCKS  # ... and what it missed, replayed
    assert fleet.ask(prompt(1, 13)) == owner


def test_a_restarted_prefills_index_is_dropped(fleet: Fleet) -> None:
    blocks = fleet.proxy("hixl_proxy_prefix_blocks", "p2")
    assert blocks >= SHARED_BLOCKS
    fleet.kill("p2")
    fleet.wait(lambda: fleet.proxy("hixl_proxy_upstream_up", "p2", role="prefill") == 0, "p2 marked down", timeout=30)
    assert fleet.ask(prompt(2, 20)) == "p1"  # the one left
    fleet.start("p2")
    fleet.wait(lambda: fleet.proxy("hixl_proxy_upstream_up", "p2", role="prefill") == 1 and fleet.live("p2"), "p2 back")
    assert fleet.proxy("hixl_proxy_kv_events_resyncs_total", "p2") >= 1
    assert fleet.proxy("hixl_proxy_prefix_blocks", "p2") == 0  # a new instance: nothing cached, whatever the old held
    assert fleet.ask(prompt(2, 21)) == "p1"  # the prefix is p1's now
