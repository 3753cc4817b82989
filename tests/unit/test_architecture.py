"""The import rules, checked on the source so a shortcut cannot creep in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "batchrun"


def imports_of(path: Path) -> set[str]:
    """Every module (and name) the file imports, relative imports made absolute:
    `from batchrun import cli` counts as `batchrun.cli`, `from anyio import run` as `anyio.run`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ["batchrun", *path.relative_to(PACKAGE).parent.parts]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
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
    if where != "backends/http11.py":
        assert not uses(names, "httptools"), f"{where}: only the HTTP engine parses HTTP"
    assert not uses(names, "aiohttp"), f"{where}: batchrun's HTTP engine is its own (http11.py)"
    if where.startswith("backends/"):
        assert not uses(names, "batchrun.ledger"), f"{where}: backends never import the ledger"
    if where.startswith("ledger/"):
        assert not uses(names, "batchrun.backends"), f"{where}: the ledger never imports backends"
    if not where.startswith("cli") and where != "__main__.py":
        assert not any(n.startswith("batchrun.cli") for n in names), (
            f"{where}: nothing imports the CLI's modules"
        )
        assert not uses(names, "tqdm"), f"{where}: the library draws nothing; the CLI draws its bar"
        assert not uses(names, "click"), f"{where}: only the CLI parses a command line"


@pytest.mark.parametrize("path", modules(), ids=rel)
def test_only_entry_points_call_anyio_run(path: Path) -> None:
    # the CLI's commands, and the Python API's sync verbs: everything else is async, called
    if rel(path).startswith("cli") or rel(path) == "api.py":
        return
    assert "anyio.run" not in imports_of(path), f"{rel(path)} imports anyio.run"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "run":
            assert not (isinstance(node.value, ast.Name) and node.value.id == "anyio"), (
                f"{rel(path)} calls anyio.run; only the CLI and api.py may"
            )


def test_modules_stay_small() -> None:
    for path in modules():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= 420, f"{rel(path)} has {lines} lines; split it"


DIALECT_WORDS = ("postgresql", "sqlite", "pragma", "pg_", "begin immediate", "skip locked")


def test_what_differs_between_databases_is_in_the_dialect_seam() -> None:
    """SQL or options for one database, or a branch on which database it is, live in
    ledger/dialect.py; the rest of the ledger is written once for both (schema.py's
    per-database index options aside: a table's declaration names them)."""
    for path in sorted((PACKAGE / "ledger").glob("*.py")):
        if path.name in ("dialect.py", "schema.py"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "name":
                named = node.value
                assert not (isinstance(named, ast.Attribute) and named.attr == "dialect"), (
                    f"{rel(path)}:{node.lineno} branches on the database: use the Dialect"
                )
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in docstrings:
                    continue
                word = next((w for w in DIALECT_WORDS if w in node.value.lower()), None)
                assert word is None, f"{rel(path)}:{node.lineno} has {word!r}: use the Dialect"
            if isinstance(node, ast.keyword) and node.arg:
                assert not node.arg.startswith(("postgresql_", "sqlite_", "skip_locked")), (
                    f"{rel(path)}:{node.lineno} passes {node.arg}: use the Dialect"
                )


def test_public_names_are_exactly_these() -> None:
    """The API is what batchrun/__init__.py exports: adding a name is a decision, made here."""
    import batchrun

    assert sorted(batchrun.__all__) == sorted(
        [
            "BatchrunError",
            "FatalError",
            "GcReport",
            "InputError",
            "JobAborted",
            "JobReport",
            "LedgerError",
            "OutputError",
            "ProgressUpdate",
            "Result",
            "RunOptions",
            "UsageError",
            "__version__",
            "export",
            "gc",
            "list_jobs",
            "results",
            "resume",
            "resume_async",
            "retry",
            "cancel",
            "status",
            "submit",
            "submit_async",
        ]
    )
    # no public name hides a module of the package (`import batchrun.status` would get it)
    modules_here = {path.stem for path in PACKAGE.iterdir()}
    assert not set(batchrun.__all__) & modules_here
    public = {name for name in vars(batchrun) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(batchrun, name)).__name__ == "module"}
    assert public - modules == set(batchrun.__all__) - {"__version__"}


def test_run_options_are_the_specs_fields() -> None:
    """Every option a spec file or the CLI takes is a keyword of submit/resume, same name."""
    from batchrun.config import SPEC_FIELDS, RunOptions

    assert set(RunOptions.__annotations__) == set(SPEC_FIELDS)
