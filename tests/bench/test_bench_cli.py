"""``hixl bench --quick`` end to end: every expected row, with positive figures, in the table and the JSON.

These run the real benchmark (a child process, both transports) in its quick
form, which takes a few seconds. They check shape, never speed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hixl.bench.cli import main
from hixl.bench.config import BenchConfig

ROOT = Path(__file__).resolve().parents[2]
QUICK = BenchConfig.quick_run()

pytestmark = pytest.mark.timeout(90)


def _expected_rows(transports: list[str]) -> set[tuple[str, str, str, int | None]]:
    """(name, transport, op, size) of every row a quick run must report."""
    expected: set[tuple[str, str, str, int | None]] = {("memcpy", "local", "copy", QUICK.align_size)}
    expected |= {(f"misaligned {c}", "local", "copy", QUICK.align_size) for c in ("src", "dst")}
    for t in transports:
        expected |= {(f"rss growth {side}", t, "READ+WRITE", QUICK.rss_size) for side in ("initiator", "target")}
        expected |= {(f"idle cpu {side}", t, "idle", None) for side in ("initiator", "target")}
        for op in ("READ", "WRITE"):
            expected |= {("bandwidth", t, op, size) for size in QUICK.sizes}
            expected |= {(f"latency {s}", t, op, size) for s in ("median", "p99") for size in QUICK.latency_sizes}
            expected.add(("batch", t, op, QUICK.batch_blocks * QUICK.batch_block_size))
        if t == "cma":
            expected |= {(f"misaligned {c}", t, "READ", QUICK.align_size) for c in ("src", "dst")}
    return expected


def _measured(doc: dict[str, Any], wanted: list[str]) -> list[str]:
    """The transports the run could use (cma is skipped, with a note, where ptrace is not allowed)."""
    skipped = {t for t in wanted for note in doc["notes"] if note.startswith(f"{t}: skipped")}
    return [t for t in wanted if t not in skipped]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    path = tmp_path_factory.mktemp("bench") / "quick.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--quick", "--no-progress", "--json", str(path)]) == 0
    return json.loads(path.read_text()), out.getvalue()


def test_json_has_every_expected_row(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick_run
    transports = _measured(doc, ["cma", "tcp"])
    assert "tcp" in transports  # TCP needs nothing special: it must always run
    got = [(r["name"], r["transport"], r["op"], r["size"]) for r in doc["rows"]]
    assert len(got) == len(set(got)), "duplicate rows"
    assert set(got) == _expected_rows(transports)


def test_figures_and_ratios_are_positive(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick_run
    for row in doc["rows"]:
        may_be_zero = row["name"].startswith(("rss growth", "idle cpu"))
        assert row["value"] is not None, row
        assert row["value"] >= 0 if may_be_zero else row["value"] > 0, row
        if row["baseline"] is not None:
            assert row["baseline"] > 0 and row["ratio"] > 0, row
            assert row["ratio"] == pytest.approx(row["value"] / row["baseline"])
        if row["target"] is not None:
            assert isinstance(row["pass"], bool), row
        else:
            assert row["pass"] is None, row
        assert row["unit"] and row["scenario"] == "engine"


def test_targets_are_attached_where_the_issue_sets_them(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick_run
    targets = {(r["name"], r["transport"], r["op"], r["size"]): r["target"] for r in doc["rows"]}
    if "cma" in _measured(doc, ["cma", "tcp"]):
        assert targets[("bandwidth", "cma", "READ", 1 << 20)]["text"] == ">=0.9x"
        assert targets[("bandwidth", "cma", "READ", 4 << 10)] is None
        assert targets[("batch", "cma", "WRITE", QUICK.batch_blocks * QUICK.batch_block_size)]["text"] == ">=0.85x"
        assert targets[("latency median", "cma", "READ", 8)]["text"] == "<=1.5x"
    assert targets[("idle cpu initiator", "tcp", "idle", None)]["text"] == "<1"
    assert targets[("rss growth target", "tcp", "READ+WRITE", QUICK.rss_size)]["text"] == "<16"


def test_table_is_printed(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, text = quick_run
    assert text.startswith("hixl bench: scenario engine; transports cma,tcp")
    assert "figure" in text and "bandwidth" in text and "latency median" in text and "batch" in text
    assert "targets:" in text and "total" in text
    table_lines = [line for line in text.splitlines() if line.startswith(("bandwidth", "latency", "batch", "idle"))]
    assert len(table_lines) == sum(
        1 for r in doc["rows"] if r["name"].startswith(("bandwidth", "latency", "batch", "idle"))
    )


def _run_module(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=80, check=False
    )


def test_python_dash_m_runs_one_transport_with_json_on_stdout() -> None:
    proc = _run_module("-m", "hixl.bench", "--quick", "--transport", "tcp", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # stdout carries only the JSON; the table went to stderr
    assert {r["transport"] for r in doc["rows"]} == {"local", "tcp"}
    assert "figure" in proc.stderr
    assert "[" not in proc.stderr.splitlines()[0]  # no progress bar: stderr is not a TTY


def test_bad_options_are_refused() -> None:
    for args in (["--transport", "rdma"], ["--scenario", "nope"], ["--max-size", "lots"], ["--repeat", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 2


@pytest.mark.skipif(importlib.util.find_spec("hixl.demo.cli") is None, reason="hixl.cli also needs hixl.demo.cli")
def test_hixl_command_has_bench() -> None:
    proc = _run_module("-m", "hixl.cli", "bench", "--quick", "--transport", "tcp", "--no-progress", "--max-size", "64K")
    assert proc.returncode == 0, proc.stderr
    assert (
        "bandwidth" in proc.stdout and "64 KiB" in proc.stdout and "1 MiB" not in proc.stdout.split("bandwidth", 1)[1]
    )
