"""The ``hixl`` command itself: version, help texts a newcomer can read, ``python -m hixl``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hixl

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(60)


def _hixl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m hixl ARGS`` from this checkout, as a newcomer would run ``hixl ARGS`` (``env``:
    extra environment variables)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "hixl", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=50
    )


def test_version_names_the_hot_path_in_use() -> None:
    proc = _hixl("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"hixl {hixl.__version__}; hot path: {hixl._accel.IMPLEMENTATION}"
    pure = _hixl("--version", env={"HIXL_PURE_PYTHON": "1"})
    assert pure.stdout.strip() == f"hixl {hixl.__version__}; hot path: pure Python (HIXL_PURE_PYTHON=1)"


@pytest.mark.parametrize("command", [[], ["bench"], ["demo"], ["proxy"]], ids=["hixl", "bench", "demo", "proxy"])
def test_help_is_plain_text_with_a_description(command: list[str]) -> None:
    proc = _hixl(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "``" not in text and ":mod:" not in text and ":class:" not in text  # no reStructuredText
    usage, description = text.split("\n\n", 2)[:2]
    assert usage.startswith(f"usage: hixl {' '.join(command)}".rstrip())
    assert len(description.split()) >= 10, "a description says what the command does"


def test_top_level_help_lists_the_commands() -> None:
    text = _hixl("--help").stdout
    assert "hixl demo" in text and "hixl bench" in text and "--version" in text


@pytest.mark.parametrize(
    ("command", "defaults"),
    [
        (["demo"], ["(default: 32)", "(default: 512)", "(default: 4)", "(default: 16)", "(default: auto)",
                    "(default: pull)", "(default: 0)"]),
        (["bench"], ["(default: engine)", "(default: engine, weights, ps cma,shm,tcp; kv, kv-vllm, soak cma,tcp)", "(default: 512M; --quick: 1M)",
                     "(default: 5; --quick: 2)", "(default: 2000; --quick: 50)"]),
    ],
    ids=["demo", "bench"],
)
def test_help_shows_defaults(command: list[str], defaults: list[str]) -> None:
    text = " ".join(_hixl(*command, "--help").stdout.split())  # argparse wraps lines anywhere
    for default in defaults:
        assert default in text


def test_help_says_targets_are_not_enforced_without_check() -> None:
    text = " ".join(_hixl("bench", "--help").stdout.split())
    assert "Targets are reported, not enforced" in text and "--check" in text


def test_no_command_is_a_usage_error() -> None:
    proc = _hixl()
    assert proc.returncode == 2
    assert "usage: hixl" in proc.stderr
