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
