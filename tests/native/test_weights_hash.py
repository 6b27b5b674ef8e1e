"""hixl.weights' checksum (``weights_hash``, ``copy_hash``): the C twin answers exactly what the
pure one does for every length and alignment, copies exactly its range, and the hash sees every
word — one changed word anywhere, a torn mixture of two versions, a different length. Its table
rows' hash (``row_hashes``): the twins alike for every width, and the hash word left out."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from hixl._accel import GIL_FREE_FROM, pure

LENGTHS = (0, 1, 7, 8, 9, 15, 16, 17, 2047, 2048, 2049, 4095, 4096, 4097, 65536 + 3, GIL_FREE_FROM + 9)
"""Around a word, the key table (256 words: 2048 bytes), a page, the numpy chunk and the GIL-free size."""


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("offset", [0, 1, 3, 7])
@pytest.mark.parametrize("length", LENGTHS)
def test_the_twins_hash_and_copy_alike_at_any_length_and_alignment(native: ModuleType, length: int, offset: int) -> None:
    src = _bytes(length + 16, seed=length)[offset : offset + length]  # (unaligned for an odd offset)
    assert native.weights_hash(src) == pure.weights_hash(src)
    landed = []
    for impl in (native, pure):
        dst = np.full(length + 32, 0xAB, dtype=np.uint8)
        answer = impl.copy_hash(dst[5 + offset : 5 + offset + length], src)
        landed.append((answer, dst.tobytes()))
        assert answer == pure.weights_hash(src)
        assert dst[5 + offset : 5 + offset + length].tobytes() == src.tobytes()
        assert not (dst[: 5 + offset] != 0xAB).any() and not (dst[5 + offset + length :] != 0xAB).any()
    assert landed[0] == landed[1]


def test_the_hash_takes_any_contiguous_buffer(native: ModuleType) -> None:
    data = _bytes(4099)
    for impl in (native, pure):
        h = impl.weights_hash(data)
        assert impl.weights_hash(data.tobytes()) == h
        assert impl.weights_hash(bytearray(data.tobytes())) == h
        assert impl.weights_hash(memoryview(data.tobytes())) == h
        assert impl.weights_hash(data[:4096].view(np.float32).reshape(32, 32)) == impl.weights_hash(data[:4096])


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda impl: impl.weights_hash(np.zeros((4, 4), np.uint8)[:, 1]), TypeError),  # not contiguous
        (lambda impl: impl.weights_hash(17), TypeError),  # no buffer
        (lambda impl: impl.copy_hash(b"abcd", b"abcd"), TypeError),  # dst read-only
        (lambda impl: impl.copy_hash(bytearray(4), bytearray(5)), ValueError),  # sizes differ
        (lambda impl: impl.copy_hash(np.zeros((4, 4), np.uint8)[:, 1], b"abcd"), TypeError),
        (lambda impl: impl.row_hashes(np.zeros((4, 3), np.uint64), 1, np.zeros(4, np.uint64)), ValueError),  # width
        (lambda impl: impl.row_hashes(np.zeros((4, 3), np.uint64), 3, np.zeros(3, np.uint64)), ValueError),  # rows
        (lambda impl: impl.row_hashes(np.zeros((4, 3), np.uint64), 3, bytes(32)), TypeError),  # out read-only
        (lambda impl: impl.row_hashes(np.zeros((4, 3), np.uint64), 3.0, np.zeros(4, np.uint64)), TypeError),
    ],
)
def test_the_twins_refuse_alike(native: ModuleType, call: object, error: type[Exception]) -> None:
    for impl in (native, pure):
        with pytest.raises(error):
            call(impl)  # type: ignore[operator]


@pytest.mark.parametrize("impl_name", ["native", "pure"])
def test_any_one_changed_word_changes_the_hash(native: ModuleType, impl_name: str) -> None:
    """Every word position of a buffer longer than the key table (so that keys repeat) and with a
    tail, each changed in its low bit, its top bit and in all its bits: the hash sees each one."""
    impl = native if impl_name == "native" else pure
    data = _bytes(8 * 600 + 5)
    h = impl.weights_hash(data)
    words = data[:4800].view(np.uint64)
    for i in range(len(words) + 1):
        for flip in (1, 1 << 63, (1 << 64) - 1):
            changed = data.copy()
            if i < len(words):
                changed[:4800].view(np.uint64)[i] ^= np.uint64(flip)
            else:
                changed[4800] ^= 0x80  # (a tail byte)
            assert impl.weights_hash(changed) != h, (i, flip)
    assert len(words) == 600


@pytest.mark.parametrize("impl_name", ["native", "pure"])
def test_a_torn_read_of_two_versions_is_caught(native: ModuleType, impl_name: str) -> None:
    """What a reader racing a writer gets: each page from the old version or the new one. Every
    mixture of a 64-page tensor's pages cut at one point, and random mixtures: none hashes as
    either version."""
    impl = native if impl_name == "native" else pure
    old = np.random.default_rng(1).standard_normal(64 * 1024).astype(np.float32)
    new = old + np.float32(1e-3) * np.random.default_rng(2).standard_normal(old.size).astype(np.float32)
    expected = {impl.weights_hash(old), impl.weights_hash(new)}
    pages = old.size // 1024
    rng = np.random.default_rng(3)
    mixtures = [np.arange(pages) < cut for cut in range(1, pages)] + [rng.random(pages) < 0.5 for _ in range(200)]
    for from_new in mixtures:
        if from_new.all() or not from_new.any():
            continue
        torn = np.where(np.repeat(from_new, 1024), new, old)
        assert impl.weights_hash(torn) not in expected


def test_the_length_counts(native: ModuleType) -> None:
    for impl in (native, pure):
        assert len({impl.weights_hash(b"abc"), impl.weights_hash(b"abc\0"), impl.weights_hash(b"abc" + bytes(5))}) == 3
        assert impl.weights_hash(b"") != impl.weights_hash(bytes(8))


def test_no_rows_hash_to_nothing_and_empty_shapes_hash_alike(native: ModuleType) -> None:
    for impl in (native, pure):
        impl.row_hashes(np.zeros((0, 34), np.uint64), 34, np.empty(0, np.uint64))
        assert impl.weights_hash(np.zeros((0, 4), np.float32)) == pure.weights_hash(b"")


@pytest.mark.parametrize("width", [2, 3, 34, 4096])
def test_the_twins_hash_table_rows_alike(native: ModuleType, width: int) -> None:
    rows = np.random.default_rng(width).integers(0, 1 << 64, (257, width), dtype=np.uint64, endpoint=False)
    got = [np.empty(257, np.uint64) for _ in range(2)]
    native.row_hashes(rows, width, got[0])
    pure.row_hashes(rows, width, got[1])
    assert (got[0] == got[1]).all()
    assert len(set(got[0].tolist())) == 257  # random rows: no two alike
    rows[:, 1] ^= np.uint64(12345)  # the hash word is not hashed
    again = np.empty(257, np.uint64)
    native.row_hashes(rows, width, again)
    assert (again == got[0]).all()
    if width > 2:
        rows[100, width - 1] ^= np.uint64(1 << 63)  # the last payload word's top bit
        native.row_hashes(rows, width, again)
        assert again[100] != got[0][100] and (np.delete(again, 100) == np.delete(got[0], 100)).all()
