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


def _target(package_parts: tuple, module: str, name: str = None) -> str:
    """The node that ``from <package_parts>.<module> import <name>`` (module may be '') loads."""
    parts = package_parts + tuple(p for p in module.split(".") if p)
    if not parts:  # the package itself: a submodule of it by that name, else its __init__
        if name and ((PACKAGE / f"{name}.py").is_file() or (PACKAGE / name).is_dir()):
            return name
        return "__init__"
    return parts[0]


def imports_of(path: Path) -> set:
    """The package's nodes a file imports, at module level and inside functions alike."""
    package_parts = path.relative_to(PACKAGE).parent.parts  # () for a top-level module
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "cuflash" or alias.name.startswith("cuflash."):
                    found.add(_target((), alias.name.partition(".")[2]))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[:len(package_parts) - (node.level - 1)]
                module = node.module or ""
            elif node.module == "cuflash" or (node.module or "").startswith("cuflash."):
                base, module = (), node.module.partition(".")[2]
            else:
                continue
            for alias in node.names:
                found.add(_target(base, module, alias.name))
    return found


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


def test_no_import_cycle():
    graph = import_graph()
    state: dict = {}  # node -> "open" while on the path, "done" after

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


MAX_MODULE_LINES = 600


def test_no_library_module_over_600_lines():
    """Every module of the library (the benchmark, cuflash/bench, is a tool beside it)."""
    library = [p for p in sorted(PACKAGE.rglob("*.py")) if node_of(p) != "bench"]
    long = {str(p.relative_to(PACKAGE)): n for p in library if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
