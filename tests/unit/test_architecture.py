"""The import rules, checked on the source so a shortcut cannot creep in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "batchrun"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def modules() -> list[Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    assert len(found) > 10
    return found


def rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def uses(names: set[str], root: str) -> bool:
    return any(n == root or n.startswith(root + ".") for n in names)


@pytest.mark.parametrize("path", modules(), ids=rel)
def test_import_direction(path: Path) -> None:
    names = imports_of(path)
    where = rel(path)
    if not where.startswith("ledger/"):
        assert not uses(names, "sqlalchemy"), f"{where}: only ledger/ may import SQLAlchemy"
    if not where.startswith(("backends/", "sim/")):
        assert not uses(names, "httpx"), (
            f"{where}: only backends/ (and the sim transport) use httpx"
        )
    if where != "backends/aiohttp_transport.py":
        assert not uses(names, "aiohttp"), f"{where}: only the aiohttp transport uses aiohttp"
    if where.startswith("backends/"):
        assert not uses(names, "batchrun.ledger"), f"{where}: backends never import the ledger"
    if where.startswith("ledger/"):
        assert not uses(names, "batchrun.backends"), f"{where}: the ledger never imports backends"
    if where not in ("cli.py", "__main__.py"):
        assert not uses(names, "batchrun.cli"), f"{where}: nothing imports cli"


@pytest.mark.parametrize("path", modules(), ids=rel)
def test_only_cli_calls_anyio_run(path: Path) -> None:
    if rel(path).startswith("cli"):  # cli.py and the command modules it registers
        return
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "run":
            assert not (isinstance(node.value, ast.Name) and node.value.id == "anyio"), (
                f"{rel(path)} calls anyio.run; only cli.py may"
            )


def test_modules_stay_small() -> None:
    for path in modules():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= 420, f"{rel(path)} has {lines} lines; split it"
