"""The code in docs/ does what the docs say: snippets run against real peers, and every
``# -> VALUE`` comment on an expression is checked against what the expression returned."""

from __future__ import annotations

import ast
import asyncio
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hixl
from hixl.datadist import TransferDone
from hixl.testing import TargetProcess
from hixl.testing.hosts import skip_unless_hosts

pytestmark = pytest.mark.timeout(60)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def snippet(doc: str, containing: str) -> str:
    """The one ```python block of ``docs/doc`` that contains ``containing``."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / doc).read_text(), re.S)
    found = [block for block in blocks if containing in block]
    assert len(found) == 1, f"{len(found)} python blocks of {doc} contain {containing!r}"
    return found[0]


def run(code: str, namespace: dict[str, Any]) -> int:
    """Run ``code`` statement by statement in ``namespace``; check each ``expr  # -> expected``.

    Returns how many values were checked.
    """
    lines = code.splitlines()
    checked = 0
    for stmt in ast.parse(code).body:
        _, arrow, expected = lines[(stmt.end_lineno or stmt.lineno) - 1].partition("# -> ")
        if not arrow:
            exec(compile(ast.Module([stmt], []), "<doc>", "exec"), namespace)
            continue
        assert isinstance(stmt, ast.Expr), f"a '# ->' comment on a statement that has no value: {lines[stmt.lineno - 1]}"
        got = eval(compile(ast.Expression(stmt.value), "<doc>", "eval"), namespace)
        assert got == eval(expected, namespace), f"{ast.get_source_segment(code, stmt)} returned {got!r}, the docs say {expected}"
        checked += 1
    return checked


# -- docs/engine.md ----------------------------------------------------------------------
def test_engine_wait_notifies(shared_target: TargetProcess) -> None:
    with hixl.Engine("127.0.0.1:0") as engine:
        shared_target.call("connect", engine.local_engine)
        try:
            notify = hixl.NotifyDesc("done", "read 1 MiB")
            sender = threading.Timer(0.2, shared_target.call, ("send_notify", engine.local_engine, notify))
            sender.start()
            assert run(snippet("engine.md", "engine.wait_notifies("), {"hixl": hixl, "engine": engine}) == 2
            sender.join()
        finally:
            shared_target.call("disconnect", engine.local_engine)


def test_engine_asyncio(shared_target: TargetProcess) -> None:
    assert run(snippet("engine.md", "async def read_pages"), {"target": shared_target.engine}) == 1


def test_engine_hosts() -> None:
    skip_unless_hosts()
    namespace: dict[str, Any] = {}
    try:
        assert run(snippet("engine.md", "from hixl.testing.hosts import Hosts"), namespace) == 2
    finally:  # what a failing snippet left open (each close is idempotent)
        for name, close in (("engine", "finalize"), ("target", "close"), ("hosts", "close")):
            if name in namespace:
                getattr(namespace[name], close)()


# -- docs/datadist.md --------------------------------------------------------------------
def test_datadist_opening_and_asyncio() -> None:
    layers, shape = 2, (8, 4, 2, 8)
    src_blocks, dst_blocks = [0, 3, 4], [5, 1, 7]
    source = hixl.empty((2 * layers, *shape), np.float16)
    source[:] = np.random.default_rng(1).integers(-100, 100, source.shape)
    target = hixl.empty((2 * layers, *shape), np.float16)
    namespace: dict[str, Any] = {
        "layers": layers,
        "num_blocks": shape[0],
        "block_size": shape[1],
        "kv_heads": shape[2],
        "head_dim": shape[3],
        "per_layer_tensors": list(source),
        "its_tensors": list(target),
        "src_blocks": src_blocks,
        "dst_blocks": dst_blocks,
    }
    try:
        assert run(snippet("datadist.md", "from hixl.datadist import *"), namespace) == 2
        np.testing.assert_array_equal(target[:, dst_blocks], source[:, src_blocks])
        target[:] = 0
        run(snippet("datadist.md", "async def decode_step"), namespace)
        step = namespace["decode_step"](namespace["decode"], namespace["BlocksCacheKey"](1), namespace["dst"], [1], [2])
        asyncio.run(step)
        np.testing.assert_array_equal(target[:, 2], source[:, 1])
        assert namespace["prefill"].cache_manager.completed_requests() == [TransferDone(2, 8, "pull")]
    finally:
        for name in ("decode", "prefill"):
            if name in namespace:
                namespace[name].finalize()
