"""The package map of ARCHITECTURE.md, enforced: who may import whom, and house rules."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "pdctl"
SHARED = {
    "core",
    "errors",
    "console",
    "records",
    "settings",
    "titles",
}  # vocabulary any package may use
# package -> the pdctl packages it may import (besides itself and SHARED).
ALLOWED: dict[str, set[str]] = {
    "cli": {"launch", "verify", "topology", "engines", "staging"},  # staging: bench, doctor
    "launch": {"topology", "engines"},
    "verify": {"launch", "topology", "engines"},
    "engines": {"topology"},
    "topology": set(),
    "serve": {"staging"},
    "staging": set(),
    "core": set(),
    "errors": set(),
    "console": set(),
    "records": set(),
    "settings": set(),
    "titles": set(),
}
# no SHARED extras; records: the JSON between processes, which servers write
STRICT = {
    "staging": set(),
    "core": set(),
    "records": set(),
    "serve": {"staging", "core", "records", "settings", "titles"},
    "settings": set(),
    "titles": set(),
}


def top_package(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def pdctl_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "pdctl" and len(parts) > 1:
                found.add(parts[1])
    return found


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REPO)) for p in SOURCES])
def test_imports_follow_the_package_map(path: Path) -> None:
    package = top_package(path)
    if package in ("__init__",):
        return
    if package in STRICT:
        allowed = STRICT[package] | {package}
    else:
        allowed = ALLOWED[package] | SHARED | {package}
    imported = pdctl_imports(path)
    assert imported <= allowed, f"{path.relative_to(REPO)} imports {sorted(imported - allowed)}"


# serve sub-package -> the serve modules it may import (besides itself): the model
# knows nothing of the engine; the engine reaches the model only through `Piece`.
SERVE_PARTS: dict[str, set[str]] = {
    "model": set(),
    "engine": {"model", "faults", "tokenizer"},
    # the HTTP layer: the engine's requests, never a role's internals or the model
    "api": {"engine", "multimodal", "tokenizer"},
    # the router: the API's torch-free errors and guards and the serving loop only, never
    # the engine or a role (they import torch)
    "router": {"api", "args", "faults", "http"},
}


def serve_imports(path: Path) -> set[str]:
    """The pdctl.serve sub-packages or modules that `path` imports (absolute imports)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "pdctl.serve":
                names = [f"pdctl.serve.{alias.name}" for alias in node.names]
        found |= {n.split(".")[2] for n in names if n.startswith("pdctl.serve.")}
    return found


SERVE_PART_SOURCES = sorted(
    p for part in SERVE_PARTS for p in (PACKAGE / "serve" / part).rglob("*.py")
)


@pytest.mark.parametrize(
    "path", SERVE_PART_SOURCES, ids=[str(p.relative_to(REPO)) for p in SERVE_PART_SOURCES]
)
def test_serve_parts_import_only_what_they_may(path: Path) -> None:
    part = path.relative_to(PACKAGE / "serve").parts[0]
    imported = serve_imports(path) - {part}
    assert imported <= SERVE_PARTS[part], f"{path.relative_to(REPO)} imports {sorted(imported)}"


