"""``hixl demo`` end to end: three real processes, real transfers, tokens equal to colocated."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hixl.demo.run import DemoConfig, format_report, run_demo  # noqa: E402


@pytest.mark.timeout(180)
# Each run starts two torch processes (seconds each): cover both modes and both transports in two.
@pytest.mark.parametrize(("mode", "transport"), [("pull", "tcp"), ("push", "cma")])
def test_disaggregated_tokens_equal_colocated(mode: str, transport: str) -> None:
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


@pytest.mark.timeout(180)
def test_cli_runs_and_exits_zero() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.cli", "demo", "--tokens", "3", "--prompt-len", "17", "--layers", "1"],
        capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "YES (3/3)" in proc.stdout
    assert "time to first token" in proc.stdout


def test_cli_rejects_bad_options() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.cli", "demo", "--tokens", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "--tokens must be at least 1" in proc.stdout
