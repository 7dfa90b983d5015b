"""Hypothesis strategies shared by the CPU and GPU fuzz tests: leading dims with broadcast and
grouped heads, strided layouts, block masks and windows, and one settings profile.

The settings are derandomized (the examples derive from the test's source, not a clock), keep
no example database, and put no deadline on an example: a first call may compile a kernel.
"""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from cuflash import masks


def fuzz_settings(max_examples):
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large],
    )


class LeadDims(NamedTuple):
    q: tuple  # q's leading dims
    kv: tuple  # k's and v's leading dims


@st.composite
def lead_dims(draw, max_batch=3, max_kv_heads=3, max_group=3):
    """(batch, heads) leading dims of q and k/v that cuflash accepts.

    Covers plain heads, grouped heads (Hq = group x Hk), multi-query (Hk = 1), k/v broadcast
    over the batch, q broadcast over the batch, and k/v without a batch dim.
    """
    batch = draw(st.integers(1, max_batch))
    kv_heads = draw(st.integers(1, max_kv_heads))
    group = draw(st.integers(1, max_group))
    q = (1 if draw(st.booleans()) else batch, kv_heads * group)
    kv = (1 if draw(st.booleans()) else batch, kv_heads)
    if draw(st.booleans()):
        kv = kv[1:]  # k/v (Hk, N, d): the batch dim is missing
    return LeadDims(q, kv)


LAYOUTS = ("contiguous", "bnhd", "slice")


def strided_views(host, layout, to_device):
    """The same strided view of a host buffer and of its device copy.

    contiguous: the buffer itself. bnhd: the buffer is (..., N, H, d), seen as (..., H, N, d).
    slice: rows 3 .. N-2 of a buffer with 5 extra rows. ``host`` is the buffer in the
    (bnhd: transposed) shape; returns (host view, device view).
    """
    if layout == "bnhd":
        view = lambda x: x.swapaxes(-2, -3)  # noqa: E731
    elif layout == "slice":
        view = lambda x: x[..., 3:x.shape[-2] - 2, :]  # noqa: E731
    else:
        view = lambda x: x  # noqa: E731
    return view(host), view(to_device(host))


def buffer_shape(shape, layout):
    """The buffer shape that :func:`strided_views` turns into a view of ``shape``."""
    shape = tuple(shape)
    if layout == "bnhd" and len(shape) >= 3:
        return shape[:-3] + (shape[-2], shape[-3], shape[-1])
    if layout == "slice":
        return shape[:-2] + (shape[-2] + 5, shape[-1])
    return shape


def layout_for(draw, shape):
    """A layout that applies to ``shape`` (bnhd needs a head dim)."""
    return draw(st.sampled_from(LAYOUTS if len(shape) >= 3 else LAYOUTS[::2]))


@st.composite
def sparsity(draw, nq, nk, rng, *, block_mask=True, window=True):
    """Keyword arguments {block_mask=..., window=...} (either may be absent) for nq x nk.

    The block mask is random with a drawn density and block size (square or not, not a tile
    size); the window's sides are -1 (unbounded) or 0 .. nk.
    """
    kwargs = {}
    if block_mask and draw(st.booleans()):
        bq = draw(st.sampled_from((16, 32, 48, 64, 128)))
        bk = draw(st.sampled_from((bq, 16, 32, 64, 80)))
        density = draw(st.sampled_from((0.0, 0.3, 0.7, 1.0)))
        blocks = rng.random((-(-nq // bq), -(-nk // bk))) < density
        kwargs["block_mask"] = masks.BlockMask.from_dense(blocks, (bq, bk))
    if window and draw(st.booleans()):
        side = st.one_of(st.just(-1), st.integers(0, max(nk, 1)))
        kwargs["window"] = (draw(side), draw(side))
    return kwargs


def element_mask_of(nq, nk, kwargs):
    """The element mask (True = allowed) that sparsity() keyword arguments stand for, or None."""
    if not kwargs:
        return None
    from cuflash import reference as ref

    return ref.element_mask(nq, nk, block_mask=kwargs.get("block_mask"), window=kwargs.get("window"))


SEEDS = st.integers(0, 2**32 - 1)  # drawn as an int so that a failing example prints it


def lengths(max_length):
    """A sequence length in [0, max_length], 0 and 1 drawn often: the edge cases of every
    packed or cached layout."""
    return st.one_of(st.sampled_from((0, 1)), st.integers(0, max_length))


def head_dims(max_dim):
    """(d, dv): multiples of 8 up to max_dim, dv often equal to d."""
    dim = st.integers(1, max_dim // 8).map(lambda x: 8 * x)
    return dim.flatmap(lambda d: st.tuples(st.just(d), st.one_of(st.just(d), dim)))


def windows(max_side):
    """None or a (left, right) window, each side -1 (unbounded) or 0 .. max_side."""
    side = st.one_of(st.just(-1), st.integers(0, max_side))
    return st.one_of(st.none(), st.tuples(side, side))
