"""docs/architecture.md checked against the code where it names an order or a location: the parallelization
and hook orders, every file path and dotted name, and which function takes the output directory's lock."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
TEXT = DOC.read_text()
PACKAGES = ("libai_lite", "compat", "projects", "tools", "bench", "configs")
# Dotted names whose first part is a config section: keys, not code.
CONFIG_SECTIONS = {"train", "model", "optim", "dataloader", "tokenization"}


def _prose() -> str:
    """The document without its fenced blocks."""
    return re.sub(r"```.*?```", "", TEXT, flags=re.S)


def _flow_step(number: int) -> str:
    """The text of item ``number`` of "The flow of a run"."""
    flow = TEXT.split("## The flow of a run", 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"^{number}\. (.*?)(?=^\d+\. |\Z)", flow, flags=re.S | re.M)
    assert match, f"docs/architecture.md has no step {number} in 'The flow of a run'"
    return " ".join(match.group(1).split())


def _module_index() -> dict[str, ast.Module]:
    """Every module of the repository's packages, by dotted name, parsed (nothing is imported)."""
    index = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            index[name] = ast.parse(path.read_text(), str(path))
    return index


MODULES = _module_index()


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name] = node
    return names


def _class_has(node: ast.ClassDef, attr: str) -> bool:
    return any(getattr(n, "name", None) == attr for n in node.body) or any(
        isinstance(n, ast.Assign) and any(getattr(t, "id", None) == attr for t in n.targets) for n in node.body)


def _resolves(dotted: str) -> bool:
    """``dotted`` names a module, a module's top-level name or a class's member of this repository (a module
    may be named by any tail of its path: ``run_spec``, ``engine.launch``), or a torch module or attribute."""
    parts = dotted.split(".")
    if parts[0] == "torch":
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                return False
            return True
        return False
    for i in range(len(parts), 0, -1):
        head, rest = ".".join(parts[:i]), parts[i:]
        for name, tree in MODULES.items():
            if name != head and not name.endswith("." + head):
                continue
            if not rest:
                return True
            node = _top_level(tree).get(rest[0])
            if node is not None and (len(rest) == 1 or (
                    len(rest) == 2 and isinstance(node, ast.ClassDef) and _class_has(node, rest[1]))):
                return True
    # A class named bare: Class.method.
    if len(parts) == 2:
        return any(isinstance(node := _top_level(tree).get(parts[0]), ast.ClassDef) and _class_has(node, parts[1])
                   for tree in MODULES.values())
    return False


def _dotted_names() -> list[str]:
    spans = re.findall(r"`([^`\s]+)`", _prose())
    names = []
    for span in spans:
        span = span.removesuffix("()")
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", span):
            continue
        if span.split(".")[-1] in ("py", "sh", "md", "json", "yaml", "txt", "tmp") or span.split(".")[0] in CONFIG_SECTIONS:
            continue
        names.append(span)
    return names


def test_every_dotted_name_exists():
    """Every `module.function`, `Class.method` and torch module the document names is there."""
    names = _dotted_names()
    assert "BuiltRun._setup_output" in names and "run_spec.resolve_run" in names
    missing = [n for n in names if not _resolves(n)]
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"


_PATH = re.compile(r"(?<![\w./-])([\w-]+(?:/[\w.*-]+)*/?(?:\.(?:py|sh|md))?)(?![\w])")


def _path_tokens(text: str) -> list[str]:
    """Tokens that look like a file (``x.py``, ``a/b.sh``) or a folder (``a/``, ``a/b``) of the repository."""
    return [t for t in _PATH.findall(text) if t.endswith(("/", ".py", ".sh"))]


def _exists(token: str, *bases: str) -> bool:
    return any(list(ROOT.glob(base + token.rstrip("/"))) for base in ("", "libai_lite/", *bases))


