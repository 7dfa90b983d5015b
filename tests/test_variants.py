"""The kernel variants' one description: each dataclass's fields are its kernel's traits struct.

A variant's name expression passes its fields to the traits struct in their order; these tests
read the struct's template parameters from kernels/ and check that they are the fields, by name,
kind and order, so that a field added, dropped or moved on one side only fails here, on the CPU,
instead of compiling into a kernel that reads one switch as another.
"""

import re

import pytest

from cuflash import _config, _loader, _variants

_TEMPLATE_STRUCT = re.compile(r"template\s*<(?P<params>[^<>]*)>\s*struct\s+(?P<name>\w+)\s*\{")
_KINDS = {bool: "bool", int: "int", str: "typename"}


def _one_of_each_class():
    """{class: a variant the dispatcher lists}, for every variant class (sm_90a has them all)."""
    found = {}
    for variant in _config.variants_for("sm_90a"):
        found.setdefault(type(variant), variant)
    return found


def _cpp_traits_parameters(source: str, traits: str):
    """[(kind, name)] of the template parameters of struct ``traits`` in kernels/``source``."""
    structs = {m["name"]: m["params"] for m in _TEMPLATE_STRUCT.finditer(_loader.read_source(source))}
    assert traits in structs, f"no template struct {traits} in kernels/{source}"
    return [tuple(param.split()) for param in structs[traits].split(",")]


def test_every_variant_class_is_listed():
    classes = {cls for cls in vars(_variants).values()
               if isinstance(cls, type) and issubclass(cls, _variants._Launch) and cls is not _variants._Launch}
    assert set(_one_of_each_class()) == classes


@pytest.mark.parametrize("cls", sorted(_one_of_each_class(), key=lambda cls: cls.__name__), ids=lambda cls: cls.__name__)
def test_traits_struct_takes_the_fields_in_order(cls):
    variant = _one_of_each_class()[cls]
    arguments = variant.traits_arguments()
    expected = [(_KINDS[type(value)], name) for name, value in arguments]
    assert _cpp_traits_parameters(variant.source, variant.traits) == expected
    # a fixed layout's size goes last, after every field; a size that follows the call does not
    names = [name for name, _ in arguments]
    assert names[-1:] == (["smem_bytes"] if variant.fixed_smem is not None else names[-1:])
    assert "smem_bytes" not in names or variant.smem_bytes() == variant.fixed_smem > 0


@pytest.mark.parametrize("cls", sorted(_one_of_each_class(), key=lambda cls: cls.__name__), ids=lambda cls: cls.__name__)
def test_kernel_takes_its_traits_struct_alone(cls):
    variant = _one_of_each_class()[cls]
    source = _loader.read_source(variant.source)
    launch_bounds = r"(__launch_bounds__\([^()]*\)\s*)?"
    assert re.search(r"template <class K>\s*__global__ void\s+" + launch_bounds + variant.kernel + r"\(", source)
    assert variant.name_expression.startswith(f"cuflash::{variant.kernel}<cuflash::{variant.traits}<")


def test_name_expression_spells_each_field_under_its_name():
    variant = _config.forward_config("bfloat16", 128, 128, True, wgmma=True)
    expression = variant.name_expression
    assert "/*dtype*/ cuflash::bf16" in expression and "/*head_dim*/ 128" in expression
    assert "/*causal*/ true" in expression and "/*sparse*/ false" in expression
    assert expression.endswith(f"/*smem_bytes*/ {variant.smem_bytes()}>>")
    assert variant.key.startswith("fwd_sm90_bf16_d128_") and variant.key.endswith("_causal")
