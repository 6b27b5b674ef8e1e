"""The package's layers import only downward (see ../shared/STYLE.md): the sans-IO protocol knows no
sockets, sessions or transports; the session layer knows no transport implementation; a contract
knows none of its implementations. Checked on the source (imports that run, not those under
``if TYPE_CHECKING:``), so an upward import fails here before it becomes a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HIXL = Path(__file__).resolve().parents[1] / "hixl"


class _Imports(ast.NodeVisitor):
    """The hixl modules a module's source imports when it runs, as dotted names."""

    def __init__(self, package: str) -> None:
        self.package, self.names = package, set[str]()

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):  # for the type checker only: never runs
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self.package.rsplit(".", node.level - 1)[0] if node.level else ""
        module = ".".join(part for part in (base, node.module or "") if part)
        if module.startswith("hixl"):
            self.names.add(module)
            self.names.update(f"{module}.{alias.name}" for alias in node.names)

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(alias.name for alias in node.names if alias.name.startswith("hixl"))


def runtime_imports(source: str, package: str) -> set[str]:
    """What ``source``, a module of ``package``, imports from hixl when it runs."""
    visitor = _Imports(package)
    visitor.visit(ast.parse(source))
    return visitor.names


def _imports_of(path: Path) -> set[str]:
    return runtime_imports(path.read_text(), ".".join(path.relative_to(HIXL.parent).parts[:-1]))


RULES = [
    # (modules, what they may not import, why)
    ("_protocol", ("hixl._session", "hixl.transports", "hixl.engine", "hixl._memory"), "the protocol is sans-IO"),
    ("_session", ("hixl.transports", "hixl.engine", "hixl.datadist"), "sessions run below the transports"),
    ("transports", ("hixl.engine", "hixl.datadist", "hixl.vllm"), "transports run below the engine"),
    ("discovery/store.py", ("hixl.discovery.etcd", "hixl.discovery.backends"), "the contract knows no implementation"),
]


@pytest.mark.parametrize(("where", "banned", "why"), RULES, ids=[rule[0] for rule in RULES])
def test_imports_point_down(where: str, banned: tuple[str, ...], why: str) -> None:
    root = HIXL / where
    files = [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))
    upward = {
        f"{path.relative_to(HIXL.parent)} imports {name}"
        for path in files
        for name in _imports_of(path)
        if any(name == b or name.startswith(b + ".") for b in banned)
    }
    assert not upward, f"{why}: {sorted(upward)}"


def test_the_check_sees_relative_imports_and_skips_those_for_the_type_checker() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from ..transports.base import Transport\n"
        "if TYPE_CHECKING:\n    from ..engine import Engine\n"
        "def f():\n    from . import wire\n"
    )
    names = runtime_imports(source, "hixl._session")
    assert {"hixl.transports.base", "hixl.transports.base.Transport", "hixl._session.wire"} <= names
    assert not any(name.startswith("hixl.engine") for name in names)
