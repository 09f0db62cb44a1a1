"""The plan of the house, checked: imports run one way (no circle, the trainer never imports the supervisor, each
trainer room imports only the rooms below it), every package says what it holds, and a module past `MAX_LINES`
says why at its top.

The graph is read from the source (`ast`), every import counted wherever it stands (a lazy import inside a function
is still an arrow), except those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "trainer")
MAX_LINES = 450
LENGTH_REASON = "Length:"  # how a longer module's docstring begins the line that says why
# The trainer's rooms from the bottom up: a module imports only modules of its own room or of a room before it.
# The leaves come first; the rank's run (the modules at the top of trainer/) comes last and may import anything.
TRAINER_ROOMS = (
    ("trainer.errors", "trainer.progress", "trainer.durable"),
    ("trainer.config",),
    ("trainer.model",),
    ("trainer.data",),
    ("trainer.diagnosis",),
    ("trainer.checkpoint",),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The project modules `tree` imports: `from a.b import c` means the module a.b.c where that is one, else a.b."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (circle := walk(nxt)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (circle := walk(start)):
            return circle
    return None


def room(module: str) -> int:
    for index, prefixes in enumerate(TRAINER_ROOMS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return len(TRAINER_ROOMS)  # the rank's run


def test_no_import_circle() -> None:
    assert find_circle(import_graph()) is None


def test_the_circle_finder_finds_one() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_trainer_never_imports_the_supervisor() -> None:
    wrong = {m: sorted(d for d in deps if d.startswith("supervisor"))
             for m, deps in import_graph().items() if m.startswith("trainer")}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_each_trainer_room_imports_only_the_rooms_below_it() -> None:
    upward = [f"{m} -> {d}" for m, deps in import_graph().items() if m.startswith("trainer")
              for d in sorted(deps) if d.startswith("trainer") and room(d) > room(m)]
    assert upward == []


def test_every_package_says_what_it_holds() -> None:
    silent = [name for name, path in project_modules().items()
              if path.name == "__init__.py" and not ast.get_docstring(ast.parse(path.read_text()))]
    assert silent == []


def test_a_long_module_says_why_at_its_top() -> None:
    files = [p for package in (*PACKAGES, "tests", "bench") for p in (ROOT / package).rglob("*.py")]
    unexplained = []
    for path in files:
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not any(line.startswith(LENGTH_REASON) for line in doc.splitlines()):
                unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert unexplained == []
