"""``hixl bench --scenario kv``: its rows, its options, its layout arithmetic and its self-check.

The end-to-end tests run the real scenario (a prefill child process, both
transports) in its ``--quick`` form, which takes about a second. They check
shape, never speed.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from hixl import empty
from hixl._memory import merge_adjacent
from hixl._options import DEFAULT_OPTIONS
from hixl.bench import kv_bench
from hixl.bench.cli import config_from_args, configure, main
from hixl.bench.config import BenchConfig
from hixl.bench.kv_prefill import POOL_SALT, KvShape, fill_pattern, pattern
from hixl.bench.progress import Progress
from hixl.datadist import CacheManager
from hixl.datadist._layout import row_descs

pytestmark = pytest.mark.timeout(90)

QUICK = kv_bench.QUICK_SHAPE


def _measured(doc: dict[str, Any], wanted: Sequence[str]) -> list[str]:
    """The transports the run could use (cma is skipped, with a note, where ptrace is not allowed)."""
    skipped = {t for t in wanted for note in doc["notes"] if note.startswith(f"{t}: skipped")}
    return [t for t in wanted if t not in skipped]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    path = tmp_path_factory.mktemp("kv") / "quick.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--scenario", "kv", "--quick", "--no-progress", "--json", str(path)]) == 0
    return json.loads(path.read_text()), out.getvalue()


# -- end to end ------------------------------------------------------------------------------
def test_json_has_every_expected_row(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick_run
    transports = _measured(doc, ["cma", "tcp"])
    assert "tcp" in transports  # TCP needs nothing special: it must always run
    (bs,) = QUICK.block_sizes
    expected = set()
    for t in transports:
        raw = ["raw scattered"] + (["raw lanes"] if DEFAULT_OPTIONS["copy_lanes"] > 1 else [])
        names = ["pull_blocks", "pull_async", "first layer"] + (raw if t == "cma" else [])
        expected |= {(f"{name} bs={bs}", t, "READ", QUICK.prompt_bytes) for name in names}
    got = [(r["name"], r["transport"], r["op"], r["size"]) for r in doc["rows"]]
    assert len(got) == len(set(got)), "duplicate rows"
    assert set(got) == expected
    assert doc["scenarios"] == ["kv"]


def test_shm_is_measured_on_a_prefill_cache_in_pool_memory(tmp_path: Any) -> None:
    """Asked for shm, the prefill child puts its cache in pool memory (shm maps only that): the
    decode side links over shm and pulls, its rows there, not a "skipped" note."""
    path = tmp_path / "shm.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["--scenario", "kv", "--quick", "--transport", "shm", "--no-progress", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert not [note for note in doc["notes"] if note.startswith("shm: skipped")], doc["notes"]
    (bs,) = QUICK.block_sizes
    assert {(r["name"], r["transport"]) for r in doc["rows"]} == {
        (f"{name} bs={bs}", "shm") for name in ("pull_blocks", "pull_async", "first layer")
    }


def test_figures_baselines_and_ratios_are_positive(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick_run
    for row in doc["rows"]:
        assert row["scenario"] == "kv" and row["unit"], row
        assert row["value"] is not None and row["value"] > 0, row
        assert row["baseline"] is not None and row["baseline"] > 0, row
        assert row["ratio"] == pytest.approx(row["value"] / row["baseline"])
        assert row["ratio"] > 0
        # Both kv targets are ratios: a --quick (smoke) run shows them without judging them.
        assert row["smoke"] is True and row["pass"] is None, row


def test_targets_are_the_issues(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick_run
    for row in doc["rows"]:
        kind = row["name"].rsplit(" bs=", 1)[0]
        target = None if row["target"] is None else row["target"]["text"]
        assert target == {"pull_blocks": ">=0.9x", "first layer": "<=1.5x"}.get(kind), row
        if kind == "first layer":
            # ratio = (first layer's share of the pull) / (1 / layers): <= 1.5x is the issue's <= 1.5 / layers.
            assert row["baseline"] == pytest.approx(100.0 / QUICK.layers)
            assert row["value"] <= 100.0
        else:
            assert row["baseline_name"] == "1 contiguous transfer_sync"


def test_notes_count_the_descriptors_issued(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick_run
    (bs,) = QUICK.block_sizes
    unmerged = 2 * QUICK.layers * QUICK.prompt_blocks(bs)
    pull = next(r for r in doc["rows"] if r["name"] == f"pull_blocks bs={bs}" and r["transport"] == "tcp")
    issued = int(pull["note"].split(" descriptors issued")[0].rsplit(" ", 1)[1])
    assert 0.9 * unmerged <= issued <= unmerged  # shuffled: (next to) nothing merges


def test_table_is_printed(quick_run: tuple[dict[str, Any], str]) -> None:
    doc, text = quick_run
    assert text.startswith("SMOKE RUN (--quick)")
    header = text.splitlines()[1]
    assert header.startswith("hixl bench: scenario kv; transports cma,tcp; kv cache 4 layers x 1024 tokens")
    assert "pull_blocks bs=16" in text and "first layer bs=16" in text and "targets:" in text
    assert "note: kv: scaled-down cache" in text
    names = tuple(r["name"] + " " for r in doc["rows"])
    assert sum(1 for line in text.splitlines() if line.startswith(names)) == len(doc["rows"])


# -- options -----------------------------------------------------------------------------------
def _config(*argv: str) -> BenchConfig:
    import argparse

    parser = argparse.ArgumentParser()
    configure(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_shapes_from_options() -> None:
    assert kv_bench.shape_of(_config()) == KvShape(layers=80, tokens=4096, block_sizes=(16, 32, 128))
    assert kv_bench.shape_of(_config()).prompt_bytes == 1280 << 20  # the issue's ~1.3 GB
    assert kv_bench.shape_of(_config("--quick")) == QUICK
    shape = kv_bench.shape_of(_config("--quick", "--layers", "2", "--tokens", "256", "--block-sizes", "32,16,32"))
    assert (shape.layers, shape.tokens, shape.block_sizes) == (2, 256, (16, 32))


def test_bad_kv_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--layers", "0"], ["--block-sizes", "16,x"], ["--tokens", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(["--scenario", "kv", *args])
        assert exc.value.code == 2
    assert main(["--scenario", "kv", "--quick", "--block-sizes", "24"]) == 2  # 24 does not divide 1024
    assert "does not divide" in capsys.readouterr().err


# -- the layout and the pattern ------------------------------------------------------------------
def test_descriptors_are_the_ones_datadist_builds() -> None:
    shape = KvShape(layers=3, tokens=64, block_sizes=(16,))
    local, remote, bs = 1 << 20, 1 << 30, 16
    src, dst = np.array([5, 0, 7, 2]), np.array([1, 6, 3, 4])
    tensor = shape.pool_tokens * shape.token_bytes
    tensors = np.arange(2 * shape.layers)
    bases = tensors * tensor
    # ... in the remote blocks' order (the destinations do not repeat)
    expected = row_descs((local + bases).tolist(), (remote + bases).tolist(), dst[np.argsort(src)], np.sort(src), shape.block_bytes(bs))
    assert np.array_equal(kv_bench.pull_descriptors(shape, bs, local, remote, src, dst).reshape(-1, 3), expected)


def test_issued_descriptors_count_what_merges() -> None:
    bs = 16
    shuffled = KvShape(layers=2, tokens=64, block_sizes=(bs,))
    descs = kv_bench.pull_descriptors(shuffled, bs, 1 << 20, 1 << 30, np.array([3, 1, 6, 4]), np.array([0, 5, 2, 7]))
    assert kv_bench.issued_descriptors(descs) == (16, 16)
    # In order, within a pool of twice the prompt: each tensor's blocks merge into one range.
    in_order = kv_bench.pull_descriptors(shuffled, bs, 1 << 20, 1 << 30, np.arange(4), np.arange(4))
    assert kv_bench.issued_descriptors(in_order) == (4, 4)
    # A pool of exactly the prompt, in order: the whole cache is one range; one per layer when split.
    full = KvShape(layers=2, tokens=64, block_sizes=(bs,), pool_factor=1)
    whole = kv_bench.pull_descriptors(full, bs, 1 << 20, 1 << 30, np.arange(4), np.arange(4))
    assert kv_bench.issued_descriptors(whole) == (1, 2)
    assert len(merge_adjacent(whole.reshape(-1, 3))) == 1


def test_pattern_and_block_words_agree_with_the_tensors() -> None:
    shape = KvShape(layers=2, tokens=64, block_sizes=(16, 32))
    storage = empty(shape.storage_shape, np.float16)
    fill_pattern(storage, POOL_SALT)
    words = storage.view(np.uint64).reshape(-1)
    assert np.array_equal(words, pattern(0, len(words), POOL_SALT))
    assert len(np.unique(words)) == len(words)  # every word distinct: a misplaced block cannot match
    for bs in shape.block_sizes:
        tensors = shape.tensors(storage, bs)
        assert len(tensors) == 2 * shape.layers and tensors[0].shape == shape.tensor_shape(bs)
        for layer, kv, block in ((0, 0, 0), (1, 1, shape.pool_blocks(bs) - 1), (1, 0, 2)):
            got = tensors[2 * layer + kv][block].view(np.uint64).reshape(-1)
            assert np.array_equal(got, pattern(shape.block_word(layer, kv, block, bs), len(got), POOL_SALT))


def test_shape_is_validated() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        KvShape(tokens=100, block_sizes=(16,))
    with pytest.raises(ValueError, match="layers"):
        KvShape(layers=0)
    with pytest.raises(ValueError, match="block size"):
        KvShape(block_sizes=())


# -- the self-check ---------------------------------------------------------------------------------
def _broken(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    original = CacheManager.pull_blocks

    def pull_blocks(
        self: CacheManager, src_key: Any, dst_cache: Any, src_blocks: Any, dst_blocks: Any, *a: Any, **k: Any
    ) -> None:
        if how == "misplaced":  # every block lands, in the wrong slot
            original(self, src_key, dst_cache, src_blocks, list(dst_blocks)[::-1], *a, **k)

    monkeypatch.setattr(CacheManager, "pull_blocks", pull_blocks)


@pytest.mark.parametrize("how", ["nothing", "misplaced"])
def test_self_check_refuses_to_time_a_broken_pull(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    _broken(monkeypatch, how)
    config = BenchConfig(transports=("tcp",), repeat=1, quick=True)
    with pytest.raises(RuntimeError, match="kv self-check failed on tcp, 16-token blocks: pull_blocks left wrong"):
        kv_bench.run(config, Progress(enabled=False))


# -- the kv-vllm scenario: vLLM's CPU layout -------------------------------------------------------
VLLM_QUICK = kv_bench.VLLM_QUICK_SHAPE


def test_vllm_scenario_rows_and_targets(tmp_path: Any) -> None:
    path = tmp_path / "vllm.json"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["--scenario", "kv-vllm", "--quick", "--transport", "tcp", "--no-progress", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["scenarios"] == ["kv-vllm"]
    (bs,) = VLLM_QUICK.block_sizes
    assert bs == 32 and VLLM_QUICK.fused_kv
    rows = {r["name"]: r for r in doc["rows"]}
    assert set(rows) == {f"pull_blocks bs={bs}", f"pull_async bs={bs}", f"first layer bs={bs}"}
    assert all(r["scenario"] == "kv-vllm" and r["size"] == VLLM_QUICK.prompt_bytes for r in rows.values())
    assert rows[f"pull_blocks bs={bs}"]["target"]["text"] == ">=0.9x"
    assert rows[f"first layer bs={bs}"]["target"]["text"] == "<=1.5x"
    # One tensor per layer: one descriptor per block per layer, (next to) none merged.
    issued = int(rows[f"pull_blocks bs={bs}"]["note"].split(" descriptors issued")[0].rsplit(" ", 1)[1])
    assert 0.9 * VLLM_QUICK.layers * VLLM_QUICK.prompt_blocks(bs) <= issued <= VLLM_QUICK.layers * VLLM_QUICK.prompt_blocks(bs)
    assert "K|V fused per layer (vLLM CPU)" in out.getvalue()


def test_vllm_shape_is_llama3_8b_in_vllm_cpu_layout() -> None:
    shape = kv_bench.shape_of(_config("--scenario", "kv-vllm"), "kv-vllm")
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.block_sizes, shape.tokens) == (32, 8, 128, (32,), 4096)
    assert shape.tensor_shape(32) == (shape.pool_blocks(32), 8, 32, 256)  # [blocks, kv heads, block, 2 * head]
    assert shape.prompt_bytes == 512 << 20
    storage = empty(VLLM_QUICK.storage_shape, np.float16)
    fill_pattern(storage, POOL_SALT)
    tensors = VLLM_QUICK.tensors(storage, 32)
    assert len(tensors) == VLLM_QUICK.layers and tensors[0].shape == VLLM_QUICK.tensor_shape(32)
    for layer, block in ((0, 0), (3, VLLM_QUICK.pool_blocks(32) - 1), (2, 5)):
        got = tensors[layer][block].view(np.uint64).reshape(-1)
        assert np.array_equal(got, pattern(VLLM_QUICK.block_word(layer, 0, block, 32), len(got), POOL_SALT))
