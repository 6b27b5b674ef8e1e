"""Unit tests of the bench's pieces that need no processes: sizes, rows, targets, table, JSON, progress."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from hixl.bench.config import BenchConfig, format_size, parse_size
from hixl.bench.progress import Progress
from hixl.bench.report import failed, format_number, format_table, summary, to_json, write_json
from hixl.bench.results import Row, Target, median, percentile
from hixl.bench.timing import interleaved_latency


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("64K", 64 << 10),
        ("64kib", 64 << 10),
        ("16M", 16 << 20),
        ("512MiB", 512 << 20),
        (" 1 G ", 1 << 30),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "0", "-4K", "4X", "1.5M", "M"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [(8, "8 B"), (4096, "4 KiB"), (4097, "4097 B"), (64 << 20, "64 MiB"), (512 << 20, "512 MiB"), (2 << 30, "2 GiB")],
)
def test_format_size(nbytes: int, expected: str) -> None:
    assert format_size(nbytes) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "-"),
        (0.0, "0.000"),
        (0.00012, "0.0001"),
        (0.0512, "0.051"),
        (1.234, "1.23"),
        (12.34, "12.3"),
        (1234.5, "1234"),
    ],
)
def test_format_number(value: float | None, expected: str) -> None:
    assert format_number(value) == expected


def test_capped_config_drops_larger_sizes_and_shrinks_buffers() -> None:
    config = BenchConfig.full_run().capped(16 << 20)
    assert config.sizes == (4 << 10, 64 << 10, 1 << 20, 16 << 20)
    assert config.rss_size == config.align_size == 16 << 20
    assert config.batch_blocks * config.batch_block_size <= 16 << 20
    assert config.latency_sizes == BenchConfig.full_run().latency_sizes
    assert BenchConfig.full_run().capped(1000).sizes == (1000,)


def test_quick_config_is_small() -> None:
    quick = BenchConfig.quick_run()
    assert quick.quick and max(quick.sizes) <= 1 << 20 and quick.idle_seconds < 1


def test_median_and_percentile() -> None:
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 2, 3]) == 2.5
    assert percentile(list(range(101)), 99) == 99
    assert percentile([5], 99) == 5
    with pytest.raises(ValueError):
        median([])


def test_targets() -> None:
    assert Target(">=", 0.9).met_by(1.0, 0.95) is True
    assert Target(">=", 0.9).met_by(1.0, 0.85) is False
    assert Target("<=", 1.5).met_by(99.0, 1.5) is True
    assert Target("<", 1.0, on="value").met_by(1.0, None) is False
    assert Target("<", 1.0, on="value").met_by(0.3, None) is True
    assert Target(">=", 0.9).met_by(1.0, None) is None
    assert str(Target(">=", 0.85)) == ">=0.85x"
    assert str(Target("<", 16, on="value")) == "<16"
    with pytest.raises(ValueError):
        Target("==", 1)


def _rows() -> list[Row]:
    return [
        Row("memcpy", "local", "copy", 64 << 20, 11.0, "GiB/s", note="reference"),
        Row("bandwidth", "cma", "READ", 1 << 20, 9.0, "GiB/s", 10.0, "process_vm_readv", Target(">=", 0.9)),
        Row("bandwidth", "cma", "READ", 4 << 10, 0.05, "GiB/s", 1.0, "process_vm_readv"),
        Row("latency median", "cma", "WRITE", 8, 60.0, "us", 3.0, "process_vm_writev (1 call)", Target("<=", 1.5)),
        Row("idle cpu target", "tcp", "idle", None, 0.04, "% core", target=Target("<", 1.0, on="value")),
    ]


def test_row_ratio_and_pass() -> None:
    rows = _rows()
    assert rows[0].ratio is None and rows[0].passed is None
    assert rows[1].ratio == pytest.approx(0.9) and rows[1].passed is True
    assert rows[2].passed is None
    assert rows[3].ratio == pytest.approx(20.0) and rows[3].passed is False
    assert rows[4].passed is True
    assert Row("x", "cma", "READ", 1, 1.0, "GiB/s", baseline=0.0).ratio is None


def test_row_json_has_the_documented_fields() -> None:
    doc = _rows()[1].to_json()
    for key in ("name", "transport", "op", "size", "value", "unit", "baseline", "ratio", "target", "pass"):
        assert key in doc
    assert doc["target"]["text"] == ">=0.9x" and doc["pass"] is True
    assert Row("x", "cma", "READ", 1, math.inf, "GiB/s").to_json()["value"] is None


def test_table_lines_up_and_marks_targets() -> None:
    table = format_table(_rows())
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["figure", "transport", "op"]
    assert set(lines[1]) <= {"-", " "}
    assert "PASS" in table and "FAIL" in table and "0.90x" in table and "20.00x" in table
    assert "vs process_vm_readv" in table and "4 KiB" in table and "64 MiB" in table
    assert "" in lines  # blank line between the local, cma and tcp groups
    data = [line for line in lines[2:] if line]
    # Every data line starts with its figure name in the first column.
    assert [line.split("  ")[0].strip() for line in data] == [r.name for r in _rows()]


def test_summary_names_failures() -> None:
    text = summary(_rows())
    assert text.startswith("targets: 2 PASS, 1 FAIL")
    assert "cma latency median WRITE 8 B" in text
    assert summary(_rows()[:1]) == "targets: 0 PASS, 0 FAIL"


def test_smoke_rows_judge_only_targets_that_hold_at_any_size() -> None:
    smoke = [replace(row, smoke=True) for row in _rows()]
    assert smoke[1].target is not None and smoke[1].passed is None and not smoke[1].judged  # a ratio target
    assert smoke[3].passed is None  # missed, but a smoke run does not judge it
    absolute = replace(smoke[4], target=Target("<", 1.0, on="value", in_smoke=True))
    assert absolute.judged and absolute.passed is True
    assert failed(smoke) == [] and failed(_rows()) == [_rows()[3]]
    table = format_table([*smoke, absolute])
    assert "FAIL" not in table and "smoke" in table and "PASS" in table
    text = summary([*smoke, absolute])
    assert text.startswith("targets: 1 PASS, 0 FAIL, 3 not judged")
    assert "run without --quick" in text
    assert smoke[1].to_json()["smoke"] is True and smoke[1].to_json()["pass"] is None


def test_json_document_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    write_json(str(path), to_json(_rows(), BenchConfig.quick_run(), ["engine"], ["a note"], 1.5))
    doc = json.loads(path.read_text())
    assert doc["scenarios"] == ["engine"] and doc["notes"] == ["a note"] and doc["elapsed_s"] == 1.5
    assert doc["config"]["quick"] is True
    assert [r["name"] for r in doc["rows"]] == [r.name for r in _rows()]


def test_progress_draws_and_erases_on_a_tty() -> None:
    stream = io.StringIO()
    progress = Progress(stream, enabled=True, width=10)
    progress.expect(4)
    with progress.step("cma READ 64 MiB"):
        pass
    assert progress.render("x") == "[##........] 1/4 x"
    assert "\r[..........] 0/4 cma READ 64 MiB" in stream.getvalue()
    assert "\r[##........] 1/4 cma READ 64 MiB" in stream.getvalue()
    progress.skip(3)
    assert progress.render("done") == "[##########] 4/4 done"
    progress.close()
    assert stream.getvalue().endswith("\r")


def test_progress_is_silent_off_a_tty() -> None:
    stream = io.StringIO()  # not a TTY
    progress = Progress(stream)
    assert not progress.enabled
    progress.expect(1)
    with progress.step("anything"):
        pass
    progress.close()
    assert stream.getvalue() == ""
    assert progress.done == 1


def test_progress_counts_a_failed_step() -> None:
    progress = Progress(io.StringIO(), enabled=False)
    progress.expect(2)
    with pytest.raises(RuntimeError), progress.step("boom"):
        raise RuntimeError("boom")
    assert progress.done == 1


def test_latency_contenders_alternate_in_bursts_whose_first_call_is_not_timed() -> None:
    calls: list[str] = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in ("hixl", "raw")}
    samples = interleaved_latency(contenders, iterations=7, warmup=2, burst=4)
    assert {name: len(s) for name, s in samples.items()} == {"hixl": 7, "raw": 7}
    # warm-up, then bursts of 4 (1 untimed + 3 timed), who goes first alternating, the last burst cut short
    h, r = ["hixl"], ["raw"]
    assert calls == 2 * h + 2 * r + 4 * h + 4 * r + 4 * r + 4 * h + 2 * h + 2 * r
    with pytest.raises(ValueError, match="at least 2 calls"):
        interleaved_latency(contenders, iterations=1, warmup=0, burst=1)
