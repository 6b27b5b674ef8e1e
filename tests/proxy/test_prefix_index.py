"""The prefix index and the event log that feeds it, without sockets: vLLM-format batches in, cached tokens and replays out."""

from __future__ import annotations

import pytest

pytest.importorskip("msgspec")

from hixl.proxy.event_log import EventLog, LogState  # noqa: E402
from hixl.proxy.kv_events import AllCleared, Removed, Stored, decode_batch  # noqa: E402
from hixl.proxy.prefix_index import PrefixIndex  # noqa: E402

from .kv_publisher import BLOCK, batch, removed, stored  # noqa: E402

PROMPT = list(range(100, 112))  # three blocks
TIMEOUT = 3.0


def indexed(*events: dict) -> PrefixIndex:
    index = PrefixIndex()
    index.apply(decode_batch(batch(*events)))
    return index


def test_a_prompt_matches_its_longest_run_of_cached_leading_blocks() -> None:
    first, parent = stored(PROMPT[:8])
    index = indexed(first, stored(PROMPT[8:], parent)[0])
    assert index.block_size == BLOCK and len(index) == 3
    assert index.cached_tokens(PROMPT) == 12
    assert index.cached_tokens(PROMPT + [1, 2, 3]) == 12  # (a partial last block is never cached)
    assert index.cached_tokens(PROMPT[:6]) == 4
    assert index.cached_tokens(PROMPT[:4] + [0] + PROMPT[5:]) == 4  # a block differs: the walk stops there
    assert index.cached_tokens(PROMPT[4:]) == 0  # the same tokens, not at the start: another chain


def test_an_evicted_block_cuts_the_chain_after_it_as_in_vllm() -> None:
    first, _ = stored(PROMPT)
    index = indexed(first, removed([first["block_hashes"][1]]))
    assert index.cached_tokens(PROMPT) == 4 and len(index) == 2
    index.apply([Stored((first["block_hashes"][1],), first["block_hashes"][0], tuple(PROMPT[4:8]), BLOCK, True)])
    assert index.cached_tokens(PROMPT) == 12  # stored again: its children are reachable again
    index.apply([AllCleared()])
    assert index.cached_tokens(PROMPT) == 0 and len(index) == 0


@pytest.mark.parametrize(
    "extra",
    [{"lora_name": "adapter"}, {"extra_keys": [None, ("salt",), None]}, {"medium": "CPU"}, {"group_idx": 1}],
    ids=["lora", "salted", "offloaded", "other-group"],
)
def test_blocks_a_prompts_tokens_cannot_match_are_left_out(extra: dict) -> None:
    event, _ = stored(PROMPT, **extra)
    assert decode_batch(batch(event)) == [Stored(tuple(event["block_hashes"]), None, tuple(PROMPT), BLOCK, False)]
    assert indexed(event).cached_tokens(PROMPT) == 0


def test_unknown_event_types_and_fields_are_ignored() -> None:
    event, _ = stored(PROMPT, future_field=1)
    assert decode_batch(batch({"type": "BlockTouched"}, event, removed([b"x"]))) == [
        Stored(tuple(event["block_hashes"]), None, tuple(PROMPT), BLOCK, True), Removed((b"x",), True),
    ]  # fmt: skip


def test_batches_in_order_are_applied_and_the_log_is_live() -> None:
    log = EventLog("p", TIMEOUT, now=0.0)
    assert log.state(0.0) is LogState.SYNCING and log.replay_due(0.0) == 0
    log.replayed(0, [], now=0.1)  # a full replay: nothing published yet
    assert log.live(0.1) and log.replay_due(0.1) is None
    first, parent = stored(PROMPT[:4])
    log.published(0, batch(first), now=0.2)
    log.published(1, batch(stored(PROMPT[4:], parent)[0]), now=0.3)
    assert log.index.cached_tokens(PROMPT) == 12 and log.resyncs == 0


def test_a_gap_is_filled_by_a_replay_that_proves_it_follows_on() -> None:
    log = EventLog("p", TIMEOUT, now=0.0)
    first, parent = stored(PROMPT[:4])
    second, parent2 = stored(PROMPT[4:8], parent)
    third, _ = stored(PROMPT[8:], parent2)
    payloads = [batch(first), batch(second), batch(third)]
    log.replayed(0, [(0, payloads[0])], now=0.0)
    log.published(2, payloads[2], now=0.1)  # batch 1 went missing
    assert log.replay_due(0.1) == 0 and log.index.cached_tokens(PROMPT) == 4  # from the last applied, as proof
    log.replayed(0, list(enumerate(payloads)), now=0.2)
    assert log.index.cached_tokens(PROMPT) == 12 and log.replay_due(0.2) is None
    log.published(2, payloads[2], now=0.3)  # the same batch again, from PUB: not a restart
    assert log.resyncs == 0 and log.live(0.3)


def test_a_sequence_going_back_drops_the_index_and_asks_for_a_full_replay() -> None:
    log = EventLog("p", TIMEOUT, now=0.0)
    first, _ = stored(PROMPT)
    log.replayed(0, [(0, batch(first)), (1, batch(removed([b"?"])))], now=0.0)
    assert log.index.cached_tokens(PROMPT) == 12
    log.published(0, batch(stored(PROMPT[:4])[0]), now=0.1)  # a restarted instance's first batch
    assert log.resyncs == 1 and log.index.cached_tokens(PROMPT) == 0
    assert log.state(0.1) is LogState.SYNCING and log.replay_due(0.1) == 0
    log.replayed(0, [(0, batch(stored(PROMPT[:4])[0]))], now=0.2)
    assert log.live(0.2) and log.index.cached_tokens(PROMPT) == 4


def test_a_replay_of_another_history_drops_the_index() -> None:
    log = EventLog("p", TIMEOUT, now=0.0)
    first, _ = stored(PROMPT)
    log.replayed(0, [(0, batch(first))], now=0.0)
    probe = log.replay_due(TIMEOUT / 3)
    assert probe == 0  # silent for a third of the timeout: a probe, from the last batch applied
    log.replayed(0, [(0, batch(removed([b"?"])))], now=1.1)  # batch 0 is not the one applied: another instance
    assert log.resyncs == 1 and log.index.cached_tokens(PROMPT) == 0 and log.replay_due(1.1) == 0


def test_a_full_replay_whose_oldest_batches_were_dropped_builds_from_what_is_left() -> None:
    log = EventLog("p", TIMEOUT, now=0.0)
    first, parent = stored(PROMPT[:4])
    log.replayed(0, [(7, batch(first)), (8, batch(stored(PROMPT[4:], parent)[0]))], now=0.0)
    assert log.live(0.0) and log.index.cached_tokens(PROMPT) == 12
    log.published(9, batch(removed([parent])), now=0.1)
    assert log.index.cached_tokens(PROMPT) == 0


def test_silence_is_probed_and_without_an_answer_the_log_is_not_live() -> None:
    log = EventLog("p", TIMEOUT, now=0.0)
    applied = batch(stored(PROMPT)[0])
    log.replayed(0, [(0, applied)], now=0.0)
    assert log.replay_due(0.9) is None and log.next_probe(0.9) == pytest.approx(0.1)
    assert log.replay_due(1.0) == 0
    assert log.live(TIMEOUT - 0.01) and log.state(TIMEOUT) is LogState.SILENT
    log.replayed(0, [(0, applied)], now=TIMEOUT + 1)  # it answers again: the same history
    assert log.live(TIMEOUT + 1) and log.resyncs == 0 and log.index.cached_tokens(PROMPT) == 12