def test_every_path_in_the_tree_exists():
    """"Where things live": each entry, and each file or folder its description names, relative to the entry."""
    block = TEXT.split("## Where things live", 1)[1].split("```", 2)[1]
    missing, entry = [], ""
    for line in block.splitlines()[1:]:
        match = re.match(r"^( {0,2})(\S+(?: \S+)*?)(?:\s{2,}|$)(.*)", line)
        if match and len(match.group(1)) <= 2 and match.group(2):
            base = "libai_lite/" if match.group(1) else ""
            heads = match.group(2).split()
            for head in heads:
                if not _exists(head, base):
                    missing.append(head)
            entry = base + heads[0] if heads[0].endswith("/") else base
            rest = match.group(3)
        else:
            rest = line
        # A description may name what each of the entry's folders holds (projects/: modeling/).
        missing += [t for t in _path_tokens(rest) if not _exists(t, entry, entry + "*/")]
    assert not missing, f"docs/architecture.md's tree names files or folders that are not there: {missing}"


def test_every_path_in_the_prose_exists():
    """Every `path/to/file.py`, `file.py` and folder/ the prose names (in backticks or not) is in the repository."""
    tokens = _path_tokens(_prose())
    assert "tools/train.sh" in tokens and "libai_lite/planning/" in tokens
    missing = [t for t in tokens if not _exists(t)]
    assert not missing, f"docs/architecture.md names paths that are not there: {missing}"


def _calls_in_order(module: str, function: str, prefix: str) -> list[str]:
    """The names of the functions ``function`` calls whose name starts with ``prefix``, in source order."""
    tree = MODULES[module]
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id.startswith(prefix)]
    return [c.func.id for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


def test_parallelization_order_is_the_code_order():
    """The steps of flow item 5 come in the order ``parallelize_part`` applies them."""
    step = _flow_step(5)
    assert "parallelize_part" in step
    documented = re.findall(r"`(apply_\w+)`", step)
    applied = _calls_in_order("libai_lite.parallel.parallelize", "parallelize_part", "apply_")
    assert applied[0] == "apply_float8" and applied[-1] == "apply_data_parallel"
    assert documented == applied, f"docs/architecture.md: {documented}; parallelize_part: {applied}"


def test_hook_order_is_the_code_order():
    """The hooks of flow item 7 come in the order ``hooks_in_order`` returns them."""
    from libai_lite.engine import hooks
    from libai_lite.engine.profiler import ProfilerHook

    kinds = {"timer": hooks.IterationTimer, "writer": hooks.PeriodicWriter, "checkpointer": hooks.PeriodicCheckpointer,
             "signal_checkpointer": hooks.SignalCheckpointer, "evaluation": hooks.EvalHook,
             "best": hooks.BestCheckpointer, "profiler": ProfilerHook}
    # Each argument a stand-in naming its class: the order comes from the function, not from this table.
    order = hooks.hooks_in_order(**{arg: cls.__name__ for arg, cls in kinds.items()})
    step = _flow_step(7)
    assert "hooks_in_order" in step
    documented = [n for n in re.findall(r"`(\w+)`", step) if n in {c.__name__ for c in kinds.values()}]
    assert documented == order, f"docs/architecture.md: {documented}; hooks_in_order: {order}"


def _lock_takers() -> set[str]:
    """Qualified names of the functions of libai_lite that call ``OutputDirLock(...).acquire()``."""
    takers = set()

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope + [child.name] if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else scope
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "acquire"
                    and isinstance(child.func.value, ast.Call)
                    and getattr(child.func.value.func, "id", None) == "OutputDirLock"):
                takers.add(".".join(scope))
            visit(child, inner)

    for name, tree in MODULES.items():
        if name.startswith("libai_lite"):
            visit(tree, [])
    return takers


def test_the_function_named_takes_the_output_lock():
    """The one function the document says takes the output directory's lock is the one that calls acquire."""
    sentences = re.findall(r"`([\w.]+)` takes the output directory's lock", " ".join(TEXT.split()))
    assert len(sentences) == 1, f"docs/architecture.md should name one taker of the output lock: {sentences}"
    assert _lock_takers() == {sentences[0]}
    assert "lock" not in _flow_step(3), "step 3 (default_setup) takes no lock"


@pytest.mark.parametrize("name", ["default_setup.takes_lock", "DefaultTrainer._no_such_method", "nowhere.fn"])
def test_a_wrong_name_is_caught(name):
    """The resolver refuses names the code does not have."""
    assert not _resolves(name)
