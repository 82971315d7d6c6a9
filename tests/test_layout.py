"""Dependencies point one way: trainer/ never imports node/; bench/ imports no test code; tests share code only
through tests/helpers.py; no module of ours imports itself through others."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
    return out


def offenders(folder: str, forbidden) -> list[tuple[str, str]]:
    return [
        (str(p.relative_to(ROOT)), m)
        for p in sorted((ROOT / folder).rglob("*.py"))
        for m in imported_modules(p)
        if forbidden(m)
    ]


def test_trainer_never_imports_node_bench_or_tests():
    assert offenders("trainer", lambda m: m.split(".")[0] in ("node", "bench", "tests")) == []


def test_bench_imports_no_test_code():
    assert offenders("bench", lambda m: m.split(".")[0] == "tests") == []


def test_tests_share_code_only_through_helpers():
    assert offenders("tests", lambda m: m.startswith("tests.") and m != "tests.helpers") == []


def first_party_imports(path: Path) -> set[str]:
    """Every module of ours that ``path`` imports, anywhere in it (function bodies and TYPE_CHECKING blocks too:
    a lazy import hides a cycle, it does not remove it); ``from a import b`` counts ``a.b`` when that is a module."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = package.split(".")[: len(package.split(".")) - n.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out |= {base, *(f"{base}.{a.name}" for a in n.names)}
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_import_graph_is_acyclic():
    """Issue 25: node/host -> reachability -> discovery -> host was held together by lazy imports."""
    paths = {module_name(p): p for folder in ("node", "protocols") for p in (ROOT / folder).rglob("*.py")}
    graph = {name: sorted(m for m in first_party_imports(p) if m in paths and m != name) for name, p in paths.items()}
    done: set[str] = set()
    cycles = []

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            cycles.append(" -> ".join([*stack[stack.index(name) :], name]))
            return
        if name in done:
            return
        for dep in graph[name]:
            visit(dep, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert graph["node.host"] and graph["node.reachability"], "the walk found no imports: it proves nothing"
    assert cycles == []


def test_torch_is_the_trainer_extra():
    """Issue 24: a Mac that only samples installs plain `swarmrl` (MLX, no torch); `swarmrl[trainer]` adds torch,
    and the README's `.[dev]` still installs everything."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = re.compile(r"[A-Za-z0-9_.-]+")
    core = {name.match(d).group() for d in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert "torch" not in core and "mlx-lm" in core
    assert "torch==2.13.0" in extras["trainer"] and "swarmrl[trainer]" in extras["dev"]


def test_the_trainer_role_reads_as_its_loop():
    """Issue 25: the role wires and runs the loop; what grows goes beside the code it belongs to (the outbox's
    encodings: node/weights/encodings.py; the dashboard's view: node/dashboard.py; the run log: node/runlog.py)."""
    lines = (ROOT / "node" / "roles" / "trainer.py").read_text().splitlines()
    assert len(lines) <= 200, f"node/roles/trainer.py has {len(lines)} lines"
