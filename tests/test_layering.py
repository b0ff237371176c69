"""Imports go downwards only: config → the layout and the model's shape → model, parallel and data
→ optim → checkpoint → what composes them (resolve, the planner) → trainer → entry points → the
commands users run. tools/NAME.py of a command imports nothing but it; the other scripts under
tools/ (benchmarks, developer checks) import the package, never the package them. Read from the
source (every import, function-local ones too), so a cycle hidden in a function cannot creep
back."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a module may import its own level and the levels below it
# (a module's own entry, e.g. "parallel.layout", comes before its package's)
LEVELS = {
    "errors": 0, "config": 0, "cli": 0, "host_memory": 0, "user_files": 0, "early_stop": 0,
    "parallel.layout": 1, "model.args": 1,
    "data": 2, "parallel": 2, "model": 2, "monitor": 2, "kernels": 2,
    "optim": 3, "eval": 3,  # eval: scores task items with the model's forward
    "checkpoint": 4,
    "planner": 5, "recovery": 5, "run_lock": 5, "faults": 5, "oom": 5, "run_state": 5, "run_watch": 5,
    "resolve": 5, "runtime": 5, "attempts": 5,
    "trainer": 6,
    "train": 7, "launcher": 7, "simulate": 7,  # simulate: runs the trainer's steps on fake tensors
    "commands": 8,  # what users run on a job: may drive the trainer; nothing below imports it
}
DRIVERS = {"smoke_test"}  # commands whose job is to run the real trainer in-process


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``: imports for annotations, never run."""
    out = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING"):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(path: str, package: str | None, annotations: bool = False) -> set[str]:
    """The megapretrain modules ``path`` imports when it runs (with ``annotations``, also those it
    imports only for type annotations), as dotted names."""
    out = set()
    tree = ast.parse(open(path).read(), path)
    skip = set() if annotations else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("megapretrain"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("megapretrain"):
                out.add(name)
    return out


def _level(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 2 and ".".join(parts[1:3]) in LEVELS:
        return LEVELS[".".join(parts[1:3])]
    return LEVELS[parts[1]] if len(parts) > 1 else 0


def _package_modules():
    for folder, _, files in os.walk(os.path.join(ROOT, "megapretrain")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
                package = module if f == "__init__.py" else module.rsplit(".", 1)[0]
                yield module, package, os.path.join(folder, f)


def test_package_imports_go_downwards():
    wrong = []
    for module, package, path in _package_modules():
        if module == "megapretrain":
            continue
        for imported in _imports(path, package):
            if _level(imported) > _level(module):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, wrong


def test_no_import_cycles_between_modules():
    """No two modules import each other, even only for annotations, within a floor too: a circle
    means neither owns the seam between them."""
    graph = {module: {i for i in _imports(path, package, annotations=True) if i != module}
             for module, package, path in _package_modules()}
    known = set(graph)
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph.get(node, ()):
            nxt = nxt if nxt in known else nxt.rsplit(".", 1)[0]  # "from pkg import name" of a function
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join(stack + [node, nxt]))
            if nxt in known and not state.get(nxt):
                visit(nxt, stack + [node])
        state[node] = 2

    for module in graph:
        if not state.get(module):
            visit(module, [])


def test_only_the_drivers_among_commands_import_the_training_loop():
    wrong = []
    for module, package, path in _package_modules():
        name = module.split(".")
        if name[1:2] == ["commands"] and name[-1] not in DRIVERS:
            found = {i for i in _imports(path, package) if i in ("megapretrain.trainer", "megapretrain.train")}
            wrong += [f"{module} imports {i}" for i in found]
    assert not wrong, wrong


def _top_level_imports(path: str) -> list[tuple[int, str]]:
    """(line, module) of every import of ``path``, in the order they run at import time."""
    out = []
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node.lineno, node.module))
    return out


def test_tools_are_commands_or_scripts_over_the_package():
    """tools/NAME.py of a command is an entry point: it imports megapretrain.commands.NAME and
    nothing else of the package (its logic lives there, importable and tested). Every other script
    (benchmarks, developer checks) imports tools/_tool.py before the package (one line, not a
    traceback, where the package is not installed) and no command but through its flags."""
    tools = os.path.join(ROOT, "tools")
    commands = os.path.join(ROOT, "megapretrain", "commands")
    wrong = []
    for f in sorted(os.listdir(tools)):
        if not f.endswith(".py") or f.startswith("_"):
            continue
        path = os.path.join(tools, f)
        found = _imports(path, None)
        if os.path.exists(os.path.join(commands, f)):
            if found != {f"megapretrain.commands.{f[:-3]}"}:
                wrong.append(f"tools/{f} imports {sorted(found)}")
            continue
        order = [module.split(".")[0] for _, module in sorted(_top_level_imports(path))]
        package = [i for i, name in enumerate(order) if name == "megapretrain"]
        if "_tool" not in order or (package and order.index("_tool") > package[0]):
            wrong.append(f"tools/{f} does not import _tool before the package")
        wrong += [f"tools/{f} imports {i}" for i in found if i.startswith("megapretrain.commands")]
    assert not wrong, wrong


def test_the_package_imports_no_script_of_tools():
    scripts = {f[:-3] for f in os.listdir(os.path.join(ROOT, "tools")) if f.endswith(".py")}
    wrong = []
    for module, _, path in _package_modules():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            wrong += [f"{module} imports {n}" for n in names if n and n.split(".")[0] in scripts]
    assert not wrong, wrong


def test_no_test_module_imports_another():
    """Tests share tests/helpers.py (and the other helper modules), never each other: a test module
    imported by another runs its module-level setup there too, and couples the two files."""
    tests = os.path.join(ROOT, "tests")
    modules = {f[:-3] for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py")}
    wrong = []
    for name in sorted(modules):
        tree = ast.parse(open(os.path.join(tests, f"{name}.py")).read())
        for node in ast.walk(tree):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            wrong += [f"{name} imports {i}" for i in imported if i and i.split(".")[0] in modules]
    assert not wrong, wrong


def _attributes_used_and_owned(path: str, cls: str) -> tuple[set[str], set[str]]:
    """The ``self.X`` names a class reads, and those it owns: assigned on ``self`` or defined in it
    (its methods and class attributes)."""
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    used = set()
    owned = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    owned |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            (owned if isinstance(n.ctx, ast.Store) else used).add(n.attr)
    return used, owned


def test_the_trainers_collaborators_own_what_they_use():
    """RunState and RunWatch are objects the trainer holds, not bases that read the trainer's
    fields through ``self``: every attribute either reads is one it sets or defines itself."""
    for module, cls in (("run_state", "RunState"), ("run_watch", "RunWatch"), ("trainer", "Trainer")):
        path = os.path.join(ROOT, "megapretrain", f"{module}.py")
        tree = ast.parse(open(path).read())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        assert not node.bases, f"{cls} inherits {[ast.unparse(b) for b in node.bases]}"
        used, owned = _attributes_used_and_owned(path, cls)
        assert used <= owned, f"{cls} reads {sorted(used - owned)} without setting or defining them"
