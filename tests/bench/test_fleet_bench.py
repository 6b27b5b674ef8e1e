"""``hixl bench --scenario fleet``: many real TCP peers of one target, in a small form (a few seconds).
These check that every figure is there and sane, never speed."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from hixl.bench.cli import main

pytestmark = pytest.mark.timeout(120)

ROWS = {
    "target threads, 24 peers connected",
    "target RSS growth, 24 peers connected",
    "target idle CPU, 24 idle peers",
    "register_mem, 24 peers connected",
    "deregister_mem, 24 peers connected",
    "8 B READ transfer_sync, 24 peers connected",
    "6 peers reading 1 MiB at once, aggregate",
    "6 peers reading at once, slowest share",
}


def test_the_fleet_scenario_reports_every_figure(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["--scenario", "fleet", "--quick", "--peers", "24", "--peer-processes", "3", "--readers", "6"]
        assert main([*argv, "--no-progress", "--json", str(path)]) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    assert set(rows) == ROWS
    assert rows["target threads, 24 peers connected"]["value"] >= 1
    for name in ("register_mem, 24 peers connected", "8 B READ transfer_sync, 24 peers connected"):
        assert rows[name]["value"] > 0
    for name in ("8 B READ transfer_sync, 24 peers connected", "6 peers reading 1 MiB at once, aggregate"):
        assert rows[name]["baseline"] > 0 and rows[name]["ratio"] > 0  # measured against one peer, same run
    assert 0 < rows["6 peers reading at once, slowest share"]["ratio"] <= 1
    assert "24 TCP peers from 3 processes" in out.getvalue()