def test_the_router_process_does_not_import_torch() -> None:
    """The router computes nothing: its process (the server's entry, the router and the
    serving loop) starts without torch (2.2 s of CPU at every launch when it did)."""
    code = (
        "import sys, pdctl.serve.__main__, pdctl.serve.router, pdctl.serve.http; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_cli_commands_do_not_import_torch() -> None:
    """validate/schema/plan start fast: importing the CLI must not pull in torch."""
    code = "import sys, pdctl.cli.app; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_router_starts_without_torch() -> None:
    """The router and the server entry point for it import no torch (1.2 s of start-up)."""
    code = (
        "import sys, pdctl.serve.router, pdctl.serve.__main__, pdctl.serve.api.guards; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_torch_cuda_only_in_the_device_module() -> None:
    offenders = []
    for path in SOURCES:
        if path.relative_to(PACKAGE).as_posix() == "staging/device.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "torch.cuda." in line and "# cuda-only:" not in line:
                offenders.append(f"{path.relative_to(REPO)}:{number}")
    assert offenders == []


def test_files_stay_small() -> None:
    sizes = {p: len(p.read_text().splitlines()) for p in SOURCES}
    too_big = {str(p.relative_to(REPO)): n for p, n in sizes.items() if n > 450}
    assert too_big == {}


# Ratchets (issue 37): what the package had when they were set; lower them as it shrinks.
UNTYPED_DICTS = 43  # `dict[str, Any]` occurrences (307 when issue 37 began)


def test_no_formatting_held_off() -> None:
    """No `# fmt: skip`: a wall ruff would explode is reshaped (a table, a record, flags())."""
    held = [
        f"{p.relative_to(REPO)}:{n}"
        for p in SOURCES
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "# fmt: skip" in line
    ]
    assert held == []


def test_untyped_dicts_do_not_grow() -> None:
    count = sum(p.read_text().count("dict[str, Any]") for p in SOURCES)
    assert count <= UNTYPED_DICTS, f"{count} `dict[str, Any]` (at most {UNTYPED_DICTS}): type it"


def test_nothing_kills_processes_by_name() -> None:
    # the banned commands are spelled in pieces so that this file does not name them
    banned = ("p" + "kill", "kill" + "all")
    pattern = re.compile(r"\b(" + "|".join(banned) + r")\b")
    places = [
        *SOURCES,
        REPO / "Makefile",
        *REPO.joinpath("scripts").glob("*"),
        REPO / ".ci" / "run",
    ]
    assert [str(p) for p in places if pattern.search(p.read_text())] == []


def test_every_module_opens_with_a_docstring() -> None:
    missing = [
        str(p.relative_to(REPO))
        for p in SOURCES
        if p.stat().st_size and ast.get_docstring(ast.parse(p.read_text())) is None
    ]
    assert missing == []


def test_nothing_from_the_network_is_unpickled() -> None:
    """No pickle, marshal or unsafe YAML anywhere; torch.load only with weights_only."""
    banned = re.compile(
        r"\bimport (c?pickle|marshal|dill|shelve)\b|\bpickle\.loads?\b|\byaml\.(unsafe_)?load\("
        r"|\bYAML\(typ=.unsafe|\beval\(|\bexec\("
    )
    found = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in SOURCES
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if banned.search(line) or ("torch.load(" in line and "weights_only=True" not in line)
    ]
    assert found == []


# Functions over 80 lines in files another engineer is restructuring now; each is split
# there and its line removed (the list is to be emptied, never added to).
LONG_FUNCTIONS_ALLOWED: set[str] = set()


def test_no_function_over_80_lines() -> None:
    """The package reads part by part: no function or method over 80 lines."""
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                where = f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"
                if length > 80 and where not in LONG_FUNCTIONS_ALLOWED:
                    long.append(f"{where} ({length} lines, line {node.lineno})")
    assert long == []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module an `ImportFrom` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - node.level + 1]
    return ".".join([*parts, *([node.module] if node.module else [])])


def module_imports(source: str, me: str, is_package: bool = False) -> set[str]:
    """The pdctl modules a module imports anywhere: at module level, under
    `if TYPE_CHECKING:` and inside functions (lazily) alike, since each is a dependency of
    one module on the other. `from pkg import sub` depends on the module `pkg.sub` where
    that is a module."""
    package = me if is_package else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {name for name in found if name in MODULES and name != me}


def path_imports(path: Path) -> set[str]:
    return module_imports(
        path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py"
    )


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    cycles.append(sorted(members))
    return cycles


