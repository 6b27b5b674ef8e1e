"""The builds the tests here check: the C extension as installed, and a second build of it with
the sanitizers. Where one cannot be had the test is skipped — or fails, where HIXL_REQUIRE_NATIVE
is set (as CI sets it): there the C must be checked, not quietly left out."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

from . import sanitized

REQUIRE_NATIVE = "HIXL_REQUIRE_NATIVE"


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get(REQUIRE_NATIVE):
        pytest.fail(f"{REQUIRE_NATIVE} is set but {reason}")
    pytest.skip(reason)


@pytest.fixture
def native() -> ModuleType:
    """hixl's C extension, as built by the install."""
    try:
        from hixl._accel import _native
    except ImportError as exc:
        _unavailable(f"the C extension is not built: {exc}")
    return _native


@pytest.fixture
def sanitized_build(tmp_path: Path) -> Path:
    """The extension built again with AddressSanitizer and UBSan, its runtime at hand."""
    try:
        sanitized.runtime_env()
        return sanitized.build(tmp_path)
    except sanitized.Unavailable as exc:
        _unavailable(f"the sanitized build cannot be made: {exc}")
