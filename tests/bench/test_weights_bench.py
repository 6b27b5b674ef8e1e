"""``hixl bench --scenario weights``: its rows, baselines and targets, and its self-check.

The end-to-end test runs the real scenario (a publisher and three subscriber
processes, gloo, a safetensors file) in its ``--quick`` form. It checks shape,
never speed. The self-check test runs the scenario with nodes that hold one
wrong byte after a chosen contender (this module, run as ``python -m
tests.bench.test_weights_bench FD``, is that faulty node's process) and expects
the run to stop with the check's error.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from typing import Any

import numpy as np
import pytest

from hixl._tools.child import child_connection
from hixl.bench import weights_bench, weights_peers
from hixl.bench.cli import main
from hixl.bench.config import BenchConfig
from hixl.bench.progress import Progress

pytestmark = pytest.mark.timeout(300)

FAULT = "HIXL_BENCH_TEST_FAULT"
"""In a faulty node's environment: the contender after which it holds one wrong byte."""
TRANSPORTS = ("shm", "tcp")  # need nothing special (cma needs ptrace rights)


class FaultyNode(weights_peers.Node):
    """A node that, after the contender named in ``$HIXL_BENCH_TEST_FAULT``, holds one flipped byte."""

    def held(self, contender: str) -> list[np.ndarray]:
        arrays = super().held(contender)
        if contender == os.environ.get(FAULT) and arrays:
            arrays[-1].reshape(-1).view(np.uint8)[-1] ^= 0x01
        return arrays


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    path = tmp_path_factory.mktemp("weights") / "quick.json"
    out = io.StringIO()
    argv = ["--scenario", "weights", "--quick", "--transport", ",".join(TRANSPORTS), "--no-progress"]
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json", str(path)]) == 0
    return json.loads(path.read_text()), out.getvalue()


def test_every_row_is_there_with_its_baseline_and_target(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick_run
    assert doc["scenarios"] == ["weights"]
    expected = {}
    for t in TRANSPORTS:
        for n in weights_bench.QUICK_SUBSCRIBERS:
            for mode in ("", "zero-copy ", "zero-copy, no checksums, "):  # each publisher: rows of its own
                expected[(f"{mode}publish->all held, {n} sub", t)] = (">=0.9x" if n == 1 else None, "contiguous transfer_sync")
                expected[(f"{mode}publish->all held, {n} sub, vs gloo", t)] = (">=3x", "torch.distributed broadcast, gloo")
                expected[(f"{mode}publish->all held, {n} sub, vs safetensors", t)] = (">=5x", "safetensors save + reload")
            if n >= 3:
                expected[(f"relay tree, {n} sub, aggregate", t)] = (None, "flat: all from the publisher")
    got = {(r["name"], r["transport"]): r for r in doc["rows"]}
    assert len(got) == len(doc["rows"]), "duplicate rows"
    assert set(got) == set(expected)
    for key, (target, baseline_name) in expected.items():
        row = got[key]
        assert (None if row["target"] is None else row["target"]["text"]) == target, row
        assert baseline_name in row["baseline_name"], row
        assert row["scenario"] == "weights" and row["unit"] == "GiB/s"
        assert row["size"] == weights_bench.QUICK_SHAPE.nbytes
        assert row["value"] > 0 and row["baseline"] > 0
        assert row["ratio"] == pytest.approx(row["value"] / row["baseline"])
        assert row["smoke"] is True and row["pass"] is None  # ratio targets: not judged in a smoke run


def test_hixl_rows_split_publish_pull_and_verify(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick_run
    for row in doc["rows"]:
        if row["name"].endswith(" sub") and "held" in row["name"]:
            what = "manifest" if "no checksums" in row["name"] else "checksum" if row["name"].startswith("zero-copy") else "copy + checksum"
            assert f": publish ({what}) " in row["note"] and ", pull " in row["note"] and ", verify ~" in row["note"], row


def test_notes_say_where_the_file_is_and_who_pulls_from_whom(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, text = quick_run
    notes = "\n".join(doc["notes"])
    assert "safetensors file in " in notes and " at /" in notes  # the filesystem, from /proc/mounts
    assert "nodes 1<-publisher, 2<-publisher, 3<-1" in notes
    assert text.startswith("SMOKE RUN (--quick)")
    assert "weights 2-layer Llama fp16 (hidden 256), 21 tensors" in text.splitlines()[1]


def test_llama_shape_and_tree() -> None:
    shape = weights_bench.FULL_SHAPE
    assert 0.95 < shape.nbytes / 2**30 < 1.05  # about 1 GiB
    assert len(shape.tensors()) == 9 * shape.layers + 3
    assert [weights_peers.upstream_of(i) for i in range(1, 8)] == [0, 0, 1, 1, 2, 2, 3]


def test_options_reach_the_scenario() -> None:
    import argparse

    from hixl.bench.cli import config_from_args, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    shape, counts = weights_bench.knobs(config_from_args(parser.parse_args(["--subscribers", "4,1,2,1", "--layers", "3"])))
    assert (shape.layers, shape.hidden, counts) == (3, weights_bench.FULL_SHAPE.hidden, (1, 2, 4))
    assert weights_bench.knobs(config_from_args(parser.parse_args(["--quick"]))) == (
        weights_bench.QUICK_SHAPE, weights_bench.QUICK_SUBSCRIBERS
    )


@pytest.mark.parametrize("contender", ["flat", "zero-copy", "bare", "gloo"])
def test_a_wrong_byte_stops_the_run(monkeypatch: pytest.MonkeyPatch, contender: str) -> None:
    """One flipped byte in what a node holds after ``contender`` (hixl's pull, or a baseline's):
    the checked pass raises before anything is timed."""
    monkeypatch.setattr(weights_peers, "CHILD_MODULE", "tests.bench.test_weights_bench")
    monkeypatch.setenv(FAULT, contender)
    config = BenchConfig(transports=("tcp",), repeat=1, quick=True, extra={"weights_subscribers": (1,)})
    with pytest.raises(RuntimeError, match=f"weights self-check failed on tcp, 1 subscribers: node 1 holds wrong bytes after {contender}"):
        weights_bench.run(config, Progress(enabled=False))


if __name__ == "__main__":  # a faulty node's process (see the module docstring)
    weights_peers.serve(child_connection(), FaultyNode)
