"""Tensor parallelism in real vLLM engines: prefill TP 2 -> decode TP 1, prefill TP 1 -> decode TP 2.

The tiny Llama has two KV heads, so at TP 2 each rank holds one: decode TP 1
gathers its two heads from two prefill ranks, and each rank of decode TP 2
reads its head out of the one prefill rank's blocks. Tokens must equal a
single-instance reference and vLLM must count all but the last prompt token
as loaded; zeroing the head one prefill rank sent must change them. A decode
started with another block size refuses prefill's KV (the compatibility
check) and fails the request, rather than decoding garbage.

The decode instances run :mod:`faulty_connector` (it behaves unless the fault
file says otherwise), so the controls need no instances of their own.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")
pytest.importorskip("transformers")

from instances import Instance, prefill_params, started_together  # noqa: E402
from tiny_model import BLOCK_SIZE, build, words  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Prompt lengths with BOS: 2 (one token to load), 20 (under a block), 64 (exactly two blocks),
# 100 (three blocks and part of a fourth).
PROMPTS = [words(1, 5), words(19, 1), words(63, 2), words(99, 3)]
MAX_TOKENS = 12
PAIRS = [("prefill_tp2", "decode_tp1"), ("prefill_tp1", "decode_tp2")]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fault") / "fault"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def vllms(tmp_path_factory: pytest.TempPathFactory, fault_file: Path) -> Iterator[dict[str, Instance]]:
    """Every instance of this module, started together; a TP 2 instance binds one core per rank."""
    model = build(tmp_path_factory.mktemp("model"))
    logs = tmp_path_factory.mktemp("logs")
    faulty = {"connector": "FaultyConnector", "module": "faulty_connector", "fault_file": str(fault_file)}
    specs: dict[str, tuple[str, int | str, dict[str, Any]]] = {
        "prefill_tp2": ("prefill", "0|1", {"tp": 2}),
        "prefill_tp1": ("prefill", 0, {}),
        "decode_tp1": ("decode", 1, dict(faulty)),
        "decode_tp2": ("decode", "1|0", {"tp": 2, **faulty}),
        "decode_block64": ("decode", 1, {"block_size": 64}),
        "reference": ("reference", 0, {}),
    }
    with started_together(model, logs, specs) as started:
        yield started


@pytest.fixture(scope="module")
def reference(vllms: dict[str, Instance]) -> list[dict[str, Any]]:
    return vllms["reference"].generate(PROMPTS, MAX_TOKENS)


def test_prefill_tp2_lists_both_ranks_and_its_kv(vllms: dict[str, Instance]) -> None:
    (params,) = prefill_params(vllms["prefill_tp2"], PROMPTS[3:])
    ranks = params["remote_ranks"]
    assert [r["heads"] for r in ranks] == [[0, 1], [1, 2]]  # one KV head each
    assert len({r["engine"] for r in ranks}) == 2 and len({r["cluster_id"] for r in ranks}) == 2
    kv = params["remote_kv"]
    assert (kv["tp_size"], kv["num_kv_heads"], kv["block_size"], kv["dtype"], kv["num_layers"]) == (2, 2, BLOCK_SIZE, "float32", 4)


@pytest.mark.parametrize(("prefill_name", "decode_name"), PAIRS)
def test_mixed_tp_tokens_equal_reference(
    vllms: dict[str, Instance], reference: list[dict[str, Any]], prefill_name: str, decode_name: str
) -> None:
    prefill, decode = vllms[prefill_name], vllms[decode_name]
    params = prefill_params(prefill, PROMPTS)
    outs = decode.generate(PROMPTS, MAX_TOKENS, params)
    assert [o["token_ids"] for o in outs] == [r["token_ids"] for r in reference]
    for out, p in zip(outs, params):
        assert out["num_cached_tokens"] == out["prompt_tokens"] - 1, out  # all but the last from prefill
        assert len(p["remote_block_ids"]) == _cdiv(out["prompt_tokens"], BLOCK_SIZE)
    # Decode TP 1 gathers from both prefill ranks; each decode TP 2 rank reads its head from prefill's one rank.
    sources = ["2"] if decode_name == "decode_tp1" else ["1", "1"]  # per pull log line: prefill ranks read
    lines = re.findall(r"hixl: pulled request \S+: \d+ blocks, .* from (\d) prefill rank", decode.log())
    assert lines[-len(PROMPTS) * len(sources) :] == sources * len(PROMPTS)
    # Every prefill rank hears once per request and frees its blocks, well before any timeout.
    ranks = len(params[0]["remote_ranks"])
    for p in params:
        wait_for_count(prefill, rf"request {re.escape(p['remote_request_id'])} was pulled by decode", ranks, 30)


def wait_for_count(instance: Instance, pattern: str, count: int, timeout: float) -> None:
    """Wait until ``pattern`` matches exactly ``count`` log lines (more is a failure at once)."""
    deadline = time.monotonic() + timeout
    while (found := len(re.findall(pattern, instance.log()))) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert found == count, f"{instance.role}: {found} lines matching {pattern!r}, expected {count}:\n{instance.log_tail()}"


@pytest.mark.parametrize(("prefill_name", "decode_name"), PAIRS)
def test_zeroing_one_prefill_ranks_head_changes_tokens(
    vllms: dict[str, Instance], reference: list[dict[str, Any]], fault_file: Path, prefill_name: str, decode_name: str
) -> None:
    """The control: KV head 1 zeroed after it landed (prefill TP 2: what rank 1 sent) — the tokens change."""
    params = prefill_params(vllms[prefill_name], PROMPTS)
    fault_file.write_text("zeros:1")
    try:
        outs = vllms[decode_name].generate(PROMPTS, MAX_TOKENS, params)
    finally:
        fault_file.write_text("")
    for out in outs:
        assert out["num_cached_tokens"] == out["prompt_tokens"] - 1  # it did take them from the connector
    changed = [o["token_ids"] != r["token_ids"] for o, r in zip(outs, reference)]
    print(f"\n{prefill_name} -> {decode_name}, head 1 zeroed: tokens changed per prompt {changed}")
    assert all(changed)


def test_block_size_mismatch_fails_the_request(vllms: dict[str, Instance]) -> None:
    """Decode with 64-token blocks refuses prefill's 32-token ones: the request fails, with both values logged."""
    decode = vllms["decode_block64"]
    (params,) = prefill_params(vllms["prefill_tp1"], PROMPTS[3:])
    (out,) = decode.generate(PROMPTS[3:], MAX_TOKENS, [params])
    assert len(out["token_ids"]) < MAX_TOKENS
    decode.wait_for_log(r"hixl: pull of request \S+ failed: prefill's and decode's KV caches differ \(block_size: prefill 32, decode 64\)", 5)
    # Decode still tells prefill it is done, so prefill frees the blocks at once.
    vllms["prefill_tp1"].wait_for_log(rf"request {re.escape(params['remote_request_id'])} was pulled by decode", 30)
