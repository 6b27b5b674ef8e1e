"""The head mapping between tensor-parallel ranks (:mod:`hixl.vllm._heads`), for every pair of TP sizes.

Pure functions, no vLLM instance: each check recomputes what must hold from
vLLM's assignment (:func:`rank_heads`) and compares with the plan.
"""

from __future__ import annotations

import itertools

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")

from hixl.vllm._heads import HeadRead, is_read, notifiers, plan_reads, rank_heads  # noqa: E402

SIZES = [1, 2, 4, 8]
HEADS = [1, 2, 8]


def test_rank_heads_as_vllm_assigns_them() -> None:
    assert [rank_heads(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [rank_heads(1, 2, r) for r in range(2)] == [range(0, 1)] * 2
    with pytest.raises(ValueError, match="do not split"):
        rank_heads(6, 4, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        rank_heads(4, 6, 0)
    with pytest.raises(ValueError, match="no rank 2 of TP 2"):
        rank_heads(2, 2, 2)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "num_heads"), list(itertools.product(SIZES, SIZES, HEADS)))
def test_every_needed_head_is_read_exactly_once(prefill_tp: int, decode_tp: int, num_heads: int) -> None:
    prefill = [rank_heads(num_heads, prefill_tp, r) for r in range(prefill_tp)]
    decode = [rank_heads(num_heads, decode_tp, r) for r in range(decode_tp)]
    readers: dict[int, set[int]] = {}
    for decode_rank, needed in enumerate(decode):
        reads = plan_reads(prefill, needed)
        got: list[int] = []
        for read in reads:
            assert len(read.src_heads) == len(read.dst_heads) > 0
            src = [prefill[read.prefill_rank][h] for h in read.src_heads]  # model-wide head indices
            dst = [needed[h] for h in read.dst_heads]
            assert src == dst  # the same heads on both sides
            # From the lowest prefill rank holding each head.
            assert all(read.prefill_rank == min(r for r, held in enumerate(prefill) if h in held) for h in src)
            got += dst
            readers.setdefault(read.prefill_rank, set()).add(decode_rank)
        assert sorted(got) == list(needed)  # each needed head once, none it does not need
        assert len({r.prefill_rank for r in reads}) == len(reads)  # one run per prefill rank
    assert notifiers(prefill, decode) == {p: min(d) for p, d in readers.items()}
    assert [is_read(prefill, p) for p in range(prefill_tp)] == [p in readers for p in range(prefill_tp)]
    # Whatever prefill ranks decode never reads hold only replicas of heads it reads elsewhere.
    for p in range(prefill_tp):
        if p not in readers:
            assert all(any(h in prefill[q] for q in readers) for h in prefill[p])


def test_gather_and_split_examples() -> None:
    two = [range(0, 1), range(1, 2)]  # prefill TP 2, 2 heads
    assert plan_reads(two, range(0, 2)) == [HeadRead(0, range(0, 1), range(0, 1)), HeadRead(1, range(0, 1), range(1, 2))]
    assert plan_reads([range(0, 2)], range(1, 2)) == [HeadRead(0, range(1, 2), range(0, 1))]  # decode TP 2, rank 1


def test_a_head_no_prefill_rank_holds_is_an_error() -> None:
    with pytest.raises(ValueError, match="no prefill rank holds KV head 2"):
        plan_reads([range(0, 1), range(1, 2)], range(0, 4))
