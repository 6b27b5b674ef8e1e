"""The README's "Serving with vLLM" lines, run as written: two vLLM servers + ``hixl proxy``.

The README's serving block goes to one bash, character for character, with
the tests' tiny local model as ``$MODEL`` and free ports in the environment:
it starts the servers and the proxy, waits for their ``/health``, and sends
its example request. At the end the README's stop line goes to the same
shell, and every port must close. A plain vLLM server (the README's prefill
line without the connector) is the reference: OpenAI-client requests through
the proxy — completions and chat, streamed and not — must give its text,
prefill must report each request's blocks released after decode pulled them,
and both servers' ``/metrics`` must show the connector's ``vllm:hixl_*``
series agreeing with its log lines, and the proxy's the requests it routed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402  (comes with vLLM)

from instances import ROOT  # noqa: E402
from readme_serving import free_ports, readme_blocks, readme_model, shims  # noqa: E402
from tiny_model import words  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STARTUP_TIMEOUT = 700.0  # more than the README's own wait (600 s), so that its message shows first
DONE = "@@block-done"
PULLED = "hixl: pulled request"
RELEASED = "was pulled by decode; its blocks are released"


def healthy(url: str) -> bool:
    """Whether the server at ``url`` answers ``GET /health`` with 200 now."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


class Servers:
    """The README's shell (its processes in its process group) and a reference server; logs in ``logs``."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.model, self.logs = model, logs
        names = ("prefill", "decode", "proxy", "reference")
        self.ports = dict(zip(names, free_ports(len(names))))
        self.serve, self.stop = readme_blocks()
        self.example = ""  # what the README's block printed: its wait's messages, then the example's answer
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            PATH=f"{shims(logs / 'bin')}{os.pathsep}{os.environ['PATH']}",
            MODEL=str(model),
            **{f"{name.upper()}_PORT": str(port) for name, port in self.ports.items()},
        )
        variables, sizing, prefill = self.serve.splitlines()[:3]
        assert "kv_producer" in prefill and prefill.endswith("&"), prefill
        reference = (
            re.sub(r" --kv-transfer-config '[^']*'", "", prefill.rstrip("& "))
            .replace("$PREFILL_PORT", "$REFERENCE_PORT")
            .replace("prefill.log", "reference.log")
            .replace("VLLM_CPU_OMP_THREADS_BIND=0", "VLLM_CPU_OMP_THREADS_BIND=1")  # decode's core: prefill is idle while decode runs
        )
        start = {"env": env, "cwd": logs, "start_new_session": True}
        self.reference = subprocess.Popen(["bash", "-c", f"{variables}\n{sizing}\n{reference}"], **start)  # type: ignore[call-overload]
        self._shell_log = (logs / "shell.log").open("w")
        self.shell = subprocess.Popen(  # type: ignore[call-overload]
            ["bash"], stdin=subprocess.PIPE, stdout=self._shell_log, stderr=subprocess.STDOUT, text=True, **start
        )
        self._say(self.serve + f"printf '\\n{DONE} %s\\n' $?\n")

    def _say(self, text: str) -> None:
        assert self.shell.stdin is not None
        self.shell.stdin.write(text)
        self.shell.stdin.flush()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait_ready(self) -> None:
        """Wait for the README's block to end (its wait and request run), then for the reference."""
        start = time.monotonic()
        while DONE not in self.log("shell"):
            if self.shell.poll() is not None or time.monotonic() - start > STARTUP_TIMEOUT:
                raise RuntimeError(f"the README's block did not finish:\n{self.log('shell')}\n{self.tails()}")
            time.sleep(1)
        while not self.healthy("reference"):
            if self.reference.poll() is not None or time.monotonic() - start > STARTUP_TIMEOUT:
                raise RuntimeError(f"the reference server did not start:\n{self.log('reference')[-4000:]}")
            time.sleep(1)
        self.example = self.log("shell").split(DONE, 1)[0]

    def healthy(self, name: str) -> bool:
        return healthy(self.url(name))

    def tails(self) -> str:
        return "\n".join(
            f"--- {name}.log:\n{self.log(name)[-3000:]}" for name in ("prefill", "decode", "proxy") if (self.logs / f"{name}.log").exists()
        )

    def close(self) -> None:
        """The README's stop line in its shell; every port must then close. Anything left is killed."""
        ports = [self.ports[name] for name in ("prefill", "decode", "proxy")]
        try:
            if self.shell.poll() is None:
                self._say(self.stop + "wait\nexit\n")
                self.shell.wait(90)
            deadline = time.monotonic() + 30
            while any(map(listening, ports)):
                assert time.monotonic() < deadline, f"the README's stop line left ports open: {[p for p in ports if listening(p)]}"
                time.sleep(0.5)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.reference.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.reference.wait(30)
            for proc in (self.shell, self.reference):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader: whatever is left
                proc.wait(10)
            self._shell_log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    model = readme_model(tmp_path_factory.mktemp("model"))
    started = time.monotonic()
    running = Servers(model, tmp_path_factory.mktemp("serve-logs"))
    try:
        running.wait_ready()
        print(f"\nvLLM serve start-up (README block with its request, and the reference): {time.monotonic() - started:.1f} s")
        yield running
    finally:
        running.close()


def client(servers: Servers, name: str) -> Any:
    return openai.OpenAI(base_url=servers.url(name) + "/v1", api_key="unused", timeout=120, max_retries=0)


