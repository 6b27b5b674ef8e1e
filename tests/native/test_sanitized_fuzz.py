"""The C extension, built again with AddressSanitizer and UBSan, fuzzed against its pure twin:
every entry point that takes a peer's bytes or lengths, on the seeds in ``seeds/`` and seeded
mutations of them (tests/native/fuzz_main.py). Passes only if no sanitizer reports anything and
the twins agree on every case: what each answered, what memory held after and what was left in
(or sent on) the socket.

Needs only a C compiler and Python's headers, as the install does; without them it is skipped,
or fails where HIXL_REQUIRE_NATIVE is set (as CI sets it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import sanitized
from .fuzz_main import TARGETS

FUZZ_TIMEOUT_S = 300

pytestmark = [pytest.mark.slow, pytest.mark.timeout(FUZZ_TIMEOUT_S + sanitized.BUILD_TIMEOUT_S)]


def test_the_sanitized_extension_agrees_with_its_twin_on_every_case(sanitized_build: Path) -> None:
    run = sanitized.fuzz(sanitized_build, capture_output=True, timeout=FUZZ_TIMEOUT_S)
    report = f"{run.stdout}\n{run.stderr[-12000:]}"
    assert run.returncode == 0, report
    assert run.stdout.startswith("AddressSanitizer: loaded"), report  # (a check, not a plain run)
    assert run.stdout.count("the twins agree") == len(TARGETS), report
