"""``hixl bench --scenario vllm``: its choices and refusals, and one quick real run (vLLM servers and the proxy).

The quick run measures hixl's connector, and NIXL's where NIXL is installed
(the ``nixl`` extra); without NIXL it must say so and measure hixl alone.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from hixl.bench import vllm_bench
from hixl.bench.cli import config_from_args, configure, main
from hixl.bench.config import BenchConfig

QUICK = BenchConfig.quick_run()
HAVE_NIXL = vllm_bench.nixl_missing() is None


def test_contenders_are_hixl_then_nixl_where_installed() -> None:
    connectors, notes = vllm_bench.contenders(replace(QUICK, transports=vllm_bench.AUTO))
    assert [c.name for c in connectors] == (["hixl", "nixl"] if HAVE_NIXL else ["hixl"])
    assert bool(notes) != HAVE_NIXL and all("NIXL is not installed" in n for n in notes)
    forced, _ = vllm_bench.contenders(replace(QUICK, transports=("cma", "tcp")))
    assert [c.name for c in forced][:2] == ["hixl-cma", "hixl-tcp"]
    assert json.loads(forced[1].transfer_config(prefill=False)) == {
        "kv_connector": "HixlConnector",
        "kv_connector_module_path": "hixl.vllm",
        "kv_connector_extra_config": {"transport": "tcp"},
        "kv_role": "kv_consumer",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--transport", "shm"], "runs over cma or tcp, not shm"),
        (["--tokens", "8180"], "exceed the scenario's longest request, 8192 tokens"),
    ],
)
def test_impossible_runs_are_refused_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--scenario", "vllm", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_shapes_are_chosen_by_name_and_share_out_the_cpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert [s.name for s in vllm_bench.shapes(QUICK)] == ["1p1d"]
    parser = argparse.ArgumentParser()
    configure(parser)
    every = vllm_bench.shapes(config_from_args(parser.parse_args(["--scenario", "vllm", "--shape", "all"])))
    assert [(s.name, s.prefills, s.decodes) for s in every] == [
        ("1p1d", (1,), (1,)), ("2p1d", (1, 1), (1,)), ("1p2d", (1,), (1, 1)), ("tp2-1", (2,), (1,)), ("tp1-2", (1,), (2,)),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="no shape 3p1d: choose from 1p1d, 2p1d"):
        vllm_bench.shapes(replace(QUICK, extra={"vllm_shapes": ("1p1d", "3p1d")}))
    with pytest.raises(SystemExit):
        main(["--scenario", "vllm", "--shape", "3p1d"])
    assert "choose from 1p1d, 2p1d, 1p2d, tp2-1, tp1-2, all" in capsys.readouterr().err
    # One core per rank where there are enough (spares to the first), in turn where there are not.
    assert vllm_bench.cpu_binds([1, 1], [0, 1, 2, 3, 4]) == ["0,1,2", "3,4"]
    assert vllm_bench.cpu_binds([2, 1], [0, 1, 2, 3]) == ["0,1|2", "3"]
    assert vllm_bench.cpu_binds([2, 1], [0, 1]) == ["0|1", "0"]
    assert vllm_bench.cpu_binds([1, 1, 1], [4, 6]) == ["4", "6", "4"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_run_reports_every_connector(tmp_path: Path) -> None:
    pytest.importorskip("vllm.distributed.kv_transfer")
    out = tmp_path / "vllm.json"
    assert main(["--scenario", "vllm", "--quick", "--timeline", "--no-progress", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    names = ["hixl", "nixl"] if HAVE_NIXL else ["hixl"]
    # Both connectors' loads measured alike first (hixl's also against one transfer_sync), then their own telemetry.
    load, own = ["KV load, start to usable, median", "KV load, start to usable, p90"], [
        "KV transfer (own telemetry), median", "KV transfer (own telemetry), p90", "time to first token, median",
        "decode throughput, median",
    ]  # fmt: skip
    sync = ["one transfer_sync of the same bytes, median", "KV load / transfer_sync of the same bytes, median"]
    labels = {"hixl": load + sync + own, "nixl": load + own}
    assert [(r["name"], r["transport"]) for r in doc["rows"]] == [(label, n) for n in names for label in labels[n]]
    for row in doc["rows"]:
        assert row["value"] is not None and math.isfinite(row["value"]) and row["value"] > 0, row
        assert row["note"] == f"{vllm_bench.QUICK['vllm_requests']} requests"
        compared = HAVE_NIXL and row["transport"] == "hixl" and "transfer_sync" not in row["name"]
        assert (row["baseline_name"] == "nixl") == compared, row
    for name in names:  # --timeline: where a median request's load went
        (note,) = [n for n in doc["notes"] if n.startswith(f"vllm 1P1D {name} timeline, median ms after the load started: ")]
        assert "usable" in note and ("sync_ref" in note) == (name == "hixl")
    assert any("NIXL is not installed" in n for n in doc["notes"]) == (not HAVE_NIXL)
