"""``hixl bench --scenario prefix``: its workload, and one quick real run (vLLM servers behind the proxy, routed both ways)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hixl.bench import prefix_bench
from hixl.bench.cli import main
from hixl.bench.config import BenchConfig


def test_half_the_prompt_tokens_are_a_shared_prefix_and_each_turn_extends_its_chat() -> None:
    sizes = prefix_bench.knobs(BenchConfig.full_run())
    prompts = prefix_bench.workload(sizes)
    assert prompts == prefix_bench.workload(sizes)  # the same requests in the same order, every run
    chats, turns, turn = sizes["prefix_chats"], sizes["prefix_turns"], sizes["prefix_turn_tokens"]
    assert len(prompts) == chats * turns
    system = turn * turns // 2
    openings = {tuple(p[:system]) for p in prompts}
    assert len(openings) == sizes["prefix_systems"]  # each system prompt shared by its chats
    assert system * len(prompts) * 2 == sum(map(len, prompts))  # half the prompt tokens
    firsts, seconds = prompts[:chats], prompts[chats : 2 * chats]
    moved = 0
    for i, second in enumerate(seconds, chats):  # each chat's turn 2 starts with its turn 1 (and its reply)
        [j] = [j for j, first in enumerate(firsts) if second[: len(first)] == first]
        moved += (i - j) % 2
    assert moved  # taking turns between two instances would move some chats from one to the other


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_run_reports_both_policies(tmp_path: Path) -> None:
    pytest.importorskip("vllm.distributed.kv_transfer")
    out = tmp_path / "prefix.json"
    assert main(["--scenario", "prefix", "--quick", "--no-progress", "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["scenario"] == "prefix"]
    by = {(r["transport"], r["name"]): r for r in rows}
    assert {t for t, _ in by} == {"load", "prefix"}
    computed = by[("prefix", "prefill tokens computed")]
    assert computed["baseline"] == by[("load", "prefill tokens computed")]["value"] > computed["value"]
    assert by[("prefix", "prefix-cache hit rate")]["value"] > by[("load", "prefix-cache hit rate")]["value"]
    assert by[("prefix", "time to first token, median")]["value"] > 0


