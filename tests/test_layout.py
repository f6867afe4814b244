"""The house's layout: no import circle among Baton's modules, and no crowded room.

Every import counts, a lazy one inside a function and one under `TYPE_CHECKING` as much
as one at the top: each says that one module needs the other, and a circle of needs is
a knot a reader cannot start from. Rooms are held to `MAX_LINES`; over `TABLE_LINES` only
the pure tables that docs/architecture.md names under "Rooms over 400 lines".
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("baton", "services", "shared")
MAX_LINES = 500
TABLE_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports, anywhere in its text."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    needs = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            needs |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target in known:
                needs.add(target)
            needs |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known}
    needs.discard(name)
    return needs


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` needs, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The circles: each a set of modules that all need one another, through any path."""
    reached = {name: reach(graph, name) for name in graph}
    found: list[set[str]] = []
    for name in sorted(graph):
        if name in reached[name] and not any(name in c for c in found):
            found.append({name} | {o for o in reached[name] if name in reached[o]})
    return found


def test_no_import_circle() -> None:
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    found = circles(graph)
    assert found == [], "import circles:\n" + "\n".join(str(sorted(c)) for c in found)


def test_the_circle_finder_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert list(circles(graph)) == [{"a", "b", "c"}], "a three-module circle"
    assert list(circles({"a": {"b"}, "b": set()})) == [], "a line is no circle"


def tables_named_in_the_architecture() -> set[str]:
    """The modules docs/architecture.md names under "Rooms over 400 lines"."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### Rooms over 400 lines", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\* `([\w/]+\.py)`", section, re.M))


def test_no_crowded_room() -> None:
    tables = tables_named_in_the_architecture()
    assert tables, "docs/architecture.md names no table under 'Rooms over 400 lines'"
    crowded = []
    for name, path in modules().items():
        rel = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES or (lines > TABLE_LINES and rel not in tables):
            crowded.append(f"{rel}: {lines} lines ({name})")
    assert crowded == [], "rooms too long:\n" + "\n".join(crowded)
    missing = [t for t in tables if not (ROOT / t).is_file()]
    assert missing == [], f"docs/architecture.md names tables that are gone: {missing}"


def test_the_cli_and_the_dashboard_read_through_one_client_layer() -> None:
    """`baton.client` is beneath both: the dashboard imports nothing of the CLI, and the
    client layer imports neither, so either can change how it shows things alone."""
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}

    def within(name: str, *packages: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in packages)

    crossings = [
        f"{name} imports {needed}"
        for name, needs in graph.items()
        for needed in needs
        if (within(name, "baton.ui") and within(needed, "baton.cli"))
        or (within(name, "baton.client") and within(needed, "baton.cli", "baton.ui"))
    ]
    assert crossings == [], "\n".join(crossings)
