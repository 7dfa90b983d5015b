"""poly_exp2 (kernels/common.cuh), the FMA-pipe exponential of the Hopper forward, re-run in
float32 NumPy with the coefficients read from the kernel source: its error bound and its
special values. The GPU side is tests/test_forward_sm90_gpu.py::test_exp_emulation."""

import re

import numpy as np
import pytest

from cuflash import _loader


def _coefficients():
    """{degree: [c1, c2, ...]} as written in poly_exp2's two branches (Horner, innermost first)."""
    src = _loader.read_source("common.cuh")
    body = src[src.index("__device__ __forceinline__ float poly_exp2"):]
    body = body[:body.index("\n}\n")]
    branches = re.findall(r"p = (fmaf\(.*?);", body, flags=re.S)
    out = {}
    for branch in branches:
        literals = [float(x) for x in re.findall(r"(-?\d+\.\d*(?:e-?\d+)?)f", branch)]
        assert literals[-1] == 1.0  # p(0) = 1 exactly
        out[len(literals) - 1] = literals[-2::-1]  # c1, c2, ... (Horner lists the top degree first)
    return out


def poly_exp2(x, coefficients):
    """The kernel's steps, in float32."""
    f32 = np.float32
    x = np.asarray(x, f32)
    xc = np.maximum(x, f32(-127))  # fmaxf: NaN gives the other operand
    xc = np.where(np.isnan(x), f32(-127), xc)
    shift = f32(12582912.0)
    j = (xc + shift).astype(f32)
    f = (xc - (j - shift)).astype(f32)
    p = f32(coefficients[-1])
    for c in coefficients[-2::-1]:
        p = (p * f + f32(c)).astype(f32)
    p = (p * f + f32(1)).astype(f32)
    bits = (p.view(np.int32).astype(np.int64) + (j.view(np.int32).astype(np.int64) << 23)) & 0xFFFFFFFF
    y = bits.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, y)


@pytest.mark.parametrize("degree, bound", ((3, 1.1e-4), (4, 3e-6)))
def test_relative_error(degree, bound):
    coefficients = _coefficients()[degree]
    x = np.linspace(-126, 0, 2_000_001, dtype=np.float32)
    got = poly_exp2(x, coefficients).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.abs(got / want - 1).max() < bound


@pytest.mark.parametrize("degree", (3, 4))
def test_special_values(degree):
    coefficients = _coefficients()[degree]
    x = np.array([0, -1, -0.5, -126, -127, -200, -np.inf, np.nan], np.float32)
    got = poly_exp2(x, coefficients)
    assert got[0] == 1 and got[1] == 0.5  # exact at integers
    assert abs(got[2] / np.exp2(-0.5) - 1) < 1.1e-4
    assert got[4] == 0 and got[5] == 0 and got[6] == 0  # masked scores (-inf) give exactly 0
    assert 0 < got[3] < 2e-38
    assert np.isnan(got[7])
    x = np.linspace(-127, -126, 1001, dtype=np.float32)  # between: tiny, never negative
    assert (poly_exp2(x, coefficients) >= 0).all()


def test_both_degrees_written():
    assert sorted(_coefficients()) == [3, 4]
