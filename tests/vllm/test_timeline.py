"""The timeline's pieces without vLLM: off unless asked for, its records, and where a median request's time goes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hixl.vllm._timeline import ENV, Timeline, Trace, phases


def test_off_by_default_on_at_debug_or_with_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    log = logging.getLogger("vllm.hixl.test_timeline")
    monkeypatch.delenv(ENV, raising=False)
    log.setLevel(logging.INFO)
    assert Timeline.open(log) is None
    log.setLevel(logging.DEBUG)
    on = Timeline.open(log)
    assert on is not None and on.path is None
    log.setLevel(logging.INFO)
    monkeypatch.setenv(ENV, str(tmp_path / "t.jsonl"))
    on = Timeline.open(log)
    assert on is not None and on.path == str(tmp_path / "t.jsonl")


def test_a_trace_is_one_json_line_and_its_phases_add_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("vllm.hixl.test_timeline")
    log.setLevel(logging.DEBUG)
    timeline = Timeline(log, str(tmp_path / "t.jsonl"))
    trace = Trace("hixl", "r1", 0, 10.0, "layerwise", 2**20, issued=10.001)
    trace.asked(0, 10.002, 10.0035)  # layer 0 landed after vLLM asked: 1 ms waiting for the copy, 0.5 for the interpreter
    trace.asked(1, 10.004, 10.0041)  # layer 1 had landed before: 0.1 ms to notice
    trace.landed([10.003, 10.0035])
    trace.step_end, trace.sync_ref = 10.006, 0.0004
    with caplog.at_level(logging.DEBUG, log.name):
        timeline.write(trace)
    assert "hixl: timeline of request r1 decode rank 0 (layerwise, 1.00 MiB, ok)" in caplog.text
    assert "layer 0 landed +3.000 asked +2.000 noticed +3.500" in caplog.text
    (record,) = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert record["usable"] == 10.0035 and record["layers"][1] == [10.0035, 10.004, 10.0041]
    found = phases([record, record | {"start": 9.999}])
    expected = {
        "issued": 1.5, "first layer landed": 3.5, "usable": 4.0, "vLLM first asked": 2.5, "waiting for the copy": 1.0,
        "waiting for the interpreter": 0.6, "step end": 6.5, "sync_ref": 0.4,
    }  # fmt: skip
    assert found == pytest.approx(expected, abs=1e-6)
    # NIXL's records have only the ends: only the phases they can show.
    assert phases([{"start": 1.0, "usable": 1.002}]) == pytest.approx({"usable": 2.0})
