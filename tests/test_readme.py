"""The README works as written: its commands match CI, and its quick start prints what it says."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.timeout(60)


def test_first_block_is_the_two_commands_and_the_second_is_ci() -> None:
    first = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in first.splitlines()]
    # The CPU index: from PyPI alone, torch==2.13.0 is the CUDA build (gigabytes a CPU machine does not use).
    venv, demo, tests = commands
    assert venv == "python3 -m venv .venv && . .venv/bin/activate"  # what a newcomer on Debian needs first
    assert demo == "pip install '.[demo]' --extra-index-url https://download.pytorch.org/whl/cpu && hixl demo"
    tools = (ROOT / "docs" / "tools.md").read_text().split("```bash\n", 1)[1].splitlines()[0]
    assert tools.split("#", 1)[0].strip() == demo  # the same first command in docs/tools.md
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith(("python3 -m venv", "pip install"))]
    assert ci == [venv, tests]  # CI runs the tests as a newcomer does: in a fresh virtualenv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_quick_start_prints_what_the_readme_says(tmp_path: Path) -> None:
    target, initiator = re.findall(r"```python\n(.*?)```", README, re.S)[:2]
    port = str(_free_port())  # not 5000: other tests and programs may hold it
    # The target's 10 s as written: a loaded machine may need seconds to start the initiator.
    (tmp_path / "target.py").write_text(target.replace("5000", port))
    (tmp_path / "initiator.py").write_text(initiator.replace("5000", port))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = {"cwd": tmp_path, "env": env, "capture_output": True, "text": True}
    with subprocess.Popen([sys.executable, "target.py"], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env) as t:
        try:
            deadline = time.monotonic() + 20
            while not _listening(int(port)):  # start the target first
                assert time.monotonic() < deadline and t.poll() is None, "the target did not start listening"
                time.sleep(0.05)
            proc = subprocess.run([sys.executable, "initiator.py"], timeout=30, **run)  # type: ignore[call-overload]
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout == "read 1048576 bytes, all 42\n"
            out, _ = t.communicate(timeout=30)
        finally:
            t.kill()
    assert t.returncode == 0
    assert out == "[NotifyDesc(name='done', msg='read 1 MiB')]\n"
    assert "read 1048576 bytes, all 42" in README and "[NotifyDesc(name='done', msg='read 1 MiB')]" in README


def test_pictures_exist_are_small_and_say_how_to_regenerate_them() -> None:
    pictures = re.findall(r"!\[[^\]]*\]\((docs/img/[^)]+\.png)\)", README)
    assert pictures == ["docs/img/demo.png", "docs/img/bench.png"]
    for picture in pictures:
        data = (ROOT / picture).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 100_000, picture
        assert f"--plot {picture}" in README  # the command that regenerates it
