"""hixl's C extension built a second time, with AddressSanitizer and UBSan, and the differential
fuzz (:mod:`tests.native.fuzz_main`) run on it in a child Python that loads it.

``python3 -m tests.native.sanitized [--rounds N] [--seed S] [--only NAME]`` (from the repository's
root) builds it in a temporary directory and fuzzes it, as the test does, with the fuzz's options.

The build uses the compiler and the shared-library link line this Python was built with
(``sysconfig``'s CC, CCSHARED and LDSHARED: what ``pip install`` uses through setup.py), with
``-O1 -g`` and the sanitizers in place of its optimisation flags — and without its ``-fwrapv``, so
UBSan checks signed overflow too. Python itself is not instrumented: the sanitizers' runtime is
preloaded into the process that imports the build, and PYTHONMALLOC=malloc hands every Python
allocation to it (a scratch bytearray overrun then lands in a red zone, not in pymalloc's pool).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "hixl" / "_accel" / "_native.c"
SANITIZERS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer")
BUILD_TIMEOUT_S = 240


class Unavailable(Exception):
    """This machine cannot build or load a sanitized extension (no compiler, headers or runtime)."""


def _compiler() -> list[str]:
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        raise Unavailable(f"no C compiler: {cc[0]!r} (sysconfig's CC) is not on PATH")
    return cc


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    if done.returncode:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{done.stderr}")


def build(into: Path) -> Path:
    """Compile and link the sanitized extension in ``into``; the module's path."""
    cc = _compiler()
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise Unavailable(f"no Python headers in {include}")
    obj, module = into / "_native.o", into / f"_native{sysconfig.get_config_var('EXT_SUFFIX')}"
    ccshared = shlex.split(sysconfig.get_config_var("CCSHARED") or "-fPIC")
    _run([*cc, *ccshared, "-O1", "-g", *SANITIZERS, "-I", include, "-c", str(SOURCE), "-o", str(obj)])
    ldshared = shlex.split(sysconfig.get_config_var("LDSHARED") or f"{cc[0]} -shared")
    _run([*ldshared, *SANITIZERS, str(obj), "-o", str(module)])
    return module


def runtime_env() -> dict[str, str]:
    """This process's environment plus what loads the sanitizers' runtime into a child Python.

    The runtime must come first in the process (LD_PRELOAD); leak checking is off (the
    interpreter keeps what it allocates until exit, by design); the first report ends the process.
    """
    cc = _compiler()
    asked = [cc[0], "-print-file-name=libasan.so"]
    found = subprocess.run(asked, capture_output=True, text=True, timeout=60, check=False).stdout.strip()
    if not os.path.isabs(found) or not os.path.exists(found):
        raise Unavailable(f"{cc[0]} has no AddressSanitizer runtime (libasan.so)")
    return {
        **os.environ,
        "LD_PRELOAD": found,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        "PYTHONMALLOC": "malloc",
        "HIXL_PURE_PYTHON": "1",  # (hixl must not load the other build of the extension)
    }


def fuzz(module: Path, *options: str, **run: object) -> subprocess.CompletedProcess[str]:
    """The fuzz of the built ``module`` with the sanitizers' runtime loaded (``options``: the
    fuzz's own; ``run``: for :func:`subprocess.run`)."""
    command = [sys.executable, "-m", "tests.native.fuzz_main", str(module), *options]
    return subprocess.run(command, cwd=ROOT, env=runtime_env(), text=True, check=False, **run)  # type: ignore[call-overload]


def main(options: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="hixl-sanitized-") as into:
        return fuzz(build(Path(into)), *options).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
