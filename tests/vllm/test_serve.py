"""The README's "Serving with vLLM" commands, run as written: two vLLM servers + ``hixl proxy``.

The commands are read from the README itself, with three substitutions: the
tiny local model for ``$MODEL``, free ports for the fixed ones, and test
sizing flags appended to each server's (later flags win). A plain vLLM
server of the same model is the reference. OpenAI-client requests through
the proxy — completions and chat, streamed and not — must give the
reference's text, and prefill must report each request's blocks released
after decode pulled them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
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
openai = pytest.importorskip("openai")

from instances import HERE, ROOT  # noqa: E402
from tiny_model import build, words  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STARTUP_TIMEOUT = 400.0
SERVER = "-m vllm.entrypoints.openai.api_server --model $MODEL"
TEST_FLAGS = "--dtype float32 --max-model-len 512 --block-size 32 --kv-cache-memory-bytes 64M --distributed-executor-backend uni"


def readme_commands() -> list[str]:
    """The README's serving block: the two vLLM server lines and the ``hixl proxy`` line."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Serving with vLLM", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    lines = [line.strip() for line in block.strip().splitlines()]
    return [line for line in lines if SERVER in line or line.startswith("hixl proxy")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Servers:
    """The README's processes plus a reference server, each in its own process group, logs in ``logs``."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.logs = logs
        self.ports = {name: free_port() for name in ("prefill", "decode", "proxy", "reference")}
        prefill, decode, proxy = readme_commands()
        swap = {"8100": self.ports["prefill"], "8200": self.ports["decode"], "8000": self.ports["proxy"]}

        def adapt(line: str) -> str:
            line = line.rstrip("&").strip().replace(SERVER, f"{SERVER} {TEST_FLAGS}")
            line = line.replace("python3 -m", f"{shlex.quote(sys.executable)} -m").replace("$MODEL", shlex.quote(str(model)))
            line = re.sub(r"\b(8100|8200|8000)\b", lambda m: str(swap[m.group(1)]), line)
            return line.replace("hixl proxy", f"{shlex.quote(sys.executable)} -m hixl.cli proxy")  # this checkout's hixl

        reference = re.sub(r"--kv-transfer-config '[^']*'", "", adapt(prefill)).replace(
            str(self.ports["prefill"]), str(self.ports["reference"])
        ).replace("VLLM_CPU_OMP_THREADS_BIND=0", "VLLM_CPU_OMP_THREADS_BIND=1")
        self.commands = {"prefill": adapt(prefill), "decode": adapt(decode), "proxy": adapt(proxy), "reference": reference}
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.procs = {
            name: subprocess.Popen(
                ["bash", "-c", f"exec env {cmd}" if cmd.startswith("VLLM_") else f"exec {cmd}"],
                stdout=(logs / f"{name}.log").open("w"),
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=HERE,
            )
            for name, cmd in self.commands.items()
        }

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait_healthy(self) -> dict[str, float]:
        """Poll each server's /health; returns seconds until each answered."""
        start, ready = time.monotonic(), {}
        while len(ready) < len(self.procs):
            for name, proc in self.procs.items():
                if name in ready:
                    continue
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)[-4000:]}")
                try:
                    with urllib.request.urlopen(self.url(name) + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            ready[name] = time.monotonic() - start
                except OSError:
                    pass
            if time.monotonic() - start > STARTUP_TIMEOUT:
                raise RuntimeError(f"not healthy after {STARTUP_TIMEOUT} s: {sorted(set(self.procs) - set(ready))}")
            time.sleep(1)
        return ready

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    model = build(tmp_path_factory.mktemp("model"))
    running = Servers(model, tmp_path_factory.mktemp("serve-logs"))
    try:
        print("\nvLLM serve start-up, s (all at once):", {k: round(v, 1) for k, v in running.wait_healthy().items()})
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


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_proxy_text_equals_reference(servers: Servers, kind: str, stream: bool) -> None:
    prompt = words(45 if kind == "completions" else 30, offset=11 + stream)
    released_before = servers.log("prefill").count("was pulled by decode; its blocks are released")
    pulled_before = servers.log("decode").count("hixl: pulled request")
    text = complete(servers, "proxy", kind, stream, prompt)
    assert text and text == complete(servers, "reference", kind, stream, prompt)
    assert servers.log("decode").count("hixl: pulled request") == pulled_before + 1  # decode took the KV over hixl
    deadline = time.monotonic() + 10
    while servers.log("prefill").count("was pulled by decode; its blocks are released") == released_before:
        assert time.monotonic() < deadline, "prefill never released the request's blocks"
        time.sleep(0.2)


def test_proxy_passes_upstream_errors_through(servers: Servers) -> None:
    request = urllib.request.Request(
        servers.url("proxy") + "/v1/completions",
        data=json.dumps({"model": "no-such-model", "prompt": "w1", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 404
