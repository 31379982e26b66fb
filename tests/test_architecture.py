"""docs/architecture.md's tree is the code's: every module under par4d/ is named in it, and its floors
respect the imports (each room is listed after every room it imports). Read with ast alone, no torch."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "par4d"
DOC = REPO / "docs" / "architecture.md"
ENTRY = re.compile(r"^  (\S+)(?:\s+(.*))?$")     # a room's first line in the tree: two spaces, its name


def tree_entries(doc: str) -> dict[str, str]:
    """The rooms of the fenced block under "## The tree", in the order listed: ``folder.py`` or ``launch/``
    -> the room's description (its continuation lines joined)."""
    section = doc.split("\n## The tree\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    entries: dict[str, str] = {}
    last = None
    for line in block.splitlines()[1:]:
        if not line.strip() or line.strip() == "par4d/":
            continue
        match = ENTRY.match(line)
        if match:
            last = match.group(1)
            assert last not in entries, f"docs/architecture.md's tree lists {last} twice"
            entries[last] = match.group(2) or ""
        else:
            assert last is not None and line.startswith("   "), f"docs/architecture.md's tree: stray line {line!r}"
            entries[last] += " " + line.strip()
    return entries


def room_name(entry: str) -> str:
    """``folder.py`` -> ``folder``, ``launch/`` -> ``launch``."""
    return entry.removesuffix("/").removesuffix(".py")


def rooms_on_disk(package: Path = PACKAGE) -> set[str]:
    """par4d's top-level modules and packages (a folder of modules without ``__init__.py``, as optim/, too)."""
    return {p.stem if p.is_file() else p.name for p in package.iterdir()
            if (p.is_file() and p.suffix == ".py" and p.name != "__init__.py")
            or (p.is_dir() and any(p.glob("*.py")))}


def modules(package: Path = PACKAGE) -> list[Path]:
    """Every module under par4d/ but par4d/__init__.py (it re-exports the public API on first use)."""
    return sorted(p for p in package.rglob("*.py") if p != package / "__init__.py")


def lazy_names(package: Path = PACKAGE) -> dict[str, str]:
    """par4d/__init__.py's ``_LAZY``: a public name -> the module it comes from (``par4d.init`` is launch's)."""
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of the module, inside functions too, but those only type checkers read
    (the body of ``if TYPE_CHECKING:``; its ``else`` runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_rooms(source: str, module: str, rooms: set[str], lazy: dict[str, str]) -> set[tuple[str, str]]:
    """(the import, the room it reaches) for every par4d import in ``source``, the text of the module
    ``module`` (dotted, e.g. ``par4d.optim.data_parallel``; relative imports start from it)."""

    def room(dotted: str) -> str | None:
        parts = dotted.split(".")
        if parts[0] != "par4d" or len(parts) < 2:
            return None
        if parts[1] in rooms:
            return parts[1]
        if parts[1] in lazy:                       # a name par4d re-exports: its module's room
            return room(lazy[parts[1]])
        return None

    tree = ast.parse(source)
    found: set[tuple[str, str]] = set()
    bare = False                                   # `import par4d(.x)`: rooms are also reached as par4d.X
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bare |= alias.name.split(".")[0] == "par4d" and alias.asname is None
                found |= {(f"import {alias.name}", r) for r in [room(alias.name)] if r}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                         # relative: from the module's own package up
                package = module.split(".")[:-node.level]
                base = ".".join(package + ([base] if base else []))
            if base == "par4d":                    # from par4d import comm: each name its own room
                found |= {(f"from par4d import {a.name}", r) for a in node.names for r in [room(f"par4d.{a.name}")]
                          if r}
            else:
                names = ", ".join(a.name for a in node.names)
                found |= {(f"from {base} import {names}", r) for r in [room(base)] if r}
    if bare:
        for node in runtime_nodes(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "par4d":
                found |= {(f"par4d.{node.attr}", r) for r in [room(f"par4d.{node.attr}")] if r}
    return found


def dotted(path: Path, package: Path = PACKAGE) -> str:
    """``par4d/optim/sync.py`` -> ``par4d.optim.sync`` (a package's ``par4d.optim.__init__``: its relative
    imports start from the package itself)."""
    return ".".join(path.relative_to(package.parent).with_suffix("").parts)


def room_of(path: Path, package: Path = PACKAGE) -> str:
    """The top-level module or package a module is in: ``par4d/optim/offload.py`` -> ``optim``."""
    rel = path.relative_to(package)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def floor_violations(order: list[str], sources: dict[Path, str], package: Path = PACKAGE,
                     lazy: dict[str, str] | None = None) -> list[str]:
    """A line for every import of a room listed after the importing room (``order``: the tree's rooms, in
    order; ``sources``: each module's path under ``package`` -> its text)."""
    lazy = lazy_names(package) if lazy is None else lazy
    floor = {name: i for i, name in enumerate(order)}
    problems = []
    for path, source in sources.items():
        mine = room_of(path, package)
        for what, theirs in sorted(imported_rooms(source, dotted(path, package), set(floor), lazy)):
            if theirs != mine and floor[theirs] > floor[mine]:
                problems.append(f"par4d/{path.relative_to(package)} (room {mine}, floor {floor[mine]}) imports "
                                f"{what} (room {theirs}, floor {floor[theirs]}): {theirs} must be listed before "
                                f"{mine} in docs/architecture.md's tree")
    return problems


def test_every_module_is_named_in_the_tree():
    entries = tree_entries(DOC.read_text())
    by_room = {room_name(entry): (entry, text) for entry, text in entries.items()}
    on_disk = rooms_on_disk()
    missing = []
    for path in modules():
        rel = path.relative_to(PACKAGE)
        room = room_of(path)
        if room not in by_room:
            missing.append(f"par4d/{rel}: no entry {rel.parts[0] if len(rel.parts) > 1 else rel.name} in the tree")
            continue
        entry, text = by_room[room]
        if len(rel.parts) == 1:
            if entry != rel.name:
                missing.append(f"par4d/{rel}: listed as {entry} in the tree")
            continue
        inside = "/".join(rel.parts[1:])
        if rel.name == "__init__.py" and len(rel.parts) == 2:
            continue                                   # the package's line is its __init__.py
        if not re.search(rf"(?<![\w./]){re.escape(inside)}(?!\w)", text):
            missing.append(f"par4d/{rel}: {entry}'s entry in the tree does not name {inside}")
    stale = sorted(set(by_room) - on_disk)
    assert not missing and not stale, "docs/architecture.md's tree (## The tree):\n" + "\n".join(
        missing + [f"{by_room[r][0]} is in the tree but not in par4d/" for r in stale])


def test_each_floor_is_listed_after_everything_it_imports():
    order = [room_name(entry) for entry in tree_entries(DOC.read_text())]
    listed = set(order)
    sources = {path: path.read_text() for path in modules() if room_of(path) in listed}
    problems = floor_violations(order, sources)
    assert not problems, "\n".join(problems)


def test_the_floor_check_catches_an_import_from_above():
    """The check itself, on a made-up package: an import inside a function from a room listed later, and a
    name ``import par4d`` reaches that par4d re-exports from one, are named (module, import, both rooms);
    an import under ``if TYPE_CHECKING:`` and one from the module's own room are not."""
    package = Path("/made-up/par4d")
    sources = {
        package / "grid.py": "from typing import TYPE_CHECKING\nimport par4d\nif TYPE_CHECKING:\n"
                             "    from par4d.optim import x\n\ndef g():\n    return par4d.count\n",
        package / "optim" / "sync.py": "def f():\n    from par4d.overlap.policy import Overlap\n"
                                       "from par4d.optim import other\nfrom . import sibling\n",
        package / "overlap" / "policy.py": "from par4d import grid\n",
    }
    lazy = {"count": "par4d.ledger.count"}
    problems = floor_violations(["grid", "ledger", "optim", "overlap"], sources, package, lazy)
    assert problems == [
        "par4d/grid.py (room grid, floor 0) imports par4d.count (room ledger, floor 1): ledger must be listed "
        "before grid in docs/architecture.md's tree",
        "par4d/optim/sync.py (room optim, floor 2) imports from par4d.overlap.policy import Overlap (room overlap, "
        "floor 3): overlap must be listed before optim in docs/architecture.md's tree"], problems
    assert floor_violations(["ledger", "grid", "overlap", "optim"], sources, package, lazy) == []
