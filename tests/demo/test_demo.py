"""``hixl demo`` end to end: three real processes, real transfers, tokens equal to colocated."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hixl.demo.report import format_report  # noqa: E402
from hixl.demo.run import DemoConfig, run_demo  # noqa: E402
from hixl.testing.hosts import skip_unless_hosts  # noqa: E402

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
#: The table's rows, in the order the request lives them (colocated and disaggregated columns).
ROWS = [
    "prefill compute",
    "time to first token",
    "KV transfer",
    "first layer landed",
    "decode starts layer 0",
    "time to second token",
    "total",
]


@pytest.mark.timeout(180)
# Each run starts two torch processes (seconds each): cover both modes and both transports in two.
@pytest.mark.parametrize(("mode", "transport"), [("pull", "tcp"), ("push", "cma")])
def test_disaggregated_tokens_equal_colocated(mode: str, transport: str, docs_sample: Any) -> None:
    result = run_demo(DemoConfig(tokens=6, prompt_len=40, layers=2, block_size=8, transport=transport, mode=mode))
    assert result["transport"] == transport
    assert result["colocated_matches_reference"]
    assert result["tokens"] == result["reference"]
    assert result["identical"]
    assert result["completion_notified"]
    dis = result["disaggregated"]
    assert len(dis["layers_landed"]) == 2
    assert dis["layers_landed"] == sorted(dis["layers_landed"])  # layer 0 lands first
    report = format_report(result)
    assert "tokens identical to colocated generation: YES (6/6)" in report
    command = "hixl demo" if mode == "pull" else "hixl demo --mode push"
    assert docs_sample.missing(docs_sample.lines("tools.md", command), report) == []
    timeline = result["timeline"]["disaggregated"]
    assert len(timeline["layer_done"]) == len(timeline["landed"]) == len(timeline["decode_layers"]) == 2
    assert timeline["ttft"] <= timeline["decode_layers"][0] <= timeline["t2"]  # first token, then decode


@pytest.mark.timeout(180)
def test_prefill_and_decode_on_two_hosts_move_the_cache_over_a_network() -> None:
    """--hosts: each worker in network and PID namespaces of its own; the cache crosses the bridge (TCP)."""
    skip_unless_hosts()
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    result = run_demo(DemoConfig(tokens=4, prompt_len=24, layers=2, block_size=8, mode="pull", hosts=True))
    assert result["transport"] == "tcp"  # auto: another PID namespace rules cma out
    assert result["identical"] and result["completion_notified"]
    assert "prefill and decode on two hosts (namespaces)" in format_report(result).splitlines()[1]
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout == before


def _labels(text: str) -> list[str]:
    return [line.split("  ")[0].strip() for line in text.splitlines()]


SHELL_FIRST = 8  # seconds: more than hixl.demo.run's _PYTHON_START_MAX


@pytest.mark.timeout(180)
def test_cli_runs_and_exits_zero(tmp_path: Path, docs_sample: Any) -> None:
    plot = tmp_path / "timeline.png"
    command = [sys.executable, "-m", "hixl", "demo", "--tokens", "3", "--prompt-len", "17", "--layers", "1",
               *(["--plot", str(plot)] if HAVE_MATPLOTLIB else [])]
    # Run as a shell's last command: the shell execs it in its own process, which started with the
    # shell, SHELL_FIRST seconds earlier; the demo's time must not count them.
    began = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", f"sleep {SHELL_FIRST}; exec {shlex.join(command)}"], capture_output=True, text=True, timeout=170
    )
    waited = time.monotonic() - began - SHELL_FIRST
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "YES (3/3)" in proc.stdout
    # Progress, as it goes, on stderr: one line per stage, the table stays alone on stdout.
    progress = [line for line in proc.stderr.splitlines() if line.startswith("hixl demo: ")]  # not library warnings
    assert progress[0] == "hixl demo: loading torch and transformers ..."
    assert progress[1].startswith("hixl demo: starting the prefill and decode processes")
    assert progress[-2].startswith("hixl demo: done;")
    # The last line is the command's whole wall time, its start (the interpreter's, torch's import)
    # and the workers' exit included: what the caller waited for, but for the interpreter's exit.
    total, *phases = map(float, re.findall(r"(\d+\.\d) s", progress[-1]))
    assert progress[-1].startswith(f"hixl demo: {total} s in all, from the command's start to its end: ")
    # Exec'd by a shell, the interpreter's start before hixl's import is not seen: up to _PYTHON_START_MAX.
    assert waited - 5.0 < total <= waited + 0.1, (total, waited)
    assert len(phases) == 3 and phases[0] > 0, progress[-1]  # the imports are counted
    plotting = re.findall(r"^plot written to .* \((\d+\.\d) s\)$", proc.stdout, re.MULTILINE)
    assert abs(sum(phases) + sum(map(float, plotting)) - total) < 0.3, progress[-1]  # they account for all of it
    assert "hixl demo: " not in proc.stdout.split("\n", 1)[1]
    assert docs_sample.missing(docs_sample.lines("tools.md", "hixl demo, on stderr"), proc.stderr, chunks=0) == []
    labels = _labels(proc.stdout)
    assert [label for label in labels if label in ROWS] [: len(ROWS)] == ROWS  # the table, in order
    assert labels.index("time to first token") < labels.index("decode starts layer 0")
    assert "legend (points in time are ms since the request arrived" in proc.stdout
    for row in ROWS:  # every row is explained under the table
        assert any(line.startswith(f"  {row} ") for line in proc.stdout.splitlines()), row
    assert "GiB/s" in proc.stdout and "GB/s" not in proc.stdout
    assert docs_sample.missing(docs_sample.lines("tools.md", "hixl demo"), proc.stdout) == []
    if HAVE_MATPLOTLIB:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < plot.stat().st_size < 100_000
        assert f"plot written to {plot}" in proc.stdout


def test_cli_rejects_bad_options() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hixl", "demo", "--tokens", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "hixl demo: error: --tokens must be at least 1" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "hixl", "demo", "--hosts", "--transport", "cma"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "cma cannot cross them" in proc.stderr


def test_plot_without_matplotlib_is_refused_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed here')\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "hixl", "demo", "--plot", str(tmp_path / "t.png")],
        capture_output=True, text=True, timeout=60, cwd=root,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])},
    )
    assert proc.returncode == 2
    assert "--plot needs matplotlib, which is not installed: pip install 'hixl[plot]'" in proc.stderr
    assert "starting the prefill" not in proc.stderr
