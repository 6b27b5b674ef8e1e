"""The README's serving block gives up at once, with the logs' tails, when a server dies at start.

Its readiness loop once waited the full 10 minutes for servers that had exited in their first
second. Here ``python3`` (both vLLM servers) is a stand-in that fails as a server with a model it
cannot load does, and ``hixl`` (the proxy) one that stays up: the block must report the exit
within seconds, show the failing server's log, and the README's stop line must end what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from readme_serving import free_ports, readme_blocks

pytestmark = pytest.mark.timeout(120)

DONE = "@@block-done"


def stand_in(folder: Path, name: str, body: str) -> None:
    (folder / name).write_text(f"#!/bin/sh\n{body}\n")
    (folder / name).chmod(0o755)


def test_a_server_that_exits_at_start_ends_the_wait_with_its_log(tmp_path: Path) -> None:
    serve, stop = readme_blocks()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "python3", 'echo "OSError: no-such-model is not a local folder" >&2; exit 1')
    stand_in(bin_dir, "hixl", "exec sleep 300")
    prefill, decode, proxy = free_ports(3)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", MODEL="no-such-model",
               PREFILL_PORT=str(prefill), DECODE_PORT=str(decode), PROXY_PORT=str(proxy))
    shell = subprocess.Popen(["bash"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd=tmp_path, env=env, start_new_session=True)
    try:  # the loop looks every second: 60 s is ten times what it needs, and far from its 10 minutes
        out, _ = shell.communicate(serve + f"echo {DONE}\n" + stop + "wait\n", timeout=60)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    assert DONE in out, out
    waited = out.split(DONE, 1)[0]
    assert "a server exited" in waited and "not ready" not in waited, waited
    assert "==> prefill.log <==" in waited and "no-such-model is not a local folder" in waited, waited
    assert shell.returncode == 0, out  # the stop line found the proxy still running and ended it
