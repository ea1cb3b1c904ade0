"""Code health gates (issue 13): ruff and mypy, configured in pyproject.toml, run on the whole tree as part of the
suite, so a finding fails CI like a failing test. Both come with the `test` extras (`pip install -e '.[test]'`,
which `make test` runs); a venv without them is a broken set-up, reported as a failure rather than skipped, or the
gate would silently open."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    exe = BIN / tool
    if not exe.exists():
        pytest.fail(f"{exe} is not installed: run `{BIN / 'pip'} install -e '.[test]'` (make setup does)")
    return subprocess.run([str(exe), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_ruff_finds_nothing():
    r = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".", timeout=120)
    assert r.returncode == 0, f"ruff check . (pyproject.toml [tool.ruff]):\n{r.stdout}{r.stderr}"


def test_mypy_finds_nothing():
    # Incremental: the cache (build/mypy-cache, pyproject.toml) makes a re-run check only what changed.
    r = _run("mypy", timeout=600)
    assert r.returncode == 0, f"mypy (pyproject.toml [tool.mypy]):\n{r.stdout}{r.stderr}"


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere: at the top, under TYPE_CHECKING or inside a
    function (a lazy import defers a cycle, it does not remove it)."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for a in node.names:
                out |= {f"{base}.{a.name}"} if f"{base}.{a.name}" in modules else ({base} & modules)
    return out - {module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycles():
    """Two modules that import each other (even type-only, even lazily) are one module in two files: the cycle
    is the coupling to remove (issue 13: cli <-> demo, store query <-> tsdb). Generated protobuf code is left out."""
    paths = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (REPO / "cri_resmgr").rglob("*.py") if "proto" not in p.parts}
    graph = {m: _imports(p, m, set(paths)) for m, p in paths.items()}
    assert "cri_resmgr.demo" in graph["cri_resmgr.cli"]  # the walk sees lazy imports (cli imports demo in a function)
    assert _cycles(graph) == []
