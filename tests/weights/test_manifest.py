"""Manifests and table descriptions come from a peer: every field is checked, and a bad one is
refused whole, with a clear error, before a byte is read."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import hixl
from hixl.weights import Manifest, ManifestError, Publisher, Subscriber, _wire

from .peers import CountingEngine

BASE, SIZE = 0x10000, 1 << 16
REGISTERED = [hixl.MemDesc(BASE, SIZE)]


def doc(**changes: Any) -> dict[str, Any]:
    good = {
        "format": 1,
        "checksum": "mlh64",
        "version": 3,
        "slot": 1,
        "header": BASE + 8,
        "regions": [[BASE + 4096, 8192]],
        "tensors": [["w", "float32", [4, 8], 0, 0, 123], ["b", "bfloat16", [16], 0, 128, 0]],
    }
    return {**good, **changes}


def test_a_good_manifest_round_trips() -> None:
    manifest = Manifest.decode(json.dumps(doc()).encode(), REGISTERED)
    assert manifest.version == 3 and manifest.tensor("w").nbytes == 128 and manifest.tensor("b").offset == 128
    assert Manifest.decode(manifest.encode(), REGISTERED) == manifest


def test_a_manifest_carries_64_bit_checksums() -> None:
    top = (1 << 64) - 1
    manifest = Manifest.decode(json.dumps(doc(tensors=[["w", "float32", [4], 0, 0, top]])).encode(), REGISTERED)
    assert manifest.tensor("w").checksum == top
    assert json.loads(manifest.encode())["checksum"] == "mlh64"


def test_a_manifest_without_checksums_says_so() -> None:
    unsummed = [["w", "float32", [4, 8], 0, 0, 0]]
    manifest = Manifest.decode(json.dumps(doc(checksum="none", tensors=unsummed)).encode(), REGISTERED)
    assert not manifest.checksummed and manifest.checksum == "none"
    assert Manifest.decode(manifest.encode(), REGISTERED) == manifest
    assert Manifest.decode(json.dumps(doc()).encode(), REGISTERED).checksummed


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"format": 2}, "format 2 is not 1"),
        ({"version": 0}, r"version must be an integer in \[1,"),
        ({"version": True}, "version must be an integer"),
        ({"version": "3"}, "version must be an integer"),
        ({"header": BASE + 9}, "is not an aligned word of registered memory"),
        ({"header": BASE + SIZE}, "is not an aligned word of registered memory"),
        ({"regions": [[BASE + SIZE - 10, 20]]}, "is not inside the publisher's registered memory"),
        ({"regions": [[BASE, 0]]}, r"region 0 len must be an integer in \[1,"),
        ({"regions": []}, "regions must be a list of 1 to"),
        ({"regions": [[BASE, 8, 0]]}, r"region 0 must be \[addr, len\]"),
        ({"tensors": [["w", "float128", [4], 0, 0, 0]]}, "dtype 'float128' is not one of"),
        ({"tensors": [["w", "object", [4], 0, 0, 0]]}, "dtype 'object' is not one of"),
        ({"tensors": [["w", "float32", [-1], 0, 0, 0]]}, "shape must be an integer"),
        ({"tensors": [["w", "float32", [1 << 40, 1 << 40], 0, 0, 0]]}, "overruns its region"),
        ({"tensors": [["w", "float32", [4], 0, 8190, 0]]}, "overruns its region"),
        ({"tensors": [["w", "float32", [4], 1, 0, 0]]}, r"region must be an integer in \[0, 0\]"),
        ({"tensors": [["w", "float32", [4], 0, 0, 1 << 64]]}, "checksum must be an integer"),
        ({"tensors": [["w", "float32", [4], 0, 0, -1]]}, "checksum must be an integer"),
        ({"tensors": [["w", "float32", [4], 0, 0, 1.5]]}, "checksum must be an integer"),
        ({"checksum": "crc32"}, "checksum 'crc32' is not 'mlh64' or 'none'"),
        ({"checksum": None}, "checksum None is not 'mlh64' or 'none'"),
        ({"checksum": "none"}, "without checksums .* gives its tensors checksum 0"),
        ({"tensors": [["w", "float32", [4], 0, 0, 0], ["w", "float32", [4], 0, 64, 0]]}, "unique"),
        ({"tensors": [["", "float32", [4], 0, 0, 0]]}, "non-empty"),
        ({"tensors": [["w", "float32", [1] * 17, 0, 0, 0]]}, "at most 16 sizes"),
        ({"tensors": [["w", "float32", [4], 0, 0]]}, r"must be \[name, dtype, shape, region, offset, checksum\]"),
        ({"extra": 1}, "exactly the keys"),
    ],
)
def test_a_bad_manifest_is_refused(changes: dict[str, Any], error: str) -> None:
    with pytest.raises(ManifestError, match=error):
        Manifest.decode(json.dumps(doc(**changes)).encode(), REGISTERED)


@pytest.mark.parametrize("data", [b"", b"\xff", b"[]", b"null", b'{"format": 1}'])
def test_what_is_not_a_manifest_is_refused(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.decode(data, REGISTERED)


def test_a_publisher_that_lies_about_its_memory_is_read_from_not_at_all() -> None:
    """A real engine publishing a manifest by hand: a tensor said to lie past what it registered."""
    with hixl.Engine("127.0.0.1:0") as liar, CountingEngine("127.0.0.1:0") as engine:
        publisher = Publisher(liar)
        publisher.publish({"w": np.ones(1024, np.float32)})
        subscriber = Subscriber(engine, liar.local_engine)
        manifest = subscriber.manifest()
        lie = json.loads(manifest.encode())
        lie["regions"][0][1] += 1 << 20  # a megabyte more than the slot
        liar.set_metadata(_wire.slot_key(manifest.slot), json.dumps(lie).encode())
        other = Subscriber(engine, liar.local_engine)  # no cached manifest
        engine.moved.clear()
        with pytest.raises(ManifestError, match="is not inside the publisher's registered memory"):
            other.pull({"w": np.zeros(1024, np.float32)}, timeout=5)
        assert engine.moved == []
        other.close()
        subscriber.close()
        publisher.close()
