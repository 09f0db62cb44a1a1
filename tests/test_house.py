"""The plan of the house, checked: imports run one way (no circle, the trainer never imports the supervisor, each
room of either package imports only the rooms below it), every package names each of its modules in its docstring,
ARCHITECTURE.md's tables name exactly the modules there are, and a module past `MAX_LINES` says why at its top.

The graph is read from the source (`ast`), every import counted wherever it stands (a lazy import inside a function
is still an arrow), except those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "trainer")
MAX_LINES = 450
LENGTH_REASON = "Length:"  # how a longer module's docstring begins the line that says why
# The trainer's rooms from the bottom up: a module imports only modules of its own room or of a room before it.
# The leaves come first; the rank's run (the modules at the top of trainer/) comes last and may import anything.
TRAINER_ROOMS = (
    ("trainer.errors", "trainer.progress", "trainer.durable", "trainer.torch_release"),
    ("trainer.config",),
    ("trainer.model",),
    ("trainer.data",),
    ("trainer.diagnosis",),
    ("trainer.checkpoint",),
)
# The supervisor's rooms from the bottom up, likewise; the leaves first (the control channel's wire format is one:
# the plan names its timings and secret, the channel above the group speaks it). Its top is the command line and the
# agent (`supervisor.launch`), then Slurm's batch side, which starts the command line.
SUPERVISOR_ROOMS = (
    ("supervisor.bootstrap", "supervisor.console", "supervisor.control.wire"),
    ("supervisor.gpus",),
    ("supervisor.diagnosis",),
    ("supervisor.plan",),
    ("supervisor.group",),
    ("supervisor.control",),
    ("supervisor.report",),
    ("supervisor.launch",),
    ("supervisor.slurm",),
)
ARCHITECTURE = ROOT / "ARCHITECTURE.md"


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


def ancestors(module: str) -> set[str]:
    return {".".join(module.split(".")[:n]) for n in range(1, module.count(".") + 1)}


def import_graph() -> dict[str, set[str]]:
    """Module → the project modules it imports. Python runs a package's ``__init__`` before any module of it, so
    importing `a.b.c` imports the package `a.b` too, where that ``__init__`` imports anything (the importer's own
    packages aside: they are being imported already)."""
    modules = project_modules()
    direct = {name: imported(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}
    return {name: deps | {a for d in deps for a in ancestors(d) if direct.get(a)} - ancestors(name) - {name}
            for name, deps in direct.items()}


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


def room(module: str, rooms: tuple[tuple[str, ...], ...]) -> int:
    """The index of the room holding `module`: the longest prefix that names it wins (a leaf inside a package)."""
    found = [(len(p), index) for index, prefixes in enumerate(rooms) for p in prefixes
             if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else len(rooms)  # the top: the rank's run, or the supervisor's package itself


def test_no_import_circle() -> None:
    assert find_circle(import_graph()) is None


def test_the_circle_finder_finds_one() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_trainer_never_imports_the_supervisor() -> None:
    wrong = {m: sorted(d for d in deps if d.startswith("supervisor"))
             for m, deps in import_graph().items() if m.startswith("trainer")}
    assert {m: d for m, d in wrong.items() if d} == {}


def upward_imports(package: str, rooms: tuple[tuple[str, ...], ...]) -> list[str]:
    return [f"{m} -> {d}" for m, deps in import_graph().items() if m.startswith(package)
            for d in sorted(deps) if d.startswith(package) and room(d, rooms) > room(m, rooms)]


def test_each_trainer_room_imports_only_the_rooms_below_it() -> None:
    assert upward_imports("trainer", TRAINER_ROOMS) == []


def test_each_supervisor_room_imports_only_the_rooms_below_it() -> None:
    """Type-only imports (under ``if TYPE_CHECKING:``) never run and do not count."""
    assert upward_imports("supervisor", SUPERVISOR_ROOMS) == []
    assert all(room(m, SUPERVISOR_ROOMS) < len(SUPERVISOR_ROOMS) for m in project_modules()
               if m.startswith("supervisor.") and m != "supervisor.__main__"), "a module outside every room"


def test_importing_a_module_imports_its_package() -> None:
    """The plan imports the control channel's wire format: were the control package's __init__ to import the channel
    (above the group, which imports the plan), the plan would import it too, and its room test would fail."""
    assert ancestors("supervisor.control.wire") == {"supervisor", "supervisor.control"}
    graph = import_graph()
    assert "supervisor.control.wire" in graph["supervisor.plan.spec"]
    assert graph["supervisor.control"] == set() and "supervisor.control" not in graph["supervisor.plan.spec"]
    assert "trainer.config" not in graph["trainer.config.sizes"]  # its own package is being imported: not an arrow


def test_the_room_finder_takes_the_longest_prefix() -> None:
    assert room("supervisor.control.wire", SUPERVISOR_ROOMS) == 0
    assert room("supervisor.control.channel", SUPERVISOR_ROOMS) == 5
    assert room("trainer.loop", TRAINER_ROOMS) == len(TRAINER_ROOMS)


def packages() -> dict[str, Path]:
    """Every package of the project, by its folder relative to the root (``supervisor/group``)."""
    return {str(path.parent.relative_to(ROOT)): path for path in project_modules().values() if path.name == "__init__.py"}


def members(folder: Path) -> set[str]:
    """What a package holds: its modules and its subpackages, by name (``__main__`` is the package run as a script)."""
    return {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")} | \
        {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}


def architecture_tables() -> dict[str, set[str]]:
    """ARCHITECTURE.md's rooms tables: the folder each table's heading names (a line starting with `` `folder/` ``)
    → the backticked names in its first column."""
    tables: dict[str, set[str]] = {}
    current = None
    for line in ARCHITECTURE.read_text().splitlines():
        if heading := re.match(r"^`([\w/]+)/` —", line):
            current = heading[1]
            tables[current] = set()
        elif current is not None and line.startswith("| `"):
            tables[current] |= set(re.findall(r"`(\w+)`", line.split("|")[1]))
        elif current is not None and not line.startswith("|"):
            current = None
    return tables


def test_every_package_names_each_of_its_modules() -> None:
    unnamed = {}
    for folder, path in packages().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        named = set(re.findall(r"`(\w+)`", doc))
        if missing := sorted(members(path.parent) - named):
            unnamed[folder] = missing
    assert unnamed == {}


def test_the_architecture_tables_name_exactly_the_modules_there_are() -> None:
    tables = architecture_tables()
    assert sorted(tables) == sorted(packages()), "a table per package, each headed `folder/` —"
    wrong = {folder: {"missing": sorted(members(ROOT / folder) - names), "not there": sorted(names - members(ROOT / folder))}
             for folder, names in tables.items() if names != members(ROOT / folder)}
    assert wrong == {}


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
