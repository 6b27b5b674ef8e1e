"""``hixl bench --scenario ps``: its rows, baselines and targets, and its self-check.

The end-to-end test runs the real scenario (a table server and an RPC server,
each a child process, every transport) in its ``--quick`` form; it checks
shape, never speed. The self-check tests make this process — the worker — get
one wrong byte from one of the two servers and expect the run to stop.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import numpy as np
import pytest

from hixl.bench import ps_bench
from hixl.bench.cli import main
from hixl.bench.config import BenchConfig
from hixl.bench.progress import Progress
from hixl.bench.ps_server import RpcClient, expected_rows
from hixl.weights import Subscriber

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("ps") / "quick.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["--scenario", "ps", "--quick", "--no-progress", "--json", str(path)]) == 0
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_every_row_is_there_with_its_baseline_and_target(quick_run: dict[str, Any]) -> None:
    doc = quick_run
    assert doc["scenarios"] == ["ps"]
    rows = {(r["name"], r["transport"]): r for r in doc["rows"]}
    assert len(rows) == len(doc["rows"]), "duplicate rows"
    transports = ["cma", "shm", "tcp"]
    assert set(rows) == {(name, t) for t in transports for name in ("pull_rows, 1024-row batches", "server CPU during gathers")}
    for t in transports:
        gathers, cpu = rows[("pull_rows, 1024-row batches", t)], rows[("server CPU during gathers", t)]
        assert gathers["unit"] == "rows/s" and gathers["value"] > 0 and gathers["baseline"] > 0
        assert gathers["ratio"] == pytest.approx(gathers["value"] / gathers["baseline"])
        assert gathers["target"]["text"] == ">=2x" and "RPC server" in gathers["baseline_name"]
        assert cpu["unit"] == "% core" and cpu["value"] >= 0 and cpu["baseline"] > 0  # the RPC server works
        assert (None if cpu["target"] is None else cpu["target"]["text"]) == ("<=2" if t != "tcp" else None)
        assert all(r["smoke"] and r["pass"] is None for r in (gathers, cpu))
    assert any(note.startswith("ps: scaled-down table") for note in doc["notes"])


def test_expected_rows_are_distinct_words() -> None:
    rows = expected_rows(np.array([0, 1, 5]))
    assert rows.shape == (3, 32) and rows.dtype == np.uint64
    assert rows[2, 0] == 160 and len(np.unique(rows)) == rows.size


def test_rows_option_reaches_the_scenario() -> None:
    import argparse

    from hixl.bench.cli import config_from_args, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    assert ps_bench.knobs(config_from_args(parser.parse_args(["--rows", "5000"]))) == (5000, 400)
    assert ps_bench.knobs(config_from_args(parser.parse_args(["--quick"]))) == (ps_bench.QUICK_ROWS, 20)
    assert ps_bench.knobs(config_from_args(parser.parse_args([])))[0] == 1 << 20  # the issue's >= 1M rows


def _flip_after(monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> None:
    """Make ``cls.method`` leave one wrong byte in the rows it gathered (its ``out``, the third argument
    of pull_rows, the second of gather)."""
    original = getattr(cls, method)

    def faulty(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        out = args[2] if method == "pull_rows" else args[1]
        out.view(np.uint8)[-1, -1] ^= 0x01
        return result

    monkeypatch.setattr(cls, method, faulty)


@pytest.mark.parametrize(("cls", "method", "who"), [(Subscriber, "pull_rows", "pull_rows"), (RpcClient, "gather", "the RPC server")])
def test_a_wrong_byte_stops_the_run(monkeypatch: pytest.MonkeyPatch, cls: type, method: str, who: str) -> None:
    _flip_after(monkeypatch, cls, method)
    config = BenchConfig(transports=("tcp",), repeat=1, quick=True)
    with pytest.raises(RuntimeError, match=f"ps self-check failed on tcp: {who} returned wrong bytes in row"):
        ps_bench.run(config, Progress(enabled=False))
