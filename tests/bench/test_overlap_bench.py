"""``hixl bench --scenario vllm --overlap``: its model, its contenders, its rows' arithmetic, its refusals, and one
quick real run (vLLM servers alone and behind the proxy).

Push mode may not serve yet: then its contender must give no rows and a note quoting why, and the others go on.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hixl.bench import overlap_bench, vllm_bench
from hixl.bench.cli import config_from_args, configure, main
from hixl.bench.config import BenchConfig
from hixl.testing.tiny_llama import TINY, WIDE, build

HAVE_NIXL = vllm_bench.nixl_missing() is None
MiB = 1 << 20


@pytest.mark.timeout(180)
def test_the_wide_llama_is_built_locally_in_under_a_minute_with_its_kv_heavy_layout(tmp_path: Path) -> None:
    # More layers and wider KV heads than the tests' model, no grouped queries, a narrow residual stream.
    assert WIDE.layers > TINY.layers and WIDE.kv_heads * WIDE.head_dim > TINY.kv_heads * TINY.head_dim
    assert WIDE.heads == WIDE.kv_heads and WIDE.hidden < WIDE.heads * WIDE.head_dim
    # float32 K and V: 4 KiB a token and layer, 8 MiB a layer at 2048 tokens, 128 MiB a request (in a 256 MiB cache).
    assert WIDE.kv_bytes(1) == 4096 and WIDE.kv_bytes(2048) == 8 * MiB
    assert WIDE.kv_bytes(2048, WIDE.layers) == 128 * MiB <= 256 * MiB
    assert WIDE.positions >= vllm_bench.LONGEST
    start = time.monotonic()
    path = build(tmp_path / "wide", sizes=WIDE)
    assert time.monotonic() - start < 60
    assert overlap_bench.layer_sizes(path) == WIDE
    assert overlap_bench.layer_sizes(build(tmp_path / "tiny")) == TINY  # the default layout is still the tests' model
    with pytest.raises(ValueError, match="needs a model folder with a config.json"):
        overlap_bench.layer_sizes(tmp_path)


def test_contenders_are_alone_pull_push_then_nixl_where_installed() -> None:
    found, notes = overlap_bench.contenders()
    assert [c.name for c in found] == ["alone", "hixl-pull", "hixl-push"] + (["nixl"] if HAVE_NIXL else [])
    assert bool(notes) != HAVE_NIXL
    alone, pull, push = found[:3]
    assert alone.connector is None and not alone.proxy_flags
    assert pull.connector is not None and "kv_connector_extra_config" not in json.loads(pull.connector.transfer_config(True))
    # Push: both servers in push mode, and the proxy told so.
    assert push.connector is not None and push.proxy_flags == ("--kv-mode", "push")
    for prefill in (True, False):
        config = json.loads(push.connector.transfer_config(prefill))
        assert config["kv_connector"] == "HixlConnector" and config["kv_connector_extra_config"] == {"mode": "push"}


def test_alone_computes_on_the_cpus_of_1p1ds_prefill() -> None:
    # Alone on every CPU would compute faster than the prefill it is compared with: its TTFT no baseline.
    assert overlap_bench.cpu_shares(False, [0, 1]) == ["0", "1"]
    assert overlap_bench.cpu_shares(True, [0, 1]) == ["0"]
    assert overlap_bench.cpu_shares(True, [0, 1, 2, 3, 4]) == ["0,1,2"]


def test_rows_give_each_ttft_and_the_exposed_transfer_in_layers() -> None:
    ttfts = {
        "alone": {256: [0.30, 0.10, 0.20], 2048: [1.6]},
        "hixl-pull": {256: [0.25, 0.23, 0.24], 2048: [1.7]},
        "hixl-push": {256: [0.2005, 0.2015, 0.2010], 2048: [1.6025]},
        # nixl failed: absent
    }
    rows = overlap_bench.rows(WIDE, "cma", {256: 0.001, 2048: 0.002}, ttfts)
    by = {(r.op, r.transport, r.name): r for r in rows}
    assert len(by) == len(rows) == 2 * (1 + 1 + 3 + 2)
    transfer = by[("256 tok", "cma", overlap_bench.LAYER_TRANSFER)]
    assert (transfer.value, transfer.unit, transfer.size) == (1.0, "ms", WIDE.kv_bytes(256))
    compute = by[("2048 tok", "alone", overlap_bench.LAYER_COMPUTE)]
    assert compute.value == pytest.approx(1600 / WIDE.layers) and compute.ratio == pytest.approx(50)
    alone = by[("256 tok", "alone", overlap_bench.TTFT)]
    assert alone.value == pytest.approx(200) and alone.baseline is None and alone.size == WIDE.kv_bytes(256, WIDE.layers)
    pull = by[("256 tok", "hixl-pull", overlap_bench.TTFT)]
    assert pull.value == pytest.approx(240) and pull.baseline == pytest.approx(200) and pull.baseline_name == "alone"
    exposed = by[("256 tok", "hixl-pull", overlap_bench.EXPOSED)]  # median - alone's median, in layers' transfers
    assert exposed.value == pytest.approx(40) and exposed.ratio == pytest.approx(40) and exposed.target is None
    push = by[("256 tok", "hixl-push", overlap_bench.EXPOSED)]
    assert push.value == pytest.approx(1.0) and push.target == overlap_bench.TARGET and push.passed is True
    slow = by[("2048 tok", "hixl-push", overlap_bench.EXPOSED)]
    assert slow.ratio == pytest.approx(1.25) and slow.passed is True
    assert replace(slow, value=3.2).passed is False  # 1.6 layers' transfers showing: the target missed
    assert replace(slow, smoke=True).passed is None  # a --quick run shows it, does not judge it
    # Without alone's figures: the TTFTs alone, no exposed transfer, no compute.
    bare = overlap_bench.rows(WIDE, "cma", {256: 0.001}, {"hixl-pull": ttfts["hixl-pull"]})
    assert [(r.name, r.transport, r.baseline) for r in bare] == [
        (overlap_bench.LAYER_TRANSFER, "cma", None), (overlap_bench.TTFT, "hixl-pull", None),
    ]  # fmt: skip


def test_push_phases_add_up_to_the_ttft_and_give_the_transfer_tail_in_layers() -> None:
    sent, ttft = 100.0, 0.080
    records = [
        {"role": "decode", "start": 100.002, "issued": 100.004, "usable": 100.0705, "reported": 100.071, "layers": []},
        {"role": "prefill", "start": 100.010, "issued": None, "usable": 100.0704, "reported": 100.0706,
         "layers": [[100.03, 100.02, 100.021], [100.0704, 100.070, 100.0702]]},
    ]  # fmt: skip
    phases = overlap_bench.push_phases(sent, ttft, records)
    assert list(phases) == list(overlap_bench.PHASES)
    assert sum(phases.values()) == pytest.approx(80)
    assert phases[overlap_bench.TAIL] == pytest.approx(0.5) and phases["prefill's forward"] == pytest.approx(60)
    rows = overlap_bench.rows(WIDE, "cma", {256: 0.001}, {"hixl-push": {256: [ttft]}}, {256: [phases, {**phases, overlap_bench.TAIL: 1.5}]})
    tail = next(r for r in rows if r.name == f"hixl-push phase: {overlap_bench.TAIL}, median")
    assert tail.value == pytest.approx(1.0) and tail.ratio == pytest.approx(1.0) and tail.target is None
    assert len([r for r in rows if r.name.startswith("hixl-push phase: ")]) == len(overlap_bench.PHASES)


def test_lengths_are_chosen_and_impossible_runs_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    config = config_from_args(parser.parse_args(["--scenario", "vllm", "--overlap", "--lengths", "2048,256,2048"]))
    assert overlap_bench.knobs(config) == ((256, 2048), {"vllm_requests": 5, "vllm_max_tokens": 8})
    quick = replace(BenchConfig.quick_run(), extra={"vllm_overlap": True})
    assert overlap_bench.knobs(quick) == ((256,), {"vllm_requests": 1, "vllm_max_tokens": 4})
    chosen = overlap_bench.knobs(replace(config, extra={"vllm_requests": 3}))
    assert chosen == (overlap_bench.LENGTHS, {"vllm_requests": 3, "vllm_max_tokens": 8})
    assert "alone / pull / push / nixl" in vllm_bench.describe(config)
    for argv, message in [
        (["--lengths", "8190"], "exceed the scenario's longest request, 8192 tokens"),
        (["--transport", "cma"], "--transport does not apply"),
        (["--model", "Qwen/Qwen3-0.6B"], "needs a model folder with a config.json"),
    ]:
        assert main(["--scenario", "vllm", "--overlap", "--no-progress", *argv]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_run_reports_ttft_alone_and_through_the_proxy(tmp_path: Path) -> None:
    pytest.importorskip("vllm.distributed.kv_transfer")
    out = tmp_path / "overlap.json"
    assert main(["--scenario", "vllm", "--overlap", "--quick", "--no-progress", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["transport"], r["name"]): r for r in doc["rows"]}
    assert {r["op"] for r in doc["rows"]} == {"256 tok"}
    for row in doc["rows"]:
        assert row["value"] is not None and math.isfinite(row["value"]), row
    assert rows[("cma", overlap_bench.LAYER_TRANSFER)]["value"] > 0
    assert rows[("alone", overlap_bench.TTFT)]["value"] > 0 and rows[("alone", overlap_bench.LAYER_COMPUTE)]["ratio"] > 0
    assert rows[("hixl-pull", overlap_bench.TTFT)]["baseline_name"] == "alone"
    assert rows[("hixl-pull", overlap_bench.EXPOSED)]["target"] is None
    # Each PD contender either served (its TTFT and exposed transfer; push's with its target) or left a note saying why.
    for name in ["hixl-push"] + (["nixl"] if HAVE_NIXL else []):
        failed = [n for n in doc["notes"] if n.startswith(f"vllm overlap: {name}'s servers could not serve it: ")]
        served = (name, overlap_bench.EXPOSED) in rows
        assert served != bool(failed), (name, doc["notes"])
        if served:
            assert (rows[(name, overlap_bench.EXPOSED)]["target"] is not None) == (name == "hixl-push")
    if ("hixl-push", overlap_bench.EXPOSED) in rows:  # its phases, from both servers' records, add up to its TTFT
        phases = [r["value"] for (t, n), r in rows.items() if t == "hixl-push" and n.startswith("hixl-push phase: ")]
        assert len(phases) == len(overlap_bench.PHASES) and sum(phases) == pytest.approx(rows[("hixl-push", overlap_bench.TTFT)]["value"], rel=0.01)
