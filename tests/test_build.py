"""``pip`` builds hixl from its source with the C hot path where a compiler works, and without it —
the install going on, hixl moving bytes on the pure-Python twin — where none does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)

# An engine pair in one process: a READ on the latency path (the one hixl._accel serves).
_SMOKE = """
import numpy as np, hixl
from hixl import _accel
target, initiator = hixl.Engine("127.0.0.1:0"), hixl.Engine("127.0.0.1")
there, here = hixl.empty(64), hixl.empty(64)
there[:] = 7
target.register_mem(there); initiator.register_mem(here)
initiator.connect(target.local_engine)
initiator.transfer_sync(target.local_engine, hixl.Op.READ, [(int(here.ctypes.data), int(there.ctypes.data), 64)])
assert (here == 7).all()
initiator.finalize(); target.finalize()
print(_accel.IMPLEMENTATION)
"""


def _sources(into: Path) -> Path:
    """The tracked files of this checkout, copied (a build writes build/ next to its sources)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    return into


def _wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    src = _sources(tmp_path / "src")
    out = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        env={**os.environ, **env},
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = out.glob("hixl-*.whl")
    return wheel


def _run_installed(tmp_path: Path, wheel: Path) -> str:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)  # what pip install puts in site-packages
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("HIXL_PURE_PYTHON", None)
    proc = subprocess.run([sys.executable, "-c", _SMOKE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _native_in(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return [n for n in archive.namelist() if n.startswith("hixl/_accel/_native") and n.endswith(".so")]


def test_a_build_with_a_compiler_has_the_extension_and_uses_it(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, {})
    assert _native_in(wheel)
    assert _run_installed(tmp_path, wheel) == "native (C extension)"


def test_a_build_without_a_compiler_installs_and_runs_on_the_pure_path(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, {"CC": "false"})  # every compile fails, as on a machine without gcc
    assert not _native_in(wheel)
    assert _run_installed(tmp_path, wheel).startswith("pure Python (the C extension is not available")
