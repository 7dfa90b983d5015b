"""How the configuration modules depend on each other: the fixed numbers and the tile tables are
leaves, so the argument checks, the broadcasting rule and the mask tile lists can read them
without loading the variants or the choices, and no import cycle can form through them."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cuflash"


def module_level_imports(name: str) -> list:
    """The modules a file imports at load time (imports inside functions left out)."""
    tree = ast.parse((PACKAGE / name).read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [("." * node.level) + (node.module or "") + ":" + alias.name for alias in node.names]
    return found


@pytest.mark.parametrize("name", ["_constants.py", "_tiles.py"])
def test_fixed_numbers_and_tile_tables_import_nothing(name):
    assert module_level_imports(name) == []


def test_variants_read_only_the_fixed_numbers_and_the_block_layouts():
    imports = module_level_imports("_variants.py")
    assert [i for i in imports if i.startswith(".")] == [".:_constants", ".:_params", ".:_tma"], imports


@pytest.mark.parametrize("name, within", [("_params.py", ["._constants:MAX_LEAD_DIMS"]), ("_tma.py", [])])
def test_the_block_layouts_read_only_the_fixed_numbers(name, within):
    """The parameter blocks' and the tensor maps' layouts, which the variants pass to the kernels
    as defines, load nothing of cuflash but the fixed numbers."""
    assert [i for i in module_level_imports(name) if i.startswith(".")] == within


# ---- the import graph of the package -----------------------------------------------------------
#
# A call runs front end -> spine -> plans -> driver and kernels; every import points down this
# list or stays within its layer, and none closes a cycle. A subpackage (bench, masks,
# reference) is one node: its modules share its layer.
LAYERS = (
    ("fixed numbers, views and requirements", {"_constants", "_tiles", "_params", "_tma", "_views", "_requirements"}),
    ("kernel variants, broadcasting, masks, the reference", {"_variants", "_broadcast", "masks", "reference"}),
    ("checks, choices, compilation, arrays, problems", {"_checks", "_config", "_loader", "_arrays", "_merge",
                                                        "_problem", "_validate"}),
    ("driver and plan cache", {"_driver", "_cache"}),
    ("plans", {"_launch", "_forward", "_backward", "_decode"}),
    ("spine", {"_spine"}),
    ("front ends", {"__init__", "_api", "_entry_points", "torch", "_torch_launch", "jax", "_jax_calls"}),
    ("integrations and tools", {"transformers", "distributed", "bench", "compile_check"}),
)
LAYER_OF = {node: rank for rank, (_, nodes) in enumerate(LAYERS) for node in nodes}


def node_of(path: Path) -> str:
    """The graph node of a file of the package: a top-level module's name, a subpackage's name."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def imported_modules(path: Path) -> set:
    """The package's modules a file imports, at module level and inside functions alike, each as
    its path of names inside the package: ("_config",), ("bench", "common"); () is the package's
    __init__. A name imported from a package is its submodule when one has that name."""
    package_parts = path.relative_to(PACKAGE).parent.parts  # () for a top-level module
    found = set()

    def add(parts: tuple, name: str = None) -> None:
        if name and ((PACKAGE.joinpath(*parts) / f"{name}.py").is_file() or PACKAGE.joinpath(*parts, name).is_dir()):
            parts += (name,)
        found.add(parts)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "cuflash" or alias.name.startswith("cuflash."):
                    add(tuple(alias.name.split(".")[1:]))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[:len(package_parts) - (node.level - 1)]
                module = node.module or ""
            elif node.module == "cuflash" or (node.module or "").startswith("cuflash."):
                base, module = (), node.module.partition(".")[2]
            else:
                continue
            parts = base + tuple(p for p in module.split(".") if p)
            for alias in node.names:
                add(parts, alias.name)
    return found


def imports_of(path: Path) -> set:
    """The package's nodes a file imports (a subpackage's module counts as the subpackage)."""
    return {parts[0] if parts else "__init__" for parts in imported_modules(path)}


