"""The README's "Serving with vLLM" block, and what running it as written needs (no vLLM imported here)."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
from pathlib import Path

from instances import ROOT


def _section_blocks() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Serving with vLLM", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 4, "the section has the install, tiny model, serving and stop blocks"
    return blocks


def readme_blocks() -> tuple[str, str]:
    """The README's serving block (the third of its section) and its stop block (the fourth)."""
    blocks = _section_blocks()
    return blocks[2], blocks[3]


def readme_model(folder: Path) -> Path:
    """The tiny model, built by the README's offline line (the section's second block) run in ``folder``."""
    line = _section_blocks()[1]
    built = subprocess.run(["bash", "-c", line + 'echo "$MODEL"'], cwd=folder, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return folder / built.stdout.strip().splitlines()[-1]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now: each stays bound until all are chosen. Chosen one at a
    time, the kernel handed out one just released twice: a prefill and a decode listened on it
    together (vLLM binds with SO_REUSEPORT), and the decode's requests reached the prefill."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def shims(folder: Path) -> Path:
    """``python3`` and ``hixl`` for the README's lines: this interpreter, and hixl from this checkout.

    Scripts, not symlinks: a venv's python reached through a link outside the venv's ``bin/`` does
    not find ``pyvenv.cfg``, so it runs as the base interpreter, without the venv's packages."""
    folder.mkdir()
    for name, command in (("python3", sys.executable), ("hixl", f"{sys.executable} -m hixl.cli")):
        (folder / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (folder / name).chmod(0o755)
    return folder
