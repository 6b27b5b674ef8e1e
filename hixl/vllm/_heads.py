"""Which KV heads each tensor-parallel rank holds, and which decode rank reads which heads from where.

vLLM splits a model's ``H`` KV heads over ``tp`` ranks in order: with
``tp <= H`` rank ``r`` holds heads ``[r*H/tp, (r+1)*H/tp)``; with ``tp > H``
each head is replicated on ``tp/H`` consecutive ranks and rank ``r`` holds
head ``r*H // tp`` only. (vLLM requires one of ``H``, ``tp`` to divide the
other.)

Decode rank ``d`` needs exactly the heads it holds itself. It reads each of
them once, from the *lowest* prefill rank that holds it (its primary): so a
prefill rank that only holds replicas of heads a lower rank also holds is
never read, and knows it at once (:func:`is_read`) — it frees its blocks
without waiting for decode. Since a rank's heads are one contiguous run on
both sides, the heads decode rank ``d`` takes from one prefill rank are one
run as well: one :class:`HeadRead` per (decode rank, prefill rank).

Completions: of the decode ranks that read from a prefill rank, the lowest
(:func:`notifiers`) tells that prefill rank once every decode rank finished
its pulls of the step — exactly one completion per (prefill rank, request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HeadRead", "is_read", "notifiers", "plan_reads", "rank_heads"]


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads (model-wide indices) that TP rank ``rank`` of ``tp_size`` holds, as vLLM assigns them."""
    if num_kv_heads <= 0 or tp_size <= 0 or not 0 <= rank < tp_size:
        raise ValueError(f"no rank {rank} of TP {tp_size} with {num_kv_heads} KV heads")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over TP {tp_size}")
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise ValueError(f"TP {tp_size} is not a multiple of the {num_kv_heads} KV heads it replicates")
    head = rank * num_kv_heads // tp_size
    return range(head, head + 1)


@dataclass(frozen=True)
class HeadRead:
    """Heads ``src_heads`` of prefill rank ``prefill_rank``'s blocks go to ``dst_heads`` of decode's.

    Both are indices within each side's own tensors (a rank's first head is
    its index 0), the same number of heads.
    """

    prefill_rank: int
    src_heads: range
    dst_heads: range


def _primary(prefill_heads: Sequence[range], head: int) -> int:
    for rank, held in enumerate(prefill_heads):
        if head in held:
            return rank
    raise ValueError(f"no prefill rank holds KV head {head} (prefill ranks hold {[list(h) for h in prefill_heads]})")


def plan_reads(prefill_heads: Sequence[range], decode_heads: range) -> list[HeadRead]:
    """What a decode rank holding ``decode_heads`` reads, given the heads each prefill rank holds.

    Every head in ``decode_heads`` is read exactly once, from its primary
    prefill rank; ``ValueError`` if some prefill rank must hold it and none does.
    """
    reads: list[HeadRead] = []
    for head in decode_heads:
        rank = _primary(prefill_heads, head)
        src, dst = head - prefill_heads[rank].start, head - decode_heads.start
        last = reads[-1] if reads else None
        if last is not None and last.prefill_rank == rank and last.src_heads.stop == src:
            reads[-1] = HeadRead(rank, range(last.src_heads.start, src + 1), range(last.dst_heads.start, dst + 1))
        else:
            reads.append(HeadRead(rank, range(src, src + 1), range(dst, dst + 1)))
    return reads


def notifiers(prefill_heads: Sequence[range], decode_heads: Sequence[range]) -> dict[int, int]:
    """prefill rank -> the decode rank that tells it a request is done (the lowest that reads from it)."""
    out: dict[int, int] = {}
    for decode_rank, heads in enumerate(decode_heads):
        for read in plan_reads(prefill_heads, heads):
            out.setdefault(read.prefill_rank, decode_rank)
    return out


def is_read(prefill_heads: Sequence[range], rank: int) -> bool:
    """Whether decode ever reads from prefill rank ``rank``: it is the primary of one of its heads."""
    return any(_primary(prefill_heads, head) == rank for head in prefill_heads[rank])
