"""Which prompt prefixes one vLLM instance holds in its prefix cache, as its KV events tell (no I/O).

vLLM caches a prompt's KV per full block (``block_size`` tokens) under a hash
chained over the blocks: a block's hash covers its parent's hash and its own
token ids (and a LoRA, multimodal inputs or a cache salt, where a request has
them). A request hits the cache for its longest run of leading blocks whose
hashes are cached, and stops at the first that is not.

The proxy does not compute these hashes: they start from a seed (``NONE_HASH``)
that a vLLM may draw at random per process, and from a hash function an
instance chooses; a proxy that guessed either wrong would match nothing, and
never know. Each ``BlockStored`` event carries the blocks' token ids and their
parent's hash, so the index keeps, for each cached block, *(its parent's hash,
its tokens) -> its hash*, and matches a prompt by walking that map block by
block from the first, exactly as vLLM walks its hashes: a block whose parent was
evicted is unreachable here as it is there. Blocks whose hashes took more than
token ids (:attr:`Stored.plain` false) are not indexed: a prompt's tokens could
not tell whether it would hit them. What the index does not know it counts as
not cached, so it errs toward too few cached tokens, never too many, as long as
it is fed an unbroken run of an instance's events (:mod:`event_log`'s job).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .kv_events import AllCleared, BlockHash, Event, Removed, Stored

__all__ = ["PrefixIndex"]

_Key = tuple[BlockHash | None, tuple[int, ...]]  # (parent's hash, the block's token ids)


class PrefixIndex:
    """One instance's cached blocks, matched against prompts' token ids."""

    def __init__(self) -> None:
        self.block_size: int | None = None
        """Tokens per block: the first indexed event's (until :meth:`clear`)."""
        self._keys: dict[BlockHash, _Key] = {}  # a block's hash -> how it is reached
        self._blocks: dict[_Key, BlockHash] = {}  # the walk's map, the inverse of _keys

    def apply(self, events: Iterable[Event]) -> None:
        """Follow ``events``, in the order the instance published them."""
        for event in events:
            if isinstance(event, Stored):
                self._store(event)
            elif isinstance(event, Removed):
                if event.plain:
                    for block in event.hashes:
                        self._forget(block)
            elif isinstance(event, AllCleared):
                self.clear()

    def clear(self) -> None:
        """Forget every block (the instance's cache was reset, or its events can no longer be trusted)."""
        self.block_size = None
        self._keys.clear()
        self._blocks.clear()

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a prompt of ``tokens`` the instance holds: whole blocks only."""
        size = self.block_size
        if size is None:
            return 0
        parent: BlockHash | None = None
        matched = 0
        for start in range(0, len(tokens) - size + 1, size):
            block = self._blocks.get((parent, tuple(tokens[start : start + size])))
            if block is None:
                break
            parent, matched = block, start + size
        return matched

    def _store(self, event: Stored) -> None:
        size = event.block_size
        if not event.plain or size < 1 or len(event.tokens) != size * len(event.hashes):
            return  # not matchable by token ids, or a shape not understood: left out (counted as not cached)
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:
            return  # (a hybrid model's other block size: its blocks are not a prompt's plain prefix)
        parent = event.parent
        for i, block in enumerate(event.hashes):
            key = (parent, event.tokens[i * size : (i + 1) * size])
            self._forget(block)  # (stored again: reached the same way, the same hash being the same content)
            self._keys[block] = key
            self._blocks[key] = block
            parent = block

    def _forget(self, block: BlockHash) -> None:
        key = self._keys.pop(block, None)
        if key is not None and self._blocks.get(key) == block:
            del self._blocks[key]

    def __len__(self) -> int:
        """Blocks indexed."""
        return len(self._keys)

    def __repr__(self) -> str:
        return f"<PrefixIndex {len(self)} blocks of {self.block_size} tokens>"
