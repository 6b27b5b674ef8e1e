"""The soak test (:mod:`hixl.testing.soak`), bounded, and the checks it is made of.

The soak itself runs real processes on both transports with SIGKILLs; the
checks below it prove that its detectors fire: a word in the wrong place, a
canary overwritten, a leaked fd, mapping or thread are all seen.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import mmap
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hixl
from hixl.bench import soak_bench
from hixl.bench.cli import config_from_args, configure
from hixl.bench.cli import main as bench_main
from hixl.bench.soak_bench import soak_config
from hixl.testing import TargetProcess, soakwords
from hixl.testing.leaks import Snapshot
from hixl.testing.soak import SoakConfig, SoakReport, run_soak


def test_words_are_valid_only_where_they_belong() -> None:
    buf = np.zeros(4096, dtype=np.uint8)
    soakwords.fill(buf, 0x10000, 7)
    assert soakwords.valid(buf, 0x10000).all()
    assert (soakwords.tags(buf) == 7).all()
    assert not soakwords.valid(buf[8:], 0x10000).any(), "a word moved by 8 bytes must not pass"
    assert not soakwords.valid(buf, 0x20000).any(), "nor words meant for another address"
    torn = buf.copy()
    torn[100] ^= 1
    assert soakwords.valid(torn, 0x10000).sum() == 511


def test_tags_tell_canary_fill_and_writes_apart() -> None:
    tag = soakwords.write_tag(3, 5)
    assert tag > soakwords.CANARY and tag != soakwords.write_tag(3, 6) != soakwords.write_tag(4, 5)
    buf = np.zeros(64, dtype=np.uint8)
    soakwords.fill(buf[:32], 0x1000, soakwords.CANARY)
    soakwords.fill(buf[32:], 0x1020, tag)
    buf[8] ^= 0xFF
    text = soakwords.describe(buf, 0x1000, np.ones(8, dtype=bool))
    assert text.startswith("8 words from 0x1000: 3 canary, 4 write, 1 malformed"), text


def test_snapshot_sees_a_leaked_fd_mapping_and_thread() -> None:
    before = Snapshot.take()
    sock = socket.socket()
    mapped = hixl.empty(1 << 16)
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="leaky")
    thread.start()
    leaked = Snapshot.take().leaked_since(before)
    assert any("socket:" in fd for fd in leaked["fds"]), leaked
    start = mapped.ctypes.data
    assert any(_covers(m, start) for m in leaked["maps"]), leaked
    assert any(name.startswith("leaky#") for name in leaked["threads"]) and leaked["tasks"], leaked
    sock.close()
    del mapped
    release.set()
    thread.join(10)
    after = Snapshot.take(5.0, before).leaked_since(before)
    # This process may keep a malloc arena for the thread (the soak's children are told not to).
    assert (after["threads"], after["tasks"], after["fds"]) == ([], [], []), after
    assert not any(_covers(m, start) for m in after["maps"]), after


def test_snapshot_tells_an_arena_merged_with_a_neighbour_from_a_leak() -> None:
    """The kernel merges adjacent private anonymous mappings, so a 1 MiB one (what Python's arenas
    are) may sit inside a larger mapping: an old one grown by a new 2 MiB mapping right after it
    (the 2 MiB is new, the arena is not), or a new one placed right after an old mapping (nothing
    leaked)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    rw, private, fixed_noreplace = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, 0x100000
    MiB = 1 << 20

    def place(addr: int | None, nbytes: int) -> int:
        got = libc.mmap(addr, nbytes, rw, private | (fixed_noreplace if addr else 0), -1, 0)
        assert got not in (None, ctypes.c_void_p(-1).value) and (addr is None or got == addr), ctypes.get_errno()
        return int(got)

    span = place(None, 8 * MiB)  # room for both cases with a gap between, taken and given back
    libc.munmap(span, 8 * MiB)
    arena, old = place(span, MiB), place(span + 5 * MiB, 2 * MiB)
    try:
        before = Snapshot.take()
        grown, arena_after_old = place(arena + MiB, 2 * MiB), place(old + 2 * MiB, MiB)
        try:
            leaked = Snapshot.take().leaked_since(before)["maps"]
            assert any(_covers(m, grown) for m in leaked), leaked
            assert not any(_covers(m, arena) or _covers(m, arena_after_old) or _covers(m, old) for m in leaked), leaked
        finally:
            libc.munmap(grown, 2 * MiB)
            libc.munmap(arena_after_old, MiB)
    finally:
        libc.munmap(arena, MiB)
        libc.munmap(old, 2 * MiB)


