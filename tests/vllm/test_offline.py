"""The connector in real vLLM engines: offline ``vllm.LLM`` instances in separate processes.

One prefill instance (kv_producer), decode instances (kv_consumer: layer-wise
with the default settings, synchronous with the ``recompute`` failure policy,
and one with a connector that misbehaves on demand) and a plain single-instance
reference, all on the same tiny random-weight Llama. Every prompt's decode
tokens must equal the reference's, and vLLM must report that decode took all
but the last prompt token from the connector rather than computing them —
matching tokens alone would also come from a connector that moves nothing.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")
pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

from instances import Instance, prefill_params, started_together  # noqa: E402
from tiny_model import BLOCK_SIZE, build, words  # noqa: E402

from hixl.vllm._timeline import ENV as TIMELINE_ENV  # noqa: E402
from hixl.vllm._timeline import phases  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Prompt lengths with BOS: 2 (one token to load), 20 (part of a block), 33 (a block and
# one token), 64 (exactly two blocks), 100 (three blocks and part of a fourth).
PROMPTS = [words(1, 5), words(19, 1), words(32, 4), words(63, 2), words(99, 3)]
MAX_TOKENS = 12
LEASE_S = 6.0  # short, so that a dead decode's blocks go soon; decode extends it while a request waits
RELEASE_TIMEOUT = 15.0
BLOCK_BYTES = 4 * 2 * BLOCK_SIZE * 128 * 4  # a block of every layer: 4 layers x 2 KV heads x 32 tokens x (K+V) 128 x fp32
# Decode pulls requests of up to two blocks whole, longer ones (the last prompt's four) layer by layer.
WHOLE_BELOW = 3 * BLOCK_BYTES


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault") / "fault"


@pytest.fixture(scope="module")
def timeline_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("timeline") / "decode.jsonl"


@pytest.fixture(scope="module")
def vllms(tmp_path_factory: pytest.TempPathFactory, fault_file: Path, timeline_file: Path) -> Iterator[dict[str, Instance]]:
    """Every instance of this module, started together (each takes tens of seconds to start)."""
    model = build(tmp_path_factory.mktemp("model"))
    logs = tmp_path_factory.mktemp("logs")
    specs: dict[str, tuple[str, int | str, dict[str, Any]]] = {
        # Prefill's engine steps on its own while it holds blocks: give it a core of its own.
        "prefill": ("prefill", 0, {"lease_s": LEASE_S, "release_timeout": RELEASE_TIMEOUT}),
        # The defaults (layer-wise, fail on load errors) but small requests whole, and the timeline on.
        "decode": ("decode", 1, {"whole_below_bytes": WHOLE_BELOW, "env": {TIMELINE_ENV: str(timeline_file)}}),
        "decode_sync": ("decode", 1, {"load_mode": "sync", "kv_load_failure_policy": "recompute"}),
        "faulty": (  # every request layer-wise: its faults strike between layers
            "decode", 1, {"connector": "FaultyConnector", "module": "faulty_connector", "fault_file": str(fault_file), "whole_below_bytes": 0},
        ),  # fmt: skip
        "reference": ("reference", 1, {}),
        # A second prefill, SIGKILLed by a test.
        "victim": ("prefill", 0, {"lease_s": LEASE_S, "release_timeout": RELEASE_TIMEOUT}),
    }
    with started_together(model, logs, specs) as started:
        yield started


@pytest.fixture(scope="module")
def reference(vllms: dict[str, Instance]) -> list[dict[str, Any]]:
    return vllms["reference"].generate(PROMPTS, MAX_TOKENS)


def prefill(vllms: dict[str, Instance], prompts: list[str] = PROMPTS) -> list[dict[str, Any]]:
    """Prefill ``prompts`` for remote decode; returns the kv_transfer_params decode needs."""
    return prefill_params(vllms["prefill"], prompts)


def assert_loaded_externally(decode: Instance, outs: list[dict[str, Any]], params: list[dict[str, Any]]) -> None:
    """vLLM counted all but the last prompt token as loaded, and the connector pulled their blocks."""
    for out, p in zip(outs, params):
        assert out["num_cached_tokens"] == out["prompt_tokens"] - 1, out
        line = decode.wait_for_log(r"hixl: pulled request \S+: (\d+) blocks.*\n", 5)
        assert line  # the pull was logged (per-request figures, see the closing note)
        assert len(p["remote_block_ids"]) == _cdiv(out["prompt_tokens"], BLOCK_SIZE)


def test_prefill_returns_plain_json_params(vllms: dict[str, Instance]) -> None:
    import json

    (params,) = prefill(vllms, PROMPTS[4:])
    assert json.loads(json.dumps(params)) == params
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    (rank,) = params["remote_ranks"]  # TP 1: one rank, holding both KV heads
    assert rank["heads"] == [0, 2]
    host, port = rank["engine"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0  # picked by the OS: nothing configured
    assert params["remote_num_tokens"] == 100 and len(params["remote_block_ids"]) == 4


@pytest.mark.parametrize("decode_name", ["decode", "decode_sync"])
def test_decode_tokens_equal_reference(vllms: dict[str, Instance], reference: list[dict[str, Any]], decode_name: str) -> None:
    decode = vllms[decode_name]
    params = prefill(vllms)
    outs = decode.generate(PROMPTS, MAX_TOKENS, params)
    assert [o["token_ids"] for o in outs] == [r["token_ids"] for r in reference]
    assert all(len(o["token_ids"]) == MAX_TOKENS for o in outs)
    for out, p in zip(outs, params):
        assert out["num_cached_tokens"] == out["prompt_tokens"] - 1, out  # all but the last from prefill
        assert len(p["remote_block_ids"]) == _cdiv(out["prompt_tokens"], BLOCK_SIZE)
    pulls = re.findall(r"hixl: pulled request (\S+): (\d+) blocks, .* in ([\d.]+) ms \((\w+)\), first layer usable after ([\d.]+) ms", decode.log())
    modes = ("sync",) if decode_name == "decode_sync" else ("layerwise", "whole")
    mine = [p for p in pulls if p[3] in modes][-len(PROMPTS) :]
    assert sorted(int(p[1]) for p in mine) == sorted(_cdiv(o["prompt_tokens"] - 1, BLOCK_SIZE) for o in outs)
    if decode_name == "decode":  # whole up to WHOLE_BELOW, layer-wise above
        assert all((p[3] == "whole") == (int(p[1]) * BLOCK_BYTES < WHOLE_BELOW) for p in mine), mine
    print(f"\n{decode_name} pulls (request, blocks, total ms, mode, first layer ms):", mine)
    # Prefill frees each request's blocks once decode reports it pulled them, well before the lease ends.
    for p in params:
        vllms["prefill"].wait_for_log(rf"request {re.escape(p['remote_request_id'])} was pulled by decode", LEASE_S / 2)


def test_timeline_shows_each_load_whole_below_the_threshold_layerwise_above(
    vllms: dict[str, Instance], reference: list[dict[str, Any]], timeline_file: Path
) -> None:
    """Decode's timeline file gets one record per request, in the mode its size chose, each step of the load in
    order; the whole pulls land the same bytes as layer-wise ones (the tokens equal the reference's)."""
    seen = len(timeline_file.read_text().splitlines()) if timeline_file.exists() else 0
    params = prefill(vllms)
    outs = vllms["decode"].generate(PROMPTS, MAX_TOKENS, params)
    assert [o["token_ids"] for o in outs] == [r["token_ids"] for r in reference]
    records = [json.loads(line) for line in timeline_file.read_text().splitlines()[seen:]]
    assert len(records) == len(PROMPTS) and all(r["connector"] == "hixl" and r["rank"] == 0 for r in records)
    assert sorted(r["nbytes"] for r in records) == sorted(_cdiv(o["prompt_tokens"] - 1, BLOCK_SIZE) * BLOCK_BYTES for o in outs)
    assert {r["mode"] for r in records} == {"whole", "layerwise"}
    for r in records:
        assert r["mode"] == ("whole" if r["nbytes"] < WHOLE_BELOW else "layerwise"), r
        assert len(r["layers"]) == 4 and r["sync_ref"] > 0, r
        assert r["start"] <= r["issued"] and r["usable"] == r["layers"][-1][0] <= r["step_end"], r
        for landed, asked, noticed in r["layers"]:
            assert r["start"] <= landed <= noticed and asked <= noticed <= r["step_end"], r
        if r["mode"] == "whole":  # landed (all at once) before vLLM asked for any layer
            assert len({layer[0] for layer in r["layers"]}) == 1 and r["usable"] <= r["layers"][0][1], r
    assert set(phases(records)) == {
        "issued", "first layer landed", "usable", "vLLM first asked", "waiting for the copy",
        "waiting for the interpreter", "step end", "sync_ref",
    }  # fmt: skip


def test_zeroed_kv_gives_different_tokens(vllms: dict[str, Instance], reference: list[dict[str, Any]], fault_file: Path) -> None:
    """The control: the same pull, then the pulled blocks zeroed — so the pulled KV is what made tokens match."""
    fault_file.write_text("zeros")
    params = prefill(vllms)
    outs = vllms["faulty"].generate(PROMPTS, MAX_TOKENS, params)
    fault_file.write_text("")
    for out, ref in zip(outs, reference):
        assert out["num_cached_tokens"] == out["prompt_tokens"] - 1  # it did take them from the connector
        assert out["token_ids"] != ref["token_ids"]


def test_failed_pull_fails_the_request(vllms: dict[str, Instance]) -> None:
    """A pull that cannot happen (nobody at that address) fails that request, promptly, under policy=fail:
    the request waits for its link only until a few attempts in a row were refused, not half a lease."""
    (params,) = prefill(vllms, PROMPTS[1:2])
    dead = dict(params, remote_ranks=[{"engine": "127.0.0.1:1", "cluster_id": 7, "heads": [0, 2]}])
    started = time.monotonic()
    (out,) = vllms["decode"].generate(PROMPTS[1:2], MAX_TOKENS, [dead])
    assert time.monotonic() - started < 0.75 * LEASE_S  # (did not wait for the lease: ~2 s here, more on a busy CI core)
    assert len(out["token_ids"]) < MAX_TOKENS
    vllms["decode"].wait_for_log(r"hixl: pull of request \S+ failed", 5)
    # Its real blocks at prefill: nobody extends their lease, so they go a lease after prefill held them.
    vllms["prefill"].wait_for_log(rf"request {re.escape(params['remote_request_id'])}: its lease expired", LEASE_S + 5)


def test_failed_pull_recomputes_under_recompute_policy(vllms: dict[str, Instance], reference: list[dict[str, Any]]) -> None:
    (params,) = prefill(vllms, PROMPTS[4:])
    dead = dict(params, remote_ranks=[{"engine": "127.0.0.1:1", "cluster_id": 7, "heads": [0, 2]}])
    (out,) = vllms["decode_sync"].generate(PROMPTS[4:], MAX_TOKENS, [dead])
    assert out["token_ids"] == reference[4]["token_ids"]


def test_a_pull_whose_link_broke_is_retried_after_relinking(
    vllms: dict[str, Instance], reference: list[dict[str, Any]], fault_file: Path
) -> None:
    """Decode's link to prefill is closed just before the pull (as when a starved prefill is declared dead):
    the connector relinks, prefill confirms the request's lease, the pull runs again and the request gets
    the reference's tokens instead of failing."""
    params = prefill(vllms, PROMPTS[4:])
    fault_file.write_text("droplink")
    (out,) = vllms["faulty"].generate(PROMPTS[4:], MAX_TOKENS, params)
    assert fault_file.read_text() == ""  # the fault struck
    assert out["token_ids"] == reference[4]["token_ids"]
    assert out["num_cached_tokens"] == out["prompt_tokens"] - 1  # from the connector, not recomputed
    faulty = vllms["faulty"]
    faulty.wait_for_log(r"hixl: request \S+: its pull broke on the link .*; relinking to retry it once", 5)
    faulty.wait_for_log(r"hixl: request \S+: relinked and its lease confirmed in [\d.]+ ms; pulling again", 5)
    faulty.wait_for_log(r"hixl: pulled request \S+: 4 blocks, .*; retried after relinking", 5)
    vllms["prefill"].wait_for_log(rf"request {re.escape(params[0]['remote_request_id'])} was pulled by decode", LEASE_S / 2)


def test_a_killed_prefill_still_fails_the_request_fast(vllms: dict[str, Instance], reference: list[dict[str, Any]]) -> None:
    """A prefill SIGKILLed after it prefilled (decode linked to it by an earlier request): the retry's one
    relink is refused at once, so the request fails within a fraction of the lease, as before; nothing hangs."""
    victim, decode = vllms["victim"], vllms["decode"]
    (out,) = decode.generate(PROMPTS[1:2], MAX_TOKENS, prefill_params(victim, PROMPTS[1:2]))
    assert out["token_ids"] == reference[1]["token_ids"]  # linked, and it serves
    params = prefill_params(victim, PROMPTS[4:])
    failed_before = decode.log().count("hixl: pull of request")
    for proc in [*psutil.Process(victim.proc.pid).children(recursive=True), psutil.Process(victim.proc.pid)]:
        proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    started = time.monotonic()
    (out,) = decode.generate(PROMPTS[4:], MAX_TOKENS, params)
    assert time.monotonic() - started < LEASE_S / 2
    assert len(out["token_ids"]) < MAX_TOKENS  # failed (policy fail), not answered
    assert decode.log().count("hixl: pull of request") == failed_before + 1, decode.log_tail()


def test_decode_dying_mid_pull_leaves_prefill_healthy(vllms: dict[str, Instance], reference: list[dict[str, Any]], fault_file: Path) -> None:
    """Decode is SIGKILLed inside a layer-wise pull; prefill frees those blocks when their leases run out, and serves on."""
    params = prefill(vllms, PROMPTS[3:])
    fault_file.write_text("die")
    with pytest.raises(RuntimeError, match="exited"):
        vllms["faulty"].generate(PROMPTS[3:], MAX_TOKENS, params)
    for p in params:
        vllms["prefill"].wait_for_log(
            rf"request {re.escape(p['remote_request_id'])}: its lease expired", LEASE_S + 10
        )
    again = prefill(vllms, PROMPTS[3:])
    outs = vllms["decode"].generate(PROMPTS[3:], MAX_TOKENS, again)
    assert [o["token_ids"] for o in outs] == [r["token_ids"] for r in reference[3:]]