def import_graph() -> dict:
    graph: dict = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        node = node_of(path)
        graph.setdefault(node, set()).update(imports_of(path) - {node})
    return graph


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The parser the layering rests on: a relative import inside a function is an edge, a
    name imported from the package itself is the submodule of that name."""
    graph = import_graph()
    assert "_loader" in graph["bench"]  # `from cuflash import _loader` inside a function
    assert "torch" in graph["distributed"]  # `from . import torch as cuflash_torch`
    assert "_constants" in graph["masks"]  # `from .._constants import ...` in a subpackage module


def test_every_module_has_a_layer():
    unplaced = sorted(set(import_graph()) - set(LAYER_OF))
    assert not unplaced, f"modules without a layer (add them to LAYERS): {unplaced}"


def test_imports_point_down_the_layers():
    upward = sorted(f"{a} ({LAYERS[LAYER_OF[a]][0]}) imports {b} ({LAYERS[LAYER_OF[b]][0]})"
                    for a, targets in import_graph().items() for b in targets if LAYER_OF[b] > LAYER_OF[a])
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("front_end, own_launches", [("_api", None), ("torch", "_torch_launch"),
                                                     ("_torch_launch", None), ("jax", "_jax_calls"),
                                                     ("_jax_calls", None)])
def test_front_ends_reach_the_layers_below_through_the_spine(front_end, own_launches):
    """A front end turns arrays into problems and owns its outputs: of the package it takes the
    spine, and beside it only what describes arrays in its own terms (the broadcasting rule's
    shapes, CuPy views of torch tensors, the masks, the named results), the one-mode entry
    points' shared argument checks, the missing-dependency messages and its own launches (the
    torch adapter's on torch's stream, the JAX adapter's XLA calls), which import no front end."""
    allowed = {"_spine", "_broadcast", "_views", "masks", "_arrays", "_entry_points", "_requirements", front_end,
               own_launches}
    assert import_graph()[front_end] <= allowed, sorted(import_graph()[front_end] - allowed)


def find_cycle(graph: dict) -> list:
    """A cycle of graph (node -> the nodes it imports) as [a, b, ..., a], or [] when none."""
    state: dict = {}  # node -> "open" while on the path, "done" after

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target, path + [target])):
                return cycle
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return []


def test_the_cycle_search_finds_a_cycle_through_several_modules():
    assert find_cycle({"io": {"counts"}, "speed": {"io", "counts"}, "counts": set()}) == []
    assert find_cycle({"cli": {"io"}, "io": {"speed"}, "speed": {"common", "io"}}) == ["io", "speed", "io"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


# ---- the benchmark's modules ---------------------------------------------------------------

BENCH = PACKAGE / "bench"


def bench_graph() -> dict:
    """cuflash/bench's modules and the modules of it each one imports (module and function level)."""
    return {path.stem: {parts[1] if len(parts) > 1 else "__init__" for parts in imported_modules(path)
                        if parts[:1] == ("bench",)} - {path.stem}
            for path in sorted(BENCH.glob("*.py"))}


def test_the_bench_graph_sees_function_level_and_relative_imports():
    graph = bench_graph()
    assert "speed" in graph["decode"]  # `from .speed import max_abs_diff` inside a function
    assert {"common", "speed", "io"} <= graph["cli"]  # `from . import common, ..., speed, varlen`
    assert "cli" in graph["__main__"]  # `from .cli import main`


def test_no_import_cycle_inside_the_benchmark():
    """The FLOP and byte counts (counts) and the timed backends (backends) lie below both the io
    and the speed table, so neither table module imports the other."""
    cycle = find_cycle(bench_graph())
    assert not cycle, "import cycle in cuflash/bench: " + " -> ".join(cycle)


MAX_MODULE_LINES = 600


def test_no_module_over_600_lines():
    """Every module of the package, the benchmark's (cuflash/bench) included."""
    long = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
