"""Types of the C extension (hixl/_accel/_native.c); the contract is hixl._accel's docstring."""

import numpy as np

GIL_FREE_FROM: int
SMALL_MAX: int
CMA_INELIGIBLE: int
CMA_STALE: int
CMA_GONE: int

def check_small(
    descs: object, local_starts: list[int], local_ends: list[int], remote_starts: list[int], remote_ends: list[int]
) -> int | None: ...
def mapped_copy(
    descs: object, write: bool, starts: list[int], ends: list[int], heres: list[int], writable: list[bool]
) -> int: ...
def copy_pieces(pieces: np.ndarray, heres: np.ndarray, write: bool) -> None: ...
def cma_copy(pid: int, pidfd: int, write: bool, descs: object, generation_page: object, generation: int) -> int: ...
