"""scripts/sass_loops.py without a GPU: the loops it finds in a cuobjdump listing, and (NVRTC)
in a real kernel's."""

import pytest

from conftest import load_script

LISTING = """
        Function : kern
        /*0000*/                   MOV R1, c[0x0][0x28] ;              /* 0x000 */
        /*0010*/                   S2R R0, SR_TID.X ;                  /* 0x000 */
        /*0020*/              @!P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;       /* 0x000 */
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ; /* 0x000 */
        /*0040*/                   MUFU.EX2 R3, R3 ;                   /* 0x000 */
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;     /* 0x000 */
        /*0060*/                   FADD R3, R3, R4 ;                   /* 0x000 */
        /*0070*/               @P1 BRA 0x30 ;                          /* 0x000 */
        /*0080*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R5 ; /* 0x000 */
        /*0090*/               @P2 BRA 0x20 ;                          /* 0x000 */
        /*00a0*/                   IADD3 R6, R6, 0x1, RZ ;             /* 0x000 */
        /*00b0*/               @P3 BRA 0xa0 ;                          /* 0x000 */
        /*00c0*/                   BRA 0xd0 ;                          /* 0x000 */
        /*00d0*/                   EXIT ;                              /* 0x000 */
"""


@pytest.fixture(scope="module")
def sass_loops():
    return load_script("sass_loops")


def test_loops_with_tensor_core_instructions_are_found_and_counted(sass_loops):
    functions = sass_loops.parse_functions(LISTING)
    assert list(functions) == ["kern"] and len(functions["kern"]) == 14
    loops = sass_loops.tensor_loops(functions["kern"])
    # 0x30-0x70 (inner) and 0x20-0x90 (outer); 0xa0-0xb0 has no matrix multiply; 0xc0 branches forward
    assert [(hex(l.start), hex(l.end), l.instructions, l.innermost) for l in loops] == [
        ("0x20", "0x90", 8, False), ("0x30", "0x70", 5, True)]
    assert loops[1].kinds == {"wgmma": 1, "wgmma wait": 1, "exp2": 1}
    assert loops[0].kinds == {"wgmma": 1, "wgmma wait": 1, "barrier": 1, "exp2": 1, "atomic / reduce": 1}
    text = sass_loops.format_loops("kern<1>", {"kern": loops})
    assert "loop 0x30-0x70, innermost: 5 instructions (1 wgmma, 1 wgmma wait, 1 exp2)" in text


def test_opcode_drops_the_predicate(sass_loops):
    assert sass_loops.opcode("@!P0 BAR.SYNC.DEFER_BLOCKING 0x0") == "BAR.SYNC.DEFER_BLOCKING"
    assert sass_loops.opcode("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ") == "HGMMA.64x64x16.F32.BF16"


@pytest.mark.nvrtc
def test_a_decode_kernel_has_its_tile_loop(sass_loops):
    from cuflash import _config

    variant = _config.decode_config("bfloat16", 128, 128, False, 4)
    expression, functions = sass_loops.variant_loops((variant.source, variant.name_expression, "sm_90a",
                                                      sass_loops.sass_diff.find_cuobjdump()))
    assert expression == variant.name_expression
    loops = [loop for body in functions.values() for loop in body]
    inner = [loop for loop in loops if loop.innermost]
    # the key-tile loop: S = Q K^T and O += P V on mma.sync, 64 keys over 4 warps, head dim 128
    assert inner and all(loop.kinds.get("mma", 0) >= 16 and loop.kinds.get("exp2", 0) >= 4 for loop in inner)
