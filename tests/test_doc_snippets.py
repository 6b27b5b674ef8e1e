"""The code in docs/ and the README runs as written: every ```python block, in a fresh interpreter,
against real engines on 127.0.0.1, and every ``# -> VALUE`` comment on an expression is checked
against what the expression returned. A name a block uses and never defines fails it.

A block runs alone unless its first line says otherwise:

- ``# continues ...``: it runs after the block before it on its page, in the same interpreter;
- ``# needs root: ...``: it runs where network namespaces can be made (``skip_unless_hosts``);
- ``# not run by the tests: REASON``: it does not run, and the page says why, in the block itself;
- ``# NAME.py ...`` (the README's quick start): a program, run as a file by ``tests/test_readme.py``.

Run as a script, this module is the fresh interpreter: it reads ``[[name, code], ...]`` on stdin
and runs the blocks one after another in one namespace.
"""

from __future__ import annotations

import ast
import codeop
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hixl.testing.hosts import skip_unless_hosts

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(page.relative_to(ROOT)) for page in (ROOT / "docs").glob("*.md"))]
CONTINUES, NEEDS_HOSTS, NOT_RUN = "# continues ", "# needs root: ", "# not run by the tests: "
PROGRAM = re.compile(r"# (\w+\.py)\b")
#: Blocks that may stay unrun (vLLM, etcd): each is a cost, so the number is kept in sight.
MAX_NOT_RUN = 2
TIMEOUT = 60.0  # seconds a chain of blocks may take in its interpreter


@dataclass(frozen=True)
class Block:
    """One ```python block of a page."""

    page: str  # relative to the repository root
    line: int  # of its opening fence, 1-based
    code: str

    @property
    def name(self) -> str:
        """``page:line``, as tracebacks and test ids show it."""
        return f"{self.page}:{self.line}"

    @property
    def first_line(self) -> str:
        """Where a block says how it is run (see the module docstring)."""
        return self.code.split("\n", 1)[0]


def blocks(page: str) -> list[Block]:
    """The ```python blocks of ``page``, in order."""
    text = (ROOT / page).read_text()
    return [
        Block(page, text.count("\n", 0, match.start()) + 1, match.group(1))
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    ]


def chains() -> list[list[Block]]:
    """The blocks the tests run, each with the blocks that continue it."""
    found: list[list[Block]] = []
    for page in PAGES:
        for block in blocks(page):
            if block.first_line.startswith(CONTINUES):
                assert found and found[-1][-1].page == page, f"{block.name} continues no block before it on its page"
                found[-1].append(block)
            elif not (block.first_line.startswith(NOT_RUN) or PROGRAM.match(block.first_line)):
                found.append([block])
    return found


def run(code: str, namespace: dict[str, Any], name: str = "<doc>") -> int:
    """Run ``code`` statement by statement in ``namespace``; check each ``expr  # -> expected``.

    Returns how many values were checked.
    """
    lines = code.splitlines()
    checked = 0
    for stmt in ast.parse(code).body:
        _, arrow, expected = lines[(stmt.end_lineno or stmt.lineno) - 1].partition("# -> ")
        if not arrow:
            exec(compile(ast.Module([stmt], []), name, "exec"), namespace)
            continue
        assert isinstance(stmt, ast.Expr), f"a '# ->' comment on a statement that has no value: {lines[stmt.lineno - 1]}"
        got = eval(compile(ast.Expression(stmt.value), name, "eval"), namespace)
        assert got == eval(expected, namespace), f"{ast.get_source_segment(code, stmt)} returned {got!r}, the docs say {expected}"
        checked += 1
    return checked


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("chain", chains(), ids=lambda chain: chain[0].name)
def test_block_runs_as_written(chain: list[Block], tmp_path: Path) -> None:
    if chain[0].first_line.startswith(NEEDS_HOSTS):
        skip_unless_hosts()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps([[block.name, block.code] for block in chain]),
        capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"{' + '.join(block.name for block in chain)}:\n{proc.stderr}"


def test_every_block_is_run_or_says_why_not() -> None:
    ran = {block.name for chain in chains() for block in chain}
    programs, not_run = [], []
    for page in PAGES:
        for block in blocks(page):
            if (program := PROGRAM.match(block.first_line)) is not None:
                programs.append((page, program.group(1)))
            elif block.first_line.startswith(NOT_RUN):
                assert block.first_line.removeprefix(NOT_RUN).strip(), f"{block.name} gives no reason"
                not_run.append(block.name)
            else:
                assert block.name in ran
    assert programs == [("README.md", "target.py"), ("README.md", "initiator.py")]  # what test_readme.py runs
    assert len(not_run) <= MAX_NOT_RUN, not_run


def repl_error(code: str) -> str | None:
    """Why ``code`` pasted into Python's interactive prompt would fail to compile, or None.

    The prompt compiles a statement at a time and ends a compound statement only at a blank line,
    so a ``for`` loop followed at once by a statement at the left margin is a SyntaxError there,
    while it runs as a file. Fed line by line to the compiler the prompt uses (:mod:`codeop`)."""
    compiler, pending = codeop.CommandCompiler(), []
    for number, line in enumerate(code.splitlines(), 1):
        pending.append(line)
        try:
            if compiler("\n".join(pending), "<stdin>", "single") is not None:
                pending = []
        except (SyntaxError, ValueError, OverflowError) as exc:
            return f"line {number}: {line!r}: {exc}"
    return None


@pytest.mark.parametrize(
    "block", [block for page in PAGES for block in blocks(page) if not PROGRAM.match(block.first_line)], ids=lambda b: b.name
)
def test_block_pastes_into_the_interactive_prompt(block: Block) -> None:
    assert repl_error(block.code) is None, f"{block.name}: {repl_error(block.code)}"


def test_a_statement_right_after_a_loop_does_not_paste() -> None:
    assert repl_error("for i in range(2):\n    x = i\nprint(x)\n") is not None
    assert repl_error("for i in range(2):\n    x = i\n\nprint(x)\n") is None


def test_an_undefined_name_fails_the_block() -> None:
    with pytest.raises(NameError, match="per_layer_tensors"):
        run("from hixl.datadist import *\ncaches = per_layer_tensors\n", {})
    with pytest.raises(AssertionError, match="returned 2, the docs say 3"):
        run("1 + 1  # -> 3\n", {})


if __name__ == "__main__":  # one chain of blocks, in this fresh interpreter (see test_block_runs_as_written)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for name, code in json.load(sys.stdin):
        run(code, namespace, name)
