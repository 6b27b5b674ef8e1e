"""Offline vLLM instances in child processes (:mod:`instance_main`), for the end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MARK = "@@answer "
STARTUP_TIMEOUT = 300.0


class Instance:
    """``python instance_main.py ROLE MODEL SETTINGS``; its log (stderr) goes to ``log_path``.

    ``cpu`` is the core vLLM binds its OpenMP threads to: two instances running
    at once must not share one (both would take core 0). A tensor-parallel
    instance binds each rank to its own: ``"0|1"`` (vLLM's list, one entry per rank).
    """

    def __init__(self, role: str, model: Path, log_path: Path, cpu: int | str, settings: dict[str, Any] | None = None) -> None:
        self.role = role
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]), VLLM_CPU_OMP_THREADS_BIND=str(cpu))
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "instance_main.py"), role, str(model), json.dumps(settings or {})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.startup_s: float | None = None

    def wait_ready(self) -> Instance:
        """Block until the engine is up; returns self."""
        self.startup_s = self._answer()["startup_s"]
        return self

    def generate(self, prompts: list[str], max_tokens: int, params: list[dict | None] | None = None) -> list[dict[str, Any]]:
        """Run ``LLM.generate`` there; one dict per prompt (see :mod:`instance_main`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "params": params}) + "\n")
        self.proc.stdin.flush()
        return self._answer()  # type: ignore[no-any-return]

    def _answer(self) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"{self.role} instance exited ({self.proc.wait()}); log tail:\n{self.log_tail()}")

    def log(self) -> str:
        """Everything the instance logged so far."""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the log."""
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_for_log(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait until a log line matches ``pattern``; ``AssertionError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.log())
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.role}: no log line matching {pattern!r} in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def close(self) -> None:
        """End the instance (EOF on stdin, then kill if it lingers) and every process it started."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def prefill_params(prefill: Instance, prompts: list[str]) -> list[dict[str, Any]]:
    """Prefill ``prompts`` on ``prefill`` for remote decode; returns the kv_transfer_params decode needs."""
    outs = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in outs]
    for p in params:
        # vLLM reports prefill's own cache hits through this key as decode's cached tokens;
        # without it, decode's count is what *it* did not compute: the connector's tokens.
        p.pop("remote_prefill_cached_tokens", None)
    return params


@contextlib.contextmanager
def started_together(model: Path, logs: Path, specs: dict[str, tuple[str, int | str, dict[str, Any]]]) -> Iterator[dict[str, Instance]]:
    """Start every instance of ``specs`` (name -> role, cpu, settings) at once, wait for all, close all after.

    All at once because each takes tens of seconds to start; the start-up times are printed.
    """
    started = {name: Instance(role, model, logs / f"{name}.log", cpu, settings) for name, (role, cpu, settings) in specs.items()}
    try:
        for instance in started.values():
            instance.wait_ready()
        print(f"\nvLLM start-up (all {len(started)} starting at once):", {n: round(i.startup_s or 0, 1) for n, i in started.items()})
        yield started
    finally:
        for instance in started.values():
            instance.close()