def _covers(mapping: str, addr: int) -> bool:
    low, high = (int(x, 16) for x in mapping.split()[0].split("-"))
    return low <= addr < high


def _bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(argv)


def test_bench_options_reach_the_soak() -> None:
    args = _bench_args(
        ["--scenario", "soak", "--duration", "7.5", "--targets", "3", "--initiators", "5", "--concurrency", "2"]
        + ["--fault-interval", "0.5", "--transport", "tcp"]
    )
    soak = soak_config(config_from_args(args))
    assert (soak.duration, soak.targets, soak.initiators, soak.concurrency) == (7.5, 3, 5, 2)
    assert (soak.fault_interval, soak.transports) == (0.5, ("tcp",))
    assert soak_config(config_from_args(_bench_args(["--quick"]))).duration == 5.0


def test_bench_prints_the_rows_the_docs_show(monkeypatch: pytest.MonkeyPatch, docs_sample: Any, tmp_path: Path) -> None:
    """The table's shape and JSON, from a report the soak could give (the soak itself runs below)."""
    found = SoakReport(transfers=9, completed=8, verified=7, faults={"target": 1}, death_to_failure=[0.02, 0.03])
    found.corrupted_bytes, found.violations = 16, ["cma read-r from t: 2 words from 0x10: 2 canary (first tag 0x7fffffff)"]
    monkeypatch.setattr(soak_bench, "run_soak", lambda config: found)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench_main(["--scenario", "soak", "--no-progress", "--json", str(tmp_path / "soak.json")]) == 0
    assert docs_sample.missing(docs_sample.lines("tools.md", "hixl bench --scenario soak"), out.getvalue(), 1) == []
    rows = {r["name"]: r for r in json.loads((tmp_path / "soak.json").read_text())["rows"]}
    assert rows["corrupted bytes"]["pass"] is False and rows["leaks"]["pass"] is True
    assert rows["death -> failed, median"]["value"] == pytest.approx(25.0)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_soak_moves_no_byte_astray_and_leaks_nothing() -> None:
    report = run_soak(SoakConfig(duration=12.0, targets=2, initiators=2, concurrency=8, fault_interval=1.5, seed=7))
    print(report.summary())
    assert report.verified > 500 and report.datadist_verified > 10, report.summary()
    assert report.faults.get("target", 0) + report.faults.get("initiator", 0) > 0, report.summary()
    assert report.corrupted_bytes == 0, report.summary()
    assert report.leaks == 0, report.summary()
    assert report.ok, report.summary()


@pytest.mark.timeout(60)
def test_a_regions_query_racing_a_deregistration_does_not_bring_the_region_back() -> None:
    """What the soak found: remote_mems() answered just before a REVOKE must not reinstate the old table.

    A thread keeps asking the target for its regions while the target deregisters
    buffer after buffer; each deregistered buffer stays mapped in the target, so a
    READ that gets through would complete — and must be refused instead.
    """
    rounds = 200
    with TargetProcess([4096]) as target, hixl.Engine("127.0.0.1", {"transport": "cma"}) as engine:
        local = hixl.empty(4096)
        engine.register_mem(local)
        engine.connect(target.engine)
        if engine.transport_of(target.engine) != "cma":
            pytest.skip("cma is not available here")
        stop = threading.Event()

        def ask() -> None:
            while not stop.is_set():
                engine.remote_mems(target.engine)

        askers = [threading.Thread(target=ask, name=f"asker-{i}") for i in range(3)]
        for asker in askers:
            asker.start()
        served = []
        try:
            for i in range(rounds):
                addr = target.add_buffer(4096)
                time.sleep(0.002)
                target.deregister(i + 1)
                try:
                    engine.transfer_sync(target.engine, hixl.Op.READ, [hixl.TransferOpDesc(local.ctypes.data, addr, 4096)])
                    served.append(i)
                except hixl.MemoryRangeError:
                    pass
        finally:
            stop.set()
            for asker in askers:
                asker.join(10)
    assert not served, f"READs of deregistered buffers completed in rounds {served} of {rounds}"