def complete(servers: Servers, name: str, kind: str, stream: bool, prompt: str) -> str:
    """One request to server ``name``; the generated text (joined, if streamed)."""
    api = client(servers, name)
    model = api.models.list().data[0].id
    common: dict[str, Any] = {"model": model, "max_tokens": 10, "temperature": 0, "stream": stream, "extra_body": {"ignore_eos": True}}
    if kind == "completions":
        resp = api.completions.create(prompt=prompt, **common)
        return "".join(c.choices[0].text for c in resp) if stream else resp.choices[0].text
    resp = api.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in resp if c.choices)
    return resp.choices[0].message.content or ""


def wait_released(servers: Servers, before: int) -> None:
    deadline = time.monotonic() + 10
    while servers.log("prefill").count(RELEASED) == before:
        assert time.monotonic() < deadline, "prefill never released the request's blocks"
        time.sleep(0.2)


def test_readme_block_waits_then_answers_its_example_request(servers: Servers) -> None:
    output = servers.example
    assert "not ready" not in output and "exited" not in output, output
    answer = json.loads(output.strip().splitlines()[-1])  # curl's answer, after the wait's (silent) loop
    assert answer["object"] == "text_completion" and answer["model"] == str(servers.model)
    assert answer["choices"][0]["text"] and 1 <= answer["usage"]["completion_tokens"] <= 16
    assert servers.log("decode").count(PULLED) >= 1  # decode took the example's KV over hixl


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_proxy_text_equals_reference(servers: Servers, kind: str, stream: bool) -> None:
    prompt = words(45 if kind == "completions" else 30, offset=11 + stream)
    released_before = servers.log("prefill").count(RELEASED)
    pulled_before = servers.log("decode").count(PULLED)
    text = complete(servers, "proxy", kind, stream, prompt)
    assert text and text == complete(servers, "reference", kind, stream, prompt)
    assert servers.log("decode").count(PULLED) == pulled_before + 1  # decode took the KV over hixl
    wait_released(servers, released_before)


def test_proxy_passes_upstream_errors_through(servers: Servers) -> None:
    request = urllib.request.Request(
        servers.url("proxy") + "/v1/completions",
        data=json.dumps({"model": "no-such-model", "prompt": "w1", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 404


def scrape(servers: Servers, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``name``'s ``/metrics``: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(servers.url(name) + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of sample ``name`` over the label sets that have ``labels``; KeyError if there is none."""
    values = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    if not values:
        raise KeyError(f"no sample {name} {labels} in {sorted({n for n, _ in samples})}")
    return sum(values)


def test_metrics_agree_with_the_logs_and_the_proxy_counts_what_it_routed(servers: Servers) -> None:
    released_before = servers.log("prefill").count(RELEASED)
    assert complete(servers, "proxy", "completions", False, words(70, offset=3))  # 3 blocks; so there is one pull at least
    wait_released(servers, released_before)
    # vLLM moves the stats from the worker to /metrics with each step's output: give it a moment.
    deadline = time.monotonic() + 20
    while True:
        decode, prefill, proxy = scrape(servers, "decode"), scrape(servers, "prefill"), scrape(servers, "proxy")
        pulls = re.findall(r"pulled request \S+: (\d+) blocks, [\d.]+ MiB from \d+ prefill rank\(s\) in ([\d.]+) ms \(\w+\), first layer usable after ([\d.]+) ms", servers.log("decode"))
        released = servers.log("prefill").count(RELEASED)
        if total(decode, "vllm:hixl_pull_seconds_count") == len(pulls) and total(prefill, "vllm:hixl_released_requests_total") == released:
            break
        assert time.monotonic() < deadline, (len(pulls), released, {k: v for k, v in decode.items() if "hixl" in k[0]})
        time.sleep(0.5)
    layers, row_bytes = map(int, re.search(r"registered (\d+) layers x \d+ blocks \(\w+, (\d+) bytes a block\)", servers.log("decode")).groups())  # type: ignore[union-attr]
    model = {"model_name": str(servers.model)}
    assert total(decode, "vllm:hixl_pulled_bytes_total", **model) == sum(int(b) for b, _, _ in pulls) * layers * row_bytes > 0
    # The log rounds each time to 0.01 ms: the sums agree within that.
    assert abs(total(decode, "vllm:hixl_pull_seconds_sum") - sum(float(t) for _, t, _ in pulls) / 1e3) <= len(pulls) * 1e-5
    assert abs(total(decode, "vllm:hixl_first_layer_seconds_sum") - sum(float(f) for _, _, f in pulls) / 1e3) <= len(pulls) * 1e-5
    assert total(decode, "vllm:hixl_pull_seconds_bucket", le="+Inf") == len(pulls)
    assert total(decode, "vllm:hixl_failed_pulls_total") == servers.log("decode").count("hixl: pull of request") == 0
    assert total(prefill, "vllm:hixl_expired_requests_total") == servers.log("prefill").count("was not pulled within") == 0
    # Both roles have every series; each role's others stay at 0.
    assert total(prefill, "vllm:hixl_pulled_bytes_total") == total(prefill, "vllm:hixl_pull_seconds_count") == 0
    assert total(decode, "vllm:hixl_released_requests_total") == 0
    # The proxy: every request it routed went to prefill, then to decode, which pulled it once.
    routed = total(proxy, "hixl_proxy_requests_total", role="decode", outcome="ok")
    assert routed == total(proxy, "hixl_proxy_requests_total", role="prefill", outcome="ok") == len(pulls) == released
    assert total(proxy, "hixl_proxy_upstream_seconds_count", role="decode") == routed
    assert total(proxy, "hixl_proxy_requests_total", outcome="error") == 0
    # vLLM's own log summarises the same stats (every 10 s, for an interval with a pull).
    deadline = time.monotonic() + 20
    while not re.search(r"KV Transfer metrics: Num pulls=\d+, MiB pulled=", servers.log("decode")):
        assert time.monotonic() < deadline, "decode's log has no 'KV Transfer metrics' line"
        time.sleep(0.5)