def test_no_import_circles() -> None:
    """No two modules import each other, directly or round a longer circle, counting
    imports under TYPE_CHECKING and inside functions (a lazy import hides a circle, it
    does not end it)."""
    graph = {name: path_imports(path) for name, path in MODULES.items()}
    described = [
        " -> ".join(f"{m} (imports {sorted(graph[m] & set(c))})" for m in c)
        for c in import_cycles(graph)
    ]
    assert described == []


def test_the_cycle_rule_sees_a_circle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_cycle_rule_counts_lazy_and_type_checking_imports() -> None:
    """An import under TYPE_CHECKING and one inside a function are both dependencies."""
    lazy = "def f():\n    from pdctl.launch import run\n"
    typed = "if TYPE_CHECKING:\n    from pdctl.launch.run import Run\n"
    assert module_imports(lazy, "pdctl.launch.readiness") == {"pdctl.launch.run"}
    assert module_imports(typed, "pdctl.launch.readiness") == {"pdctl.launch.run"}
    relative = "from .run import Run\n"
    assert module_imports(relative, "pdctl.launch.readiness") == {"pdctl.launch.run"}


def _only_reexports(path: Path) -> bool:
    """An `__init__.py` without functions or classes: nothing of its own to describe."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return path.name == "__init__.py" and not any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in body
    )


def structure_sections() -> dict[str, str]:
    """docs/structure.md's package sections: `### `pdctl/serve/api/`` -> its text."""
    text = (REPO / "docs" / "structure.md").read_text(encoding="utf-8")
    parts = re.split(r"^### `pdctl/([\w/]*)`\s*$", text, flags=re.MULTILINE)
    return {parts[i].rstrip("/"): parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def test_structure_names_every_module() -> None:
    """Every module has its line in docs/structure.md, in its package's section."""
    sections = structure_sections()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _only_reexports(path):
            continue
        rel = path.relative_to(PACKAGE)
        package = rel.parent.as_posix() if rel.parent != Path(".") else ""
        section = sections.get(package, "")
        if f"`{rel.name}`" not in section and f"`{rel.as_posix()}`" not in section:
            missing.append(rel.as_posix())
    assert missing == [], "docs/structure.md does not name these modules in their section"


def test_structure_carries_no_changelog() -> None:
    text = (REPO / "docs" / "structure.md").read_text(encoding="utf-8")
    history = re.compile(r"\bsession \d+|\(planned\)|\bno longer\b|\bused to\b|\bis now\b", re.I)
    assert history.findall(text) == []


def private_imports(source: str, me: str, is_package: bool = False) -> list[str]:
    """`module.name` for each name private to another pdctl module that `source` imports
    (`from pdctl.x.y import _name`; a module's own privates are its business)."""
    package = me if is_package else me.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = _resolve(node, package)
        if base == me or not (base == "pdctl" or base.startswith("pdctl.")):
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{base}.{alias.name}")
    return found


# Files that import another module's private names today; each is being fixed by the
# engineer who owns it. The list only shrinks: an entry leaves when its file is clean
# (test_the_allow_lists_are_minimal fails until it does), and none is ever added.
PRIVATE_IMPORTS_ALLOWED: set[str] = set()


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_no_private_names_imported_across_modules() -> None:
    found = {
        _rel(p): names
        for p in SOURCES
        if (names := private_imports(p.read_text(encoding="utf-8"), module_name(p),
                                     p.name == "__init__.py"))
    }  # fmt: skip
    assert {k: v for k, v in found.items() if k not in PRIVATE_IMPORTS_ALLOWED} == {}


def test_the_private_import_rule_sees_one() -> None:
    bad = "from pdctl.staging.kernels import _check_heads\n"
    assert private_imports(bad, "pdctl.staging.kernels.page_write") == [
        "pdctl.staging.kernels._check_heads"
    ]
    relative = "from .digest import _table, table\n"
    assert private_imports(relative, "pdctl.staging.kernels.page_write") == [
        "pdctl.staging.kernels.digest._table"
    ]
    fine = "from pdctl.staging.kernels import check_heads\nfrom os import _exit\n"
    assert private_imports(fine, "pdctl.staging.kernels.page_write") == []


def env_names(source: str) -> list[str]:
    """The `PDCTL_` names a module spells in code: string literals (f-string parts too)
    that start with the prefix, docstrings and comments apart."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("PDCTL_")
        and id(node) not in docstrings
    ]


def is_settings_table(path: Path) -> bool:
    """pdctl/settings.py and a package's pdctl/<package>/settings.py."""
    return path.name == "settings.py" and len(path.relative_to(PACKAGE).parts) <= 2


# Files that read or name a PDCTL_ variable outside a settings table today; each is being
# moved into its package's table by the engineer who owns it. The list only shrinks: an
# entry leaves when its file is clean (test_the_allow_lists_are_minimal fails until it
# does), and none is ever added.
ENV_NAMES_ALLOWED: set[str] = set()


def test_pdctl_variables_only_in_settings_tables() -> None:
    found = {
        _rel(p): names
        for p in SOURCES
        if not is_settings_table(p) and (names := env_names(p.read_text(encoding="utf-8")))
    }
    assert {k: v for k, v in found.items() if k not in ENV_NAMES_ALLOWED} == {}


def test_the_env_rule_sees_one() -> None:
    bad = 'import os\nswitch = os.environ.get("PDCTL_SWITCH", "1")\n'
    assert env_names(bad) == ["PDCTL_SWITCH"]
    assert env_names('name = "x"\nwarn = f"PDCTL_X={name} is bad"\n') == ["PDCTL_X="]
    fine = '"""PDCTL_X in a docstring."""\n# PDCTL_Y in a comment\nx = "MC_PDCTL_Z"\n'
    assert env_names(fine) == []
    assert is_settings_table(PACKAGE / "launch" / "settings.py")
    assert not is_settings_table(PACKAGE / "serve" / "pd" / "settings.py")


def test_the_allow_lists_are_minimal() -> None:
    """An allow-listed file that no longer breaks its rule leaves the list."""
    clean_private = [
        rel for rel in PRIVATE_IMPORTS_ALLOWED
        if not (REPO / rel).exists()
        or not private_imports((REPO / rel).read_text(encoding="utf-8"),
                               module_name(REPO / rel), rel.endswith("__init__.py"))
    ]  # fmt: skip
    clean_env = [
        rel for rel in ENV_NAMES_ALLOWED
        if not (REPO / rel).exists() or not env_names((REPO / rel).read_text(encoding="utf-8"))
    ]  # fmt: skip
    assert (sorted(clean_private), sorted(clean_env)) == ([], [])


def engine_branches(source: str) -> list[int]:
    """Lines that ask which engine a topology runs (`x.engine == "vllm"`, `!=`, `in`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        asks = any(isinstance(s, ast.Attribute) and s.attr == "engine" for s in sides)
        names = any(
            (isinstance(s, ast.Constant) and isinstance(s.value, str))
            or isinstance(s, (ast.Tuple, ast.List, ast.Set))
            for s in sides
        )
        if asks and names:
            found.append(node.lineno)
    return found


def test_only_engines_ask_which_engine_runs() -> None:
    """An engine is an adapter, not a branch (CONVENTIONS.md 18): what differs by engine
    is a method or attribute of `Engine`, asked through `get_engine`."""
    found = {
        _rel(p): lines
        for p in SOURCES
        if top_package(p) != "engines" and (lines := engine_branches(p.read_text()))
    }
    assert found == {}


def test_the_engine_branch_rule_sees_one() -> None:
    assert engine_branches('if topology.engine != "embedded":\n    pass\n') == [1]
    assert engine_branches('x = t.engine in ("sglang", "vllm")\n') == [1]
    assert engine_branches("x = get_engine(t.engine).own_servers\n") == []


def test_test_files_have_unique_names() -> None:
    """pytest imports test files by their base name (tests/ has no __init__.py): two
    files of one name fail the collection of the second ("import file mismatch")."""
    names: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
