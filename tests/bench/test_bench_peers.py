"""``hixl bench --compare`` / ``--peer-json``: other engines' figures beside hixl's, or why there are none.

CI has neither NIXL nor Mooncake: there the "not installed" path and the failure paths (a
peer folder whose run.sh fails or hangs: faults injected on purpose) are tested. Where the
peers' setup.sh has installed Mooncake, its own benchmark runs here and writes the JSON the
reading path is tested with (nothing stands in for a peer's figures).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from hixl.bench.cli import main
from hixl.bench.peers import default_install_dir, default_peers_dir, read_peer_json, run_peer
from hixl.bench.report import format_number

pytestmark = pytest.mark.timeout(120)

TINY = ["--quick", "--no-progress", "--transport", "tcp", "--max-size", "64K"]
"""The smallest real engine-scenario run (a few seconds): the rows the peers' columns stand beside."""


def _bench(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([*args])
    return status, out.getvalue(), err.getvalue()


def test_engines_that_are_not_installed_are_reported_so(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    status, out, err = _bench(*TINY, "--compare", "nixl,mooncake", "--peers-dir", str(tmp_path), "--json", str(path))
    assert status == 0
    assert f"NIXL (UCX cma): not installed (no {tmp_path / 'run.sh'}: give --peers-dir" in out
    assert f"Mooncake (TCP): not installed (no {tmp_path / 'run.sh'}" in out
    assert "figure          op" not in out.split("side by side", 1)[1]  # no columns without figures
    assert "running" not in err and ", and 0 s for --compare" in out  # nothing was run
    peers = json.loads(path.read_text())["peers"]
    assert [(p["engine"], p["status"].split(" (")[0], p["figures"]) for p in peers] == [
        ("nixl", "not installed", []),
        ("mooncake", "not installed", []),
    ]


def _peers_folder(tmp_path: Path, run_sh: str) -> tuple[Path, Path]:
    """A peers folder whose run.sh is ``run_sh`` (a fault to inject), and an install folder with venvs."""
    peers, install = tmp_path / "peers", tmp_path / "install"
    peers.mkdir()
    (peers / "run.sh").write_text(run_sh)
    for venv in ("nixl-venv", "mooncake-noncuda-venv"):
        (install / venv / "bin").mkdir(parents=True)
        (install / venv / "bin" / "python").write_text("")
    return peers, install


def test_a_missing_virtual_environment_says_to_run_setup(tmp_path: Path) -> None:
    peers, install = _peers_folder(tmp_path, "exit 0\n")
    (install / "nixl-venv" / "bin" / "python").unlink()
    result = run_peer("nixl", peers, install_dir=install)
    assert result.status == f"not installed (no {install / 'nixl-venv/bin/python'}: run {peers / 'setup.sh'} once)"
    assert result.figures == []


def test_a_peer_benchmark_that_fails_or_hangs_is_a_status_not_a_crash(tmp_path: Path) -> None:
    peers, install = _peers_folder(tmp_path, 'echo "$1 could not start: no UCX" >&2; exit 3\n')
    failed = run_peer("mooncake", peers, install_dir=install)
    assert failed.status == "failed (exit status 3, no JSON written: mooncake could not start: no UCX)"
    (peers / "run.sh").write_text(f"sleep 60 & echo $! > {tmp_path / 'child'}; wait\n")  # its child must go too
    hung = run_peer("nixl", peers, install_dir=install, timeout=0.5)
    assert hung.status == "failed (did not finish within 0.5 s)"
    child = Path(f"/proc/{(tmp_path / 'child').read_text().strip()}/stat")
    deadline = time.monotonic() + 5
    while child.exists() and child.read_text().split(")")[-1].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child.exists() or child.read_text().split(")")[-1].split()[0] == "Z"


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{not json", "cannot read it as JSON"),
        ('{"rows": []}', "not a file written by the peers' run.sh nixl|mooncake --json"),
        (
            '{"protocol": "tcp", "bandwidth": [{"size": 4096, "read": {}}]}',
            "a Mooncake (TCP) file without the expected",
        ),
    ],
)
def test_a_peer_json_that_is_not_one_is_refused_before_anything_runs(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "peer.json"
    path.write_text(content)
    status, out, err = _bench("--no-progress", "--peer-json", str(path))
    assert status == 2 and f"hixl bench: error: --peer-json {path}: {says}" in err
    assert "figure" not in out


def test_compare_needs_the_engine_scenario() -> None:
    status, _, err = _bench("--scenario", "kv", "--compare", "nixl")
    assert status == 2 and "--compare and --peer-json apply to the engine scenario" in err


def test_unknown_engines_are_refused() -> None:
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()):
        main(["--compare", "rdma"])
    assert exc.value.code == 2


def _installed(engine: str) -> bool:
    venv = {"nixl": "nixl-venv", "mooncake": "mooncake-noncuda-venv"}[engine]
    return (default_peers_dir() / "run.sh").is_file() and (default_install_dir() / venv / "bin" / "python").exists()


@pytest.fixture(scope="module")
def mooncake_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The JSON Mooncake's own benchmark writes (``run.sh mooncake --quick --json FILE``), made here."""
    if not _installed("mooncake"):
        pytest.skip("Mooncake is not installed (the peers' setup.sh installs it)")
    path = tmp_path_factory.mktemp("mooncake") / "mooncake.json"
    proc = subprocess.run(
        ["bash", str(default_peers_dir() / "run.sh"), "mooncake", "--quick", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PEERS": str(default_install_dir())},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return path


@pytest.mark.timeout(400)
def test_mooncakes_own_json_becomes_figures_in_hixls_units(mooncake_json: Path) -> None:
    doc: dict[str, Any] = json.loads(mooncake_json.read_text())
    result = read_peer_json(mooncake_json)
    assert result.engine == "mooncake" and result.status == f"read from {mooncake_json}"
    got = {(f.name, f.op, f.size): f for f in result.figures}
    sizes = [r["size"] for r in doc["bandwidth"]]
    assert sizes == [4 << 10, 64 << 10, 1 << 20]  # its --quick sizes
    for row in doc["bandwidth"]:
        for op in ("READ", "WRITE"):
            figure = got[("bandwidth", op, row["size"])]
            assert figure.unit == "GiB/s"
            assert figure.value == pytest.approx(row["size"] / row[op.lower()]["med_s"] / (1 << 30))
    for row in doc["latency"]:
        assert got[("latency median", row["op"].upper(), row["size"])].value == pytest.approx(row["med_us"])
        assert got[("latency p99", row["op"].upper(), row["size"])].value == pytest.approx(row["p99_us"])


@pytest.mark.timeout(400)
def test_the_side_by_side_table_puts_mooncake_beside_hixl_tcp(mooncake_json: Path, tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    status, out, _ = _bench(*TINY, "--peer-json", str(mooncake_json), "--json", str(path))
    assert status == 0
    table = out.split("side by side", 1)[1].splitlines()
    assert table[1].split() == ["figure", "op", "size", "hixl", "tcp", "Mooncake", "(TCP)"]
    figures = {(f.name, f.op, f.size): f for f in read_peer_json(mooncake_json).figures}
    unit = {"B": 1, "KiB": 1 << 10}
    lines = {}
    for line in table[3:]:
        if match := re.match(r"(bandwidth|latency median|latency p99)\s+(READ|WRITE)\s+(\d+) (B|KiB)\s", line):
            name, op, count, scale = match.groups()
            lines[(name, op, int(count) * unit[scale])] = line
    assert len(lines) == 2 * 2 + 2 * 2 * 2  # bandwidth 4 KiB and 64 KiB (--max-size), latency 8 B / 4 KiB
    for key, line in lines.items():
        figure = figures[key]
        assert figure.value is not None
        assert line.endswith(f"{format_number(figure.value)} {figure.unit}")  # the last column: Mooncake's
    assert f"Mooncake (TCP): read from {mooncake_json}; does the job of hixl tcp" in out
    assert json.loads(path.read_text())["peers"][0]["figures"]


@pytest.mark.timeout(400)
def test_compare_runs_mooncakes_own_benchmark() -> None:
    if not _installed("mooncake"):
        pytest.skip("Mooncake is not installed (the peers' setup.sh installs it)")
    result = run_peer("mooncake", default_peers_dir(), quick=True)
    assert result.status == "measured", result.status
    names = {(f.name, f.op) for f in result.figures}
    assert {
        ("bandwidth", "READ"),
        ("bandwidth", "WRITE"),
        ("latency median", "READ"),
        ("latency p99", "WRITE"),
    } <= names
    assert all(f.value is not None and f.value > 0 for f in result.figures)
