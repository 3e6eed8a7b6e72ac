"""The code's stated interfaces, read from its source (AST), so that they hold
without anyone remembering them:

- no module imports an underscore name (a function, class, constant or module)
  from another package's modules: what one package needs from another lives in a
  module that exports it under a public name (a module that says it is shared,
  such as `eqxpar/pipeline/_program.py`). Packages: `eqxpar` (its top-level
  modules), each subpackage `eqxpar.<name>`, and `tests`, `benchmarks`,
  `examples`;
- no import cycle among eqxpar's modules, function-local imports included (a
  package's `__init__` importing its own modules is not one);
- no function in `eqxpar/` has more than 80 lines of code (its docstring aside);
- no block of `REPEATED_LINES` or more lines of code stands twice in `benchmarks/`,
  or in both `benchmarks/` and `eqxpar/`: a benchmark imports what it shares with
  another or with the library, so that what is measured is the library's code;
- no test file imports from another test file: what several share lives in
  `tests/_helpers.py` (or `conftest.py`).
"""

import ast
import pathlib
import sys
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TREES = ("eqxpar", "tests", "benchmarks", "examples")
MAX_FUNCTION_LINES = 80
REPEATED_LINES = 6


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))}


def _package(module: str) -> str:
    """`eqxpar.pipeline._engine` -> `eqxpar.pipeline`; `eqxpar._plan` -> `eqxpar`;
    `tests.test_x` -> `tests`."""
    parts = module.split(".")
    if parts[0] != "eqxpar" or len(parts) == 1:
        return parts[0]
    if len(parts) > 2 or (ROOT / "eqxpar" / parts[1]).is_dir():
        return "eqxpar." + parts[1]
    return "eqxpar"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _source_of(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` reads from."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """Every import of an eqxpar module in `module`, at any depth (function-local
    imports included), as `(module imported from, name or None for a module itself,
    line, the name as written)`; and every attribute use `(module, attribute, line)`
    of a name bound to an eqxpar module."""
    tree = ast.parse(MODULES[module].read_text())
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source_of(module, node)
            if not source.startswith("eqxpar"):
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:  # `from eqxpar.pipeline import _engine`: a module
                    found.append((full, None, node.lineno, alias.name))
                    aliases[alias.asname or alias.name] = full
                else:
                    found.append((source, alias.name, node.lineno, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("eqxpar"):
                    found.append((alias.name, None, node.lineno, alias.name.rsplit(".", 1)[-1]))
                    aliases[alias.asname or alias.name] = alias.name
    uses = [
        (aliases[node.value.id], node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
    ]
    return found, uses


def private_imports_across_packages() -> list[str]:
    found = []
    for module in MODULES:
        imports, uses = _imports(module)
        where = f"{MODULES[module].relative_to(ROOT)}"
        for target, name, line, last in imports:
            if _package(target) == _package(module):
                continue
            if name is not None and _is_private(name):
                found.append(f"{where}:{line} imports {name} from {target}")
            elif name is None and any(_is_private(part) for part in target.split(".")[1:]):
                # A private module itself, bound to a name, from another package.
                if _is_private(last) or module.startswith(("tests", "benchmarks", "examples")):
                    found.append(f"{where}:{line} imports the private module {target}")
        for target, attr, line in uses:
            if _is_private(attr) and _package(target) != _package(module):
                found.append(f"{where}:{line} uses {target}.{attr}")
    return found


def import_cycles() -> list[list[str]]:
    edges = defaultdict(set)
    for module in MODULES:
        if not module.startswith("eqxpar"):
            continue
        for target, name, _, _ in _imports(module)[0]:
            full = f"{target}.{name}" if name else target
            target = full if full in MODULES else target
            # A package importing its own modules (its public names) is not a cycle.
            if target in MODULES and not target.startswith(module + "."):
                edges[module].add(target)
    # Tarjan's strongly connected components.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(m for m in MODULES if m.startswith("eqxpar")):
        if v not in index:
            visit(v)
    return cycles


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = function.end_lineno - function.lineno + 1
    first = function.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def long_functions() -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} has {_code_lines(node)} lines"
        for path in sorted((ROOT / "eqxpar").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _code_lines(node) > MAX_FUNCTION_LINES
    ]


def test_no_private_import_across_packages():
    found = private_imports_across_packages()
    assert not found, (
        "Names that start with an underscore are private to their package. Move what "
        "another package needs into a module that says it is shared and give it a "
        "public name:\n" + "\n".join(found)
    )


#: What the core is built under: the models, and the layers (`eqxpar.nn`).
ABOVE_THE_CORE = ("eqxpar.models", "eqxpar.nn")


def core_imports_of_models() -> list[str]:
    """Imports of `eqxpar.models` or `eqxpar.nn` (or anything in them) by the core:
    the modules directly in `eqxpar/` and in its private packages (`eqxpar/_train/`),
    other than its `__init__` (the step, the plan, the gradients). The models and
    layers are built on the core, so the core asks a model what it needs (a method,
    or a base class of its own such as `_stack_order.OrderedStack`), never its class."""
    found = []
    for module in MODULES:
        package = _package(module)
        if not (package == "eqxpar" or _is_private(package.split(".")[-1])) or module == "eqxpar":
            continue
        if module.startswith("eqxpar._advise"):  # the advisor builds models to predict them
            continue
        for target, name, line, _ in _imports(module)[0]:
            full = f"{target}.{name}" if name else target
            if any(full == above or full.startswith(above + ".") for above in ABOVE_THE_CORE):
                found.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {full}")
    return found


def test_the_core_imports_no_model_and_no_layer():
    found = core_imports_of_models()
    assert not found, "the core imports a model or eqxpar.nn:\n" + "\n".join(found)


#: The packages that read costs (bytes, FLOPs) off a plan, a program or a model.
COST_READERS = ("eqxpar/inspect", "eqxpar/_advise")


def byte_sizes_outside_the_helper() -> list[str]:
    """Element sizes read in the cost readers other than through `eqxpar._sizes`
    (one byte-size helper: `itemsize`, `array_bytes`, `nbytes`)."""
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} reads .itemsize"
        for tree in COST_READERS
        for path in sorted((ROOT / tree).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "itemsize"
    ]


def test_one_byte_size_helper():
    found = byte_sizes_outside_the_helper()
    assert not found, "use eqxpar._sizes (itemsize, array_bytes, nbytes):\n" + "\n".join(found)


#: Where a function that counts FLOPs may live: the one counter of a program's
#: matmuls (HLO or jaxpr), the model-FLOPs formula behind MFU, and a device
#: profile's peak rate (not a count).
FLOP_FUNCTIONS = {
    "eqxpar/inspect/_flops.py": None,
    "eqxpar/models/_flops.py": None,
    "eqxpar/_advise/_profile.py": {"flops"},
}


def flop_counters_outside_their_module() -> list[str]:
    """Functions named for FLOPs outside `FLOP_FUNCTIONS`: a second counter."""
    found = []
    for path in sorted((ROOT / "eqxpar").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where in FLOP_FUNCTIONS and FLOP_FUNCTIONS[where] is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "flops" in node.name.lower():
                if node.name not in (FLOP_FUNCTIONS.get(where) or ()):
                    found.append(f"{where}:{node.lineno} defines {node.name}")
    return found


def test_one_flop_counter():
    found = flop_counters_outside_their_module()
    assert not found, "count matmul FLOPs with eqxpar.inspect.matmul_flops (HLO or jaxpr):\n" + "\n".join(
        found
    )


def cost_labels_read_by_the_advisor() -> list[str]:
    """Reads of a `Minimum`'s printed labels (`.parts`, `.label`) in the advisor:
    it reads each cost's fields (`kind`, `axes`, `source`, `wire_bytes`)."""
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}"
        for path in sorted((ROOT / "eqxpar" / "_advise").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("parts", "label")
    ]


def test_the_advisor_reads_costs_as_data():
    found = cost_labels_read_by_the_advisor()
    assert not found, "read Minimum.costs' fields, not the labels:\n" + "\n".join(found)


#: The modules that may read a plan's options: the plan itself and the layouts it
#: resolves into, the step's and the batch's (issue: one reader of the plan).
PLAN_OWNERS = (
    "eqxpar/_plan.py",
    # The resolver: what a step reads, resolved once from the plan by a builder.
    "eqxpar/_train/_resolved_plan.py",
    "eqxpar/_train/_step_layout.py",
    "eqxpar/_batch_layout.py",
    "eqxpar/_parallel_dims.py",
    # The pipeline package resolves its own options in one module of its own.
    "eqxpar/pipeline/_pipeline_plan.py",
)
#: Reads of plan options (other than `mesh` and `rules`) outside the owners, per module,
#: as they stand: a ratchet, lowered as each module asks the layout instead. A module
#: not listed may read none.
PLAN_READS: dict[str, int] = {}
#: Layer constructors over 10 parameters, as they stand (the goal: none, each layer
#: built from small config objects). A class not listed may take at most 10.
WIDE_CONSTRUCTORS = {
    # 21 with `stage_gradients=` (pipelines under FSDP) and `offload=` (host offload).
    "eqxpar/_plan.py:Plan": 21,
}


def plan_options() -> set[str]:
    """`Plan`'s fields and properties, `mesh` and `rules` left out."""
    tree = ast.parse((ROOT / "eqxpar" / "_plan.py").read_text())
    plan = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Plan")
    fields = {
        n.target.id for n in plan.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    properties = {
        n.name
        for n in plan.body
        if isinstance(n, ast.FunctionDef)
        and any(
            getattr(d, "id", getattr(d, "attr", None)) in ("property", "cached_property")
            for d in n.decorator_list
        )
    }
    return (fields | properties) - {"mesh", "rules"}


def plan_reads() -> dict[str, int]:
    """Per module outside `PLAN_OWNERS`: reads `plan.<option>` or `<x>.plan.<option>`."""
    options, found = plan_options(), {}
    for path in sorted((ROOT / "eqxpar").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where in PLAN_OWNERS:
            continue
        count = sum(
            1
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute)
            and n.attr in options
            and (getattr(n.value, "id", None) == "plan" or getattr(n.value, "attr", None) == "plan")
        )
        if count:
            found[where] = count
    return found


#: Where no function takes the `Plan` (issue 53: a builder resolves it once and
#: passes the `ResolvedPlan` down): the step path, the pipeline engine, the
#: placing and region helpers the step calls.
NO_PLAN_PARAMETERS = (
    "eqxpar/_train/_step.py",
    "eqxpar/_train/_eval.py",
    "eqxpar/_train/_grad_automatic.py",
    "eqxpar/_train/_grad_common.py",
    "eqxpar/_train/_grad_manual.py",
    "eqxpar/_fsdp.py",
    "eqxpar/_train/_nonfinite.py",
    "eqxpar/_train/_resolved_plan.py",
    "eqxpar/_train/_step_layout.py",
    "eqxpar/_train/_train_state.py",
    "eqxpar/_train/_trainable.py",
    "eqxpar/_sharding.py",
    "eqxpar/_shard_map.py",
    "eqxpar/pipeline/_engine.py",
    "eqxpar/pipeline/_program.py",
)
#: The functions there that may take one, `path:qualified name` -> why.
PLAN_TAKERS_ALLOWED = {
    "eqxpar/_train/_step.py:make_step": "a builder: resolves the plan",
    "eqxpar/_train/_step.py:make_value_and_grad": "a builder: resolves the plan",
    "eqxpar/_train/_eval.py:make_eval_step": "a builder: resolves the plan",
    "eqxpar/_train/_train_state.py:init": "a builder (train.init): resolves the plan",
    "eqxpar/_train/_resolved_plan.py:ResolvedPlan.of": "the resolver",
    "eqxpar/_sharding.py:shard": "public: eqxpar.shard(tree, plan)",
    "eqxpar/_sharding.py:shard_batch": "public: eqxpar.shard_batch(batch, plan)",
    "eqxpar/_sharding.py:named_shardings": "for from_pretrained, which holds a plan",
    "eqxpar/_shard_map.py:filter_shard_map": "public: eqxpar.filter_shard_map(fn, plan)",
}
#: Functions of the whole package that take a plan (a parameter named `plan`, or
#: annotated `Plan`): 90 at 10c9e43; 62 once the step path took the resolved plan,
#: 36 once inspection and the advisor resolved theirs (PlanFacts), 35 with the context
#: attention folded into ParallelDims, 25 once the private helpers took the resolved
#: plan (the builders, the resolvers and the public functions); 26 with
#: eqxpar.models.lower_generate (public, as generate), 27 with
#: eqxpar.aot.compile_train_step (public). A ratchet.
MAX_PLAN_TAKERS = 27


def _takes_a_plan(function: ast.FunctionDef | ast.AsyncFunctionDef, *, any_annotation: bool) -> bool:
    """A parameter annotated `Plan` (alone or in a union), or named `plan` without
    another annotation (`any_annotation`: named `plan` whatever its annotation)."""
    a = function.args
    for arg in a.posonlyargs + a.args + a.kwonlyargs:
        names = set()
        if arg.annotation is not None:
            for n in ast.walk(arg.annotation):
                if isinstance(n, ast.Name):
                    names.add(n.id)
                elif isinstance(n, ast.Attribute):
                    names.add(n.attr)
                elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                    names.update(n.value.replace("|", " ").replace(".", " ").split())
        if "Plan" in names or (arg.arg == "plan" and (arg.annotation is None or any_annotation)):
            return True
    return False


def _functions(path: pathlib.Path):
    """`(qualified name, node)` of every function and method in `path`."""

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")

    yield from visit(ast.parse(path.read_text()), "")


def plan_takers_below_builders() -> list[str]:
    """Functions of `NO_PLAN_PARAMETERS` that take a `Plan` and are not in `PLAN_TAKERS_ALLOWED`."""
    found = []
    for where in NO_PLAN_PARAMETERS:
        path = ROOT / where
        if not path.exists():
            continue
        for name, node in _functions(path):
            if _takes_a_plan(node, any_annotation=False) and f"{where}:{name}" not in PLAN_TAKERS_ALLOWED:
                found.append(f"{where}:{node.lineno} {name}")
    return found


def plan_takers() -> list[str]:
    """Every function of the package with a parameter named `plan` or annotated `Plan`."""
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {name}"
        for path in sorted((ROOT / "eqxpar").rglob("*.py"))
        for name, node in _functions(path)
        if _takes_a_plan(node, any_annotation=True)
    ]


def test_no_function_below_a_builder_takes_the_plan():
    found = plan_takers_below_builders()
    assert not found, (
        "functions below a builder take the Plan; take the ResolvedPlan (eqxpar._train._resolved_plan) or "
        "what it answers (a mesh, a BatchLayout), or add a builder to PLAN_TAKERS_ALLOWED with its "
        "reason:\n" + "\n".join(found)
    )
    stale = [k for k in PLAN_TAKERS_ALLOWED if k.split(":")[0] not in NO_PLAN_PARAMETERS]
    assert not stale, f"PLAN_TAKERS_ALLOWED names functions outside NO_PLAN_PARAMETERS: {stale}"


def test_plan_takers_ratcheted():
    found = plan_takers()
    assert len(found) <= MAX_PLAN_TAKERS, (
        f"{len(found)} functions take a plan, more than {MAX_PLAN_TAKERS}: pass the ResolvedPlan down "
        "instead:\n" + "\n".join(found)
    )


def constructor_widths() -> dict[str, int]:
    """`module:Class` -> parameters of its `__init__` (self left out), for those over 10."""
    widths = {}
    for path in sorted((ROOT / "eqxpar").rglob("*.py")):
        for c in ast.walk(ast.parse(path.read_text())):
            for f in c.body if isinstance(c, ast.ClassDef) else ():
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    a = f.args
                    n = len(a.args) - 1 + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
                    if n > 10:
                        widths[f"{path.relative_to(ROOT)}:{c.name}"] = n
    return widths


def test_plan_options_are_read_by_their_owners_only_ratcheted():
    reads = plan_reads()
    over = {m: (n, PLAN_READS.get(m, 0)) for m, n in reads.items() if n > PLAN_READS.get(m, 0)}
    assert not over, (
        f"plan options read outside {PLAN_OWNERS} (module: (reads, allowed)): {over}. Ask the step "
        "layout (eqxpar._train._step_layout.StepLayout) instead, or add the option's answer there."
    )
    lowered = {m: (reads.get(m, 0), n) for m, n in PLAN_READS.items() if reads.get(m, 0) < n}
    assert not lowered, (
        f"fewer plan reads than PLAN_READS allows (module: (reads, allowed)): lower it: {lowered}"
    )


def test_layer_constructors_stay_narrow_ratcheted():
    widths = constructor_widths()
    assert widths == WIDE_CONSTRUCTORS, (
        f"constructors over 10 parameters: {widths}; allowed as they stand: {WIDE_CONSTRUCTORS}. "
        "Group options into a small config object (as torchtitan's TransformerBlock.Config)."
    )


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, f"import cycles (function-local imports included): {cycles}"


def imports_between_test_files() -> list[str]:
    """`from .test_x import ...` (or `tests.test_x`) in a module under `tests/`."""
    found = []
    for module, path in MODULES.items():
        if not module.startswith("tests"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                source = _source_of(module, node)
            elif isinstance(node, ast.Import):
                source = " ".join(alias.name for alias in node.names)
            else:
                continue
            if any(part.startswith("test_") for part in source.replace(" ", ".").split(".")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {source}")
    return found


def test_no_test_file_imports_another():
    found = imports_between_test_files()
    assert not found, "move what they share into tests/_helpers.py:\n" + "\n".join(found)


def test_functions_stay_short():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines of code:\n" + "\n".join(found)


def _lines_of_code(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of each line of code, stripped; blank lines, comments,
    lines of brackets alone and import statements left out (a run of imports is no
    code to share, and a line of brackets ends a call whatever the call)."""
    source = path.read_text()
    imports = {
        number
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for number in range(node.lineno, node.end_lineno + 1)
    }
    lines = []
    for number, line in enumerate(source.splitlines(), start=1):
        text = line.strip()
        if number not in imports and text and not text.startswith("#") and text.strip("()[]{},:"):
            lines.append((number, text))
    return lines


def repeated_blocks(run: int = REPEATED_LINES) -> list[str]:
    """`place ~ place` for each block of `run` or more lines of code that stands in
    two places of `benchmarks/`, or in `benchmarks/` and `eqxpar/` (each place a
    file and its first line; a longer block once, at its start)."""
    files = {
        p.relative_to(ROOT).as_posix(): _lines_of_code(p)
        for tree in ("benchmarks", "eqxpar")
        for p in sorted((ROOT / tree).rglob("*.py"))
    }
    places = defaultdict(list)  # `run` lines of code -> (file, index of its first)
    for name, lines in files.items():
        for i in range(len(lines) - run + 1):
            places[tuple(text for _, text in lines[i : i + run])].append((name, i))
    repeated = {
        tuple(where)
        for where in places.values()
        if len(where) > 1 and any(name.startswith("benchmarks/") for name, _ in where)
    }
    found = []
    for where in sorted(repeated):
        if tuple((name, i - 1) for name, i in where) in repeated:
            continue  # the block runs on from a line before: reported there
        found.append(" ~ ".join(f"{name}:{files[name][i][0]}" for name, i in where))
    return found


def test_benchmarks_repeat_no_code():
    found = repeated_blocks()
    assert not found, (
        f"blocks of {REPEATED_LINES}+ lines of code written twice (import the shared code instead):\n"
        + "\n".join(found)
    )


# The checks themselves, on code written to break each rule.


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A scratch tree with eqxpar/a/_m.py, eqxpar/b/_n.py and eqxpar/_top.py, read in
    place of the repository's."""
    for name in ("eqxpar/__init__.py", "eqxpar/a/__init__.py", "eqxpar/b/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")

    def write(files: dict[str, str]):
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        modules = {_module_name_in(tmp_path, p): p for p in sorted(tmp_path.rglob("*.py"))}
        monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
        monkeypatch.setattr(sys.modules[__name__], "MODULES", modules)

    return write


def _module_name_in(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_checks_catch_what_they_forbid(scratch):
    scratch(
        {
            "eqxpar/a/_m.py": "def _helper(): pass\ndef shared(): pass\n",
            "eqxpar/b/_n.py": (
                "from ..a._m import _helper, shared\nfrom ..a import _m\ndef f():\n    return _m._helper()\n"
            ),
            "eqxpar/_top.py": "def g():\n    from .b._n import f\n",
            "eqxpar/b/_o.py": "from .._top import g\n",
            "eqxpar/b/_p.py": "from ._n import f\n" + "def long():\n" + "    x = 1\n" * 81,
        }
    )
    # The public name and a package importing its own module pass; the rest do not.
    assert sorted(line.split(" ", 1)[1] for line in private_imports_across_packages()) == [
        "imports _helper from eqxpar.a._m",
        "imports the private module eqxpar.a._m",
        "uses eqxpar.a._m._helper",
    ]
    assert import_cycles() == []
    scratch({"eqxpar/_top.py": "def g():\n    from .b._o import x\n"})
    assert import_cycles() == [["eqxpar._top", "eqxpar.b._o"]]
    assert [line.split(" ", 1)[1] for line in long_functions()] == ["long has 82 lines"]
    assert core_imports_of_models() == []
    scratch({"eqxpar/inspect/_x.py": "def f(x):\n    return x.size * x.dtype.itemsize\n"})
    assert [line.split(" ", 1)[1] for line in byte_sizes_outside_the_helper()] == ["reads .itemsize"]
    scratch(
        {
            "eqxpar/_advise/_y.py": "def f(least):\n    return [p for p in least.parts if p.startswith('MoE')]\n"
        }
    )
    assert [line.split(" ", 1)[1] for line in cost_labels_read_by_the_advisor()] == ["reads .parts"]
    scratch({"eqxpar/_advise/_z.py": "def _dot_flops(jaxpr):\n    return 0\n"})
    assert [line.split(" ", 1)[1] for line in flop_counters_outside_their_module()] == ["defines _dot_flops"]
    plan = "class Plan:\n    mesh: int\n    schedule: str\n"
    scratch(
        {
            "eqxpar/_plan.py": plan,
            "eqxpar/_z.py": "def f(plan, s):\n    return plan.schedule, plan.mesh, s.plan.schedule\n",
        }
    )
    assert plan_reads() == {"eqxpar/_z.py": 2}
    helper = (
        "from ._plan import Plan\n"
        "def make_step(plan): pass\n"
        "def _helper(x, plan: Plan | None): pass\n"
        "def _named(plan): pass\n"
        "def _fine(resolved: ResolvedPlan, plan_name: str): pass\n"
        "class S:\n    def f(self, p: 'Plan'): pass\n"
    )
    scratch({"eqxpar/_train/_step.py": helper})
    assert [line.split(" ", 1)[1] for line in plan_takers_below_builders()] == ["_helper", "_named", "S.f"]
    assert [line.split(" ", 1)[1] for line in plan_takers()] == ["make_step", "_helper", "_named", "S.f", "f"]
    scratch(
        {
            "eqxpar/_w.py": "class W:\n    def __init__(self, "
            + ", ".join(f"a{i}" for i in range(11))
            + "): pass\n"
        }
    )
    assert constructor_widths() == {"eqxpar/_w.py:W": 11}
    scratch(
        {"eqxpar/_step.py": "def warn():\n    from .models import GPT\n", "eqxpar/models/__init__.py": ""}
    )
    assert [line.split(" ", 1)[1] for line in core_imports_of_models()] == ["imports eqxpar.models.GPT"]
    scratch({"eqxpar/_sharding.py": "from .nn._stack import in_plan_order\n", "eqxpar/nn/__init__.py": ""})
    assert [line.split(" ", 1)[1] for line in core_imports_of_models()] == [
        "imports eqxpar.nn._stack.in_plan_order",
        "imports eqxpar.models.GPT",
    ]
    (ROOT / "tests").mkdir()
    scratch({"tests/__init__.py": "", "tests/_helpers.py": "", "tests/test_a.py": "x = 1\n"})
    scratch({"tests/test_b.py": "from ._helpers import x\nfrom .test_a import x\n"})
    assert [line.split(" ", 1)[1] for line in imports_between_test_files()] == ["imports tests.test_a"]
    # Seven lines of the library's written again in a benchmark (comments and blank
    # lines between them change nothing), and five lines of one benchmark in
    # another, which is short of a block.
    seven = "".join(f"    y{i} = f(x, {i})\n" for i in range(7))
    five = seven[: seven.index("    y5")]
    scratch(
        {
            "eqxpar/_lib.py": "import os\n\ndef f(x, i):\n    return x + i\n\ndef g(x):\n" + seven,
            "benchmarks/__init__.py": "",
            "benchmarks/a.py": "import os\n\ndef h(x):\n" + seven.replace("y3", "# y3\n\n    y3"),
            "benchmarks/b.py": "def k(x):\n" + five + "    return y4\n",
            "benchmarks/c.py": "import json\n\ndef m(x):\n" + five + "    return 0\n",
        }
    )
    assert repeated_blocks() == ["benchmarks/a.py:4 ~ eqxpar/_lib.py:7"]


def test_cases_skipped_at_one_end_of_the_jax_range_run_at_the_other():
    # .ci/run runs the whole suite on the oldest JAX and NEWEST_TESTS on the newest:
    # a file with cases skipped by jax/jaxlib version must be among NEWEST_TESTS, or
    # its newest-JAX cases never run in CI.
    import re

    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"NEWEST_TESTS :=(.*?)\n\S", makefile, re.S).group(1)
    gated = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("skipif"):
                if re.search(r"jax(lib)?\b[^\"']*\d|jaxlib|jax version", ast.unparse(node), re.I):
                    gated.append(f"tests/{path.name}")
    assert gated, "no version-gated skip found: the check reads nothing"
    missing = sorted({g for g in gated if g not in listed})
    assert not missing, f"{missing} skip cases by JAX version but are not in the Makefile's NEWEST_TESTS"
