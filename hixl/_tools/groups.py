"""Stopping the process groups a bench or test started (vLLM servers, proxies: each its own session)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable

__all__ = ["stop_groups"]


def stop_groups(procs: Iterable[subprocess.Popen[bytes]], grace: float = 30.0) -> None:
    """SIGTERM each process's group (after a SIGCONT: a stopped one must see it too), then SIGKILL
    the groups of those not gone after ``grace`` seconds."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
