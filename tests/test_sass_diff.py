"""scripts/sass_diff.py without a GPU: NVRTC's cubins, cuobjdump's listing and the comparison.

The comparison is what lets a kernel edit be shown harmless on a machine without a GPU (the
variants it must not touch compile to the same machine code), so it must tell an edit apart.
"""

import shutil
from pathlib import Path

import pytest

from conftest import load_script
from cuflash import _config, _loader

pytestmark = pytest.mark.nvrtc  # builds kernels: left out by -m "not nvrtc"

_KERNELS = Path(__file__).resolve().parents[1] / "kernels"


@pytest.fixture(scope="module")
def sass_diff():
    return load_script("sass_diff")


def _f32_forwards(n=2):
    return [v for v in _config.variants_for("sm_80") if v.source == "flash_fwd_f32.cu"][:n]


def _same_on_both_sides(variants):
    """compare()'s pairs for variants built from one expression on both sides."""
    return [(v.source, v.name_expression, v.name_expression) for v in variants]


def test_normalized_drops_reuse_hints_and_orders_commuting_sources(sass_diff):
    assert sass_diff.normalized("FADD R132, R139, -R136.reuse ;") == "FADD R132, -R136, R139 ;"
    assert sass_diff.normalized("@!P0 FMUL.FTZ R1, R5, -R2 ;") == "@!P0 FMUL.FTZ R1, -R2, R5 ;"
    # Not commutative, or three sources: kept as they are but for the hint.
    assert sass_diff.normalized("FFMA R1, R3.reuse, R2, R4 ;") == "FFMA R1, R3, R2, R4 ;"
    assert sass_diff.normalized("ISETP.GE.AND P0, PT, R3, R2, PT ;") == "ISETP.GE.AND P0, PT, R3, R2, PT ;"


def test_whole_elf_restores_the_program_headers(sass_diff):
    variant = _f32_forwards(1)[0]
    cubin, lowered = sass_diff.compile_cubin(str(_KERNELS), variant.source, [variant.name_expression], "sm_80")
    assert cubin is not None, lowered
    import struct

    phoff = struct.unpack_from("<Q", cubin, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", cubin, 0x36)
    assert cubin[:4] == b"\x7fELF" and len(cubin) >= phoff + phentsize * phnum
    assert _loader._whole_elf(cubin) == cubin  # already whole: nothing added


def test_same_sources_compare_identical_and_an_edit_differs(sass_diff, tmp_path):
    variants = {"sm_80": _same_on_both_sides(_f32_forwards())}
    same = sass_diff.compare(_KERNELS, _KERNELS, variants, jobs=1)
    assert [status for *_, status, _ in same] == ["identical"] * 2
    assert all(int(detail[0].split()[0]) > 100 for *_, detail in same)  # real functions were read

    edited = tmp_path / "kernels"
    shutil.copytree(_KERNELS, edited)
    source = edited / "flash_fwd_f32.cu"
    text = source.read_text()
    line = "const float scale_log2 = (float)p.scale_log2;"
    assert line in text
    source.write_text(text.replace(line, "const float scale_log2 = 0.5f * (float)p.scale_log2;"))
    changed = sass_diff.compare(_KERNELS, edited, variants, jobs=1)
    assert [status for *_, status, _ in changed] == ["differs"] * 2


def test_a_variant_that_does_not_build_is_reported(sass_diff, tmp_path):
    broken = tmp_path / "kernels"
    shutil.copytree(_KERNELS, broken)
    (broken / "flash_fwd_f32.cu").write_text("#error broken on purpose\n")
    rows = sass_diff.compare(_KERNELS, broken, {"sm_80": _same_on_both_sides(_f32_forwards(1))}, jobs=1)
    assert [status for *_, status, _ in rows] == ["head does not build"]


def _described(cls, source="k.cu", defaults=None, **fields):
    return {"cls": cls, "fields": fields, "defaults": defaults or {}, "source": source,
            "expr": f"{cls}<{', '.join(f'{k}={v}' for k, v in sorted(fields.items()))}>"}


def test_pairs_follow_fields_not_names(sass_diff):
    """A renamed key or expression pairs by its fields; a deleted switch pairs only where it
    was off (at its default), a new switch likewise; a variant with a new field that has no
    default, or a new class, has no pair."""
    base = [_described("Fwd", d=64, causal=False, snake=False, defaults={"snake": False}),
            _described("Fwd", d=64, causal=True, snake=True, defaults={"snake": False}),
            _described("Fwd", d=64, causal=True, snake=False, defaults={"snake": False}),
            _described("Bwd", d=64)]
    head = [_described("Fwd", d=64, causal=False), _described("Fwd", d=64, causal=True),
            _described("Bwd", d=64, rows=64), _described("Pre", d=64)]
    head[0]["expr"] = "renamed<64>"
    pairs = sass_diff.pair_variants(base, head)
    assert pairs == [("k.cu", base[0]["expr"], "renamed<64>"), ("k.cu", base[2]["expr"], head[1]["expr"]),
                     ("k.cu", None, head[2]["expr"]), ("k.cu", None, head[3]["expr"])]
    switched = [_described("Bwd", d=64, varlen=False, defaults={"varlen": False}),
                _described("Bwd", d=64, varlen=True, defaults={"varlen": False})]
    assert sass_diff.pair_variants(base, switched) == [("k.cu", base[3]["expr"], switched[0]["expr"]),
                                                       ("k.cu", None, switched[1]["expr"])]


def test_describe_tree_lists_this_checkouts_variants(sass_diff):
    described = sass_diff.describe_tree(Path(__file__).resolve().parents[1], ["sm_80"])
    assert [d["expr"] for d in described["variants"]["sm_80"]] == [v.name_expression for v in _config.variants_for("sm_80")]
    assert described["options"] == list(_loader.base_options())


def test_build_options_point_at_the_side_built(sass_diff):
    options = sass_diff.build_options(["-std=c++17", "-I/a/kernels", "-DCUFLASH_SRC_HASH=abc", "-DX=1"], "/b/kernels")
    assert options == ["-std=c++17", "-I/b/kernels", "-DCUFLASH_SRC_HASH=0", "-DX=1"]
