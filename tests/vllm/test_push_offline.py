"""Push mode in real vLLM engines: offline ``vllm.LLM`` instances in separate processes, as the proxy drives them.

Prefill and decode get the same prompts at once with one push id each (what
``hixl proxy --kv-mode push`` sends); decode learns where prefill's KV lives
from one pull-mode answer first (as the proxy does). Every prompt's decode
tokens must equal a single-instance reference, vLLM must count all but the
last prompt token as loaded by the connector, and prefill must report each
request pushed — TP 1 -> 1 and prefill TP 2 -> decode TP 1 (decode gathers its
two KV heads from two prefill ranks' writes).
"""

from __future__ import annotations

import concurrent.futures
import re
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")
pytest.importorskip("transformers")

from instances import Instance, prefill_params, started_together  # noqa: E402
from tiny_model import build, words  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Prompt lengths with BOS: 2 (one token to push), 20 (part of a block), 64 (two blocks), 100 (part of a fourth).
PROMPTS = [words(1, 5), words(19, 1), words(63, 2), words(99, 3)]
MAX_TOKENS = 12
PUSH = {"mode": "push", "push_timeout": 60.0}


@pytest.fixture(scope="module")
def vllms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Instance]]:
    """Every instance of this module, started together."""
    model = build(tmp_path_factory.mktemp("model"))
    specs: dict[str, tuple[str, int | str, dict[str, Any]]] = {
        "prefill": ("prefill", 0, dict(PUSH)),
        "prefill_tp2": ("prefill", "0|1", {"tp": 2, **PUSH}),
        "decode": ("decode", 1, dict(PUSH)),
        "reference": ("reference", 1, {}),
    }
    with started_together(model, tmp_path_factory.mktemp("logs"), specs) as started:
        yield started


@pytest.fixture(scope="module")
def reference(vllms: dict[str, Instance]) -> list[list[int]]:
    return [o["token_ids"] for o in vllms["reference"].generate(PROMPTS, MAX_TOKENS)]


def pushed(prefill: Instance, decode: Instance, prompts: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Send ``prompts`` to both at once, as the proxy does in push mode; (prefill's outputs, decode's)."""
    (learned,) = prefill_params(prefill, prompts[:1])  # a pull's answer: where prefill's KV lives
    source = {"remote_ranks": learned["remote_ranks"], "remote_kv": learned["remote_kv"]}
    ids = [secrets.randbelow(2**63 - 1) + 1 for _ in prompts]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefilled = pool.submit(prefill.generate, prompts, 1, [{"do_remote_decode": True, "push_id": i} for i in ids])
        decoded = pool.submit(decode.generate, prompts, MAX_TOKENS, [{"do_remote_prefill": True, "push_id": i, **source} for i in ids])
        return prefilled.result(timeout=300), decoded.result(timeout=300)


@pytest.mark.parametrize("prefill_name", ["prefill", "prefill_tp2"])
def test_pushed_tokens_equal_reference(vllms: dict[str, Instance], reference: list[list[int]], prefill_name: str) -> None:
    prefill = vllms[prefill_name]
    prefill_outs, decode_outs = pushed(prefill, vllms["decode"], PROMPTS)
    assert [o["token_ids"] for o in decode_outs] == reference
    for out in decode_outs:
        assert out["num_cached_tokens"] == out["prompt_tokens"] - 1, out  # all but the last from prefill's push
    for out in prefill_outs:
        params = out["kv_transfer_params"]
        assert params["pushed"] is True and len(params["remote_ranks"]) == (2 if prefill_name == "prefill_tp2" else 1), params
    log = vllms["decode"].log()
    for out in prefill_outs:
        assert f"push {out['kv_transfer_params']['push_id']} landed" in log  # decode's worker saw each land
    assert not re.search(r"push \d+ failed", log)  # none failed (by push_timeout or otherwise)
