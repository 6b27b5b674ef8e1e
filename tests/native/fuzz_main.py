"""The differential fuzz of hixl's C extension: every entry point that takes a peer's bytes or
lengths, run on the seeds in ``tests/native/seeds/`` and on seeded mutations of them, the C twin
against the pure-Python one on the same input, memory and socket.

``python -m tests.native.fuzz_main EXTENSION [--rounds N] [--only NAME] [--seed S]`` (from the
repository's root) loads the extension built at the path EXTENSION — for the test, one built with
AddressSanitizer and UBSan, this process started with their runtime preloaded — and the pure twin
from this checkout (``HIXL_PURE_PYTHON=1`` keeps hixl from loading the other build). Each target
runs its seeds, then mutants up to N cases in all, the same ones every run for the same S. The
first disagreement is printed with its case (to add to the seeds once fixed), and the exit
status is 1; a sanitizer's finding ends the process with its report.

TcpSmall.run has no twin to compare with (the pure path is PeerLink.exchange); the steps in which
it reads a peer's bytes are the same C functions tcp_reply and tcp_land are made of.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import random
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from hixl._accel import pure

from .mutate import mutate
from .targets_copy import TARGETS as COPY_TARGETS
from .targets_hash import TARGETS as HASH_TARGETS
from .targets_tcp import TARGETS as TCP_TARGETS

SEEDS = Path(__file__).with_name("seeds")
TARGETS = TCP_TARGETS + COPY_TARGETS + HASH_TARGETS
ROUNDS = 8000
"""Cases per target by default: the whole fuzz, sanitized, in about a minute on 2 cores."""


def load(path: Path) -> ModuleType:
    """The extension module built at ``path``."""
    spec = importlib.util.spec_from_file_location("hixl._accel._native", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no extension module at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def asan_loaded() -> bool:
    """Whether AddressSanitizer's runtime is in this process (preloaded, as the test does)."""
    return hasattr(ctypes.CDLL(None), "__asan_init")


def seeds(name: str) -> list[dict[str, Any]]:
    """A target's seed cases (``seeds/<name>.json``: a list, one case a line)."""
    return json.loads((SEEDS / f"{name}.json").read_text())


def cases(name: str, rounds: int, seed: int) -> Iterator[dict[str, Any]]:
    """The seeds, then mutants of them (mostly of one generation, some up to four) up to ``rounds`` cases."""
    corpus = seeds(name)
    rng = random.Random(f"{name}/{seed}")
    for i in range(max(rounds, len(corpus))):
        if i < len(corpus):
            yield corpus[i]
            continue
        case = rng.choice(corpus)
        for _ in range(rng.choice((1, 1, 1, 1, 1, 1, 1, 2, 2, 4))):
            case = mutate(case, rng)
        yield case


def _differences(native: Any, twin: Any) -> str:
    """Where two outcomes part, briefly (memory as the first offset that differs per buffer)."""
    if isinstance(native, tuple) and isinstance(twin, tuple) and len(native) == len(twin):
        parts = [f"[{i}] {_differences(a, b)}" for i, (a, b) in enumerate(zip(native, twin)) if a != b]
        return "; ".join(parts)
    if isinstance(native, dict) and isinstance(twin, dict):
        parts = []
        for key in native:
            a, b = native[key], twin.get(key)
            if a != b and isinstance(a, bytes) and isinstance(b, bytes) and len(a) == len(b):
                at = next(i for i in range(len(a)) if a[i] != b[i])
                parts.append(f"{key} from byte {at}: C {a[at:at + 16].hex()} / pure {b[at:at + 16].hex()}")
            elif a != b:
                parts.append(f"{key}: C {a!r:.200} / pure {b!r:.200}")
        return "; ".join(parts)
    return f"C {native!r:.300} / pure {twin!r:.300}"


def fuzz(target: Any, native: ModuleType, rounds: int, seed: int) -> str | None:
    """Run a target's cases on both twins; the first disagreement, described, or None."""
    agree = getattr(target, "agree", None)
    for n, case in enumerate(cases(target.name, rounds, seed)):
        try:
            c = target.run(native, case)
            p = target.run(pure, case)
        except Exception:  # noqa: BLE001  (outside what either twin may raise: the case is a finding too)
            return f"case {n} raised:\n{traceback.format_exc()}case: {json.dumps(case)}"
        if not (agree(case, c, p) if agree is not None else c == p):
            return f"case {n}: the twins disagree: {_differences(c, p)}\ncase: {json.dumps(case)}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("extension", type=Path, help="the built extension module (.so) to check")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="cases per target (seeds included)")
    parser.add_argument("--only", action="append", help="run only this target (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="the mutations' seed")
    args = parser.parse_args(argv)
    native = load(args.extension)
    print(f"AddressSanitizer: {'loaded' if asan_loaded() else 'absent'}", flush=True)
    failed = False
    for kind in TARGETS:
        if args.only and kind.name not in args.only:
            continue
        target, started = kind(), time.monotonic()
        try:
            finding = fuzz(target, native, args.rounds, args.seed)
        finally:
            target.close()
        took = time.monotonic() - started
        if finding is not None:
            print(f"{kind.name}: FAILED after {took:.1f} s\n{finding}", flush=True)
            failed = True
        else:
            print(f"{kind.name}: {max(args.rounds, len(seeds(kind.name)))} cases, the twins agree ({took:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
