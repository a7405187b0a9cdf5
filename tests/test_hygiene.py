"""The test suite's own rules: test modules import neither each other nor bench/ or experiments/ (shared helpers
live in tests/conftest.py), and nothing under tests/ reads a path outside the repository."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

TEST_FILES = sorted((REPO / "tests").rglob("*.py"))


def imported_modules(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_test_module_imports_another_or_bench():
    offenders = {}
    for path in TEST_FILES:
        bad = {m for m in imported_modules(path)
               if m.split(".")[0] in ("bench", "experiments") or re.match(r"tests\.test_", m) or re.match(r"test_", m)}
        if bad:
            offenders[str(path.relative_to(REPO))] = sorted(bad)
    assert not offenders, f"import shared helpers from tests.conftest instead: {offenders}"


def test_no_path_outside_the_repository():
    pattern = re.compile(r"\.\./shared|parents\[2\]|ROOT\.parent|REPO\.parent")
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in TEST_FILES
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)
                 and p.name != "test_hygiene.py"]
    assert not offenders, f"tests read GSM8K from tests/fixtures/gsm8k (conftest.GSM8K): {offenders}"


def test_the_rules_catch_what_they_name(tmp_path):
    bad = tmp_path / "test_x.py"
    bad.write_text("from tests.test_flows import sh\nimport bench.common\nfrom tests.conftest import GSM8K\n")
    assert imported_modules(bad) == {"tests.test_flows", "bench.common", "tests.conftest"}
