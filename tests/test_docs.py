"""Generated documentation matches the code it is generated from (no services needed)."""

from __future__ import annotations

from pathlib import Path

from triggerflow.docgen import MAP_END, MAP_START, module_map, with_module_map

ROOT = Path(__file__).resolve().parents[1]


def test_architecture_module_map_matches_the_package_tree() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert page == with_module_map(page), (
        "regenerate: triggerflow docs modules --page docs/architecture.md")


def test_module_map_lists_every_module_with_its_docstring() -> None:
    table = module_map()
    assert table.startswith(MAP_START) and table.endswith(MAP_END)
    for path in (ROOT / "triggerflow").rglob("*.py"):
        rel = path.relative_to(ROOT / "triggerflow")
        if "versions" in rel.parts or rel.name in ("__main__.py", "env.py"):
            continue
        name = f"{rel.parent}/" if rel.name == "__init__.py" else str(rel)
        if name == "./":
            continue  # the package itself
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} missing from the module map"
        assert not row.endswith("|  |"), f"{name} has no docstring to describe it"
