"""What a benchmark run measures: :class:`BenchConfig`, its presets, and size parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

__all__ = ["FULL_SIZES", "QUICK_SIZES", "BenchConfig", "format_size", "parse_size"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: Single-transfer sizes of the bandwidth sweep: 4 KiB up to 512 MiB, about x16 apart.
FULL_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 512 * MiB)
QUICK_SIZES = (4 * KiB, 64 * KiB, 1 * MiB)

TRANSPORTS = ("cma", "shm", "tcp")
"""Every transport the bench can measure (``--transport``); which a scenario measures by default:
:data:`hixl.bench.scenarios.DEFAULT_TRANSPORTS`."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": KiB,
    "kib": KiB,
    "m": MiB,
    "mb": MiB,
    "mib": MiB,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
}


def parse_size(text: str) -> int:
    """``"4096"``, ``"64K"``, ``"16MiB"``, ``"1g"`` -> bytes (binary units; case-insensitive)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 4096, 64K, 16M, 1G)")
    value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """``4096`` -> ``"4 KiB"``; exact binary multiples get a unit, anything else stays in bytes."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class BenchConfig:
    """Everything a scenario needs to know; build one with :meth:`full_run` or :meth:`quick_run`.

    Bandwidth figures are medians over ``repeat`` timed repetitions after
    ``warmup`` untimed ones; each repetition moves at least ``bytes_per_rep``
    (in up to ``max_iterations`` transfers) so small sizes are not lost in timer
    noise. Latency figures are taken over ``iterations`` single transfers.
    """

    transports: tuple[str, ...] = ("cma", "tcp")
    sizes: tuple[int, ...] = FULL_SIZES
    repeat: int = 5
    warmup: int = 1
    iterations: int = 2000
    latency_sizes: tuple[int, ...] = (8, 4 * KiB)
    bytes_per_rep: int = 64 * MiB
    max_iterations: int = 500
    batch_blocks: int = 4096
    batch_block_size: int = 16 * KiB
    align_size: int = 64 * MiB
    align_offset: int = 8
    rss_size: int = 512 * MiB
    idle_seconds: float = 3.0
    quick: bool = False
    target_netns: bool = False
    """Also run the TCP phases with the target in another network namespace, behind a veth pair."""
    extra: dict[str, object] = field(default_factory=dict)
    """Free-form options for scenarios that need more than the above: the ``kv`` scenario's cache shape
    (``kv_layers``, ``kv_tokens``, ``kv_block_sizes``; see :func:`hixl.bench.kv_bench.shape_of`)."""

    @classmethod
    def full_run(cls) -> BenchConfig:
        """The default run: every size up to 512 MiB, five repetitions (a few tens of seconds)."""
        return cls()

    @classmethod
    def quick_run(cls) -> BenchConfig:
        """A smoke run of a few seconds: small sizes, two repetitions, short idle window."""
        return cls(
            sizes=QUICK_SIZES,
            repeat=2,
            iterations=50,
            bytes_per_rep=1 * MiB,
            max_iterations=20,
            batch_blocks=64,
            align_size=1 * MiB,
            rss_size=4 * MiB,
            idle_seconds=0.2,
            quick=True,
        )

    def capped(self, max_size: int) -> BenchConfig:
        """This config with no transfer larger than ``max_size`` bytes (latency sizes are kept)."""
        sizes = tuple(s for s in self.sizes if s <= max_size) or (max_size,)
        blocks = max(1, min(self.batch_blocks, max_size // self.batch_block_size))
        return replace(
            self,
            sizes=sizes,
            align_size=min(self.align_size, max_size),
            rss_size=min(self.rss_size, max_size),
            batch_blocks=blocks,
        )

    @property
    def largest(self) -> int:
        """The largest single transfer of the run (what the big buffers must hold)."""
        return max((*self.sizes, self.align_size + self.align_offset, self.rss_size))
