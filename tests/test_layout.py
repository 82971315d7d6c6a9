"""Dependencies point one way: trainer/ never imports node/; bench/ imports no test code; tests share code only
through tests/helpers.py."""

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


def test_torch_is_the_trainer_extra():
    """Issue 24: a Mac that only samples installs plain `swarmrl` (MLX, no torch); `swarmrl[trainer]` adds torch,
    and the README's `.[dev]` still installs everything."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = re.compile(r"[A-Za-z0-9_.-]+")
    core = {name.match(d).group() for d in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert "torch" not in core and "mlx-lm" in core
    assert "torch==2.13.0" in extras["trainer"] and "swarmrl[trainer]" in extras["dev"]
