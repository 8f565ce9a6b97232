"""The testbed is its own package: it drives the control plane over HTTP and never imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import testbed

PACKAGE = Path(testbed.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_testbed_module_imports_the_control_plane() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no modules under {PACKAGE}"
    offenders = {}
    for path in files:
        app_imports = sorted(m for m in _imported_modules(path) if m.split(".")[0] == "app")
        if app_imports:
            offenders[str(path.relative_to(PACKAGE.parent))] = app_imports
    assert offenders == {}


def test_the_import_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    # Lazy imports (inside a function) are how the testbed reached into app/ before.
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from app.billing.traffic import classify\n")
    assert "app.billing.traffic" in _imported_modules(module)
