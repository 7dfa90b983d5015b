"""Helpers for GPU tests: random inputs in each dtype, and the flash-attention error rule."""

import contextlib

import numpy as np

from cuflash import reference as ref

DTYPES = ("float16", "bfloat16", "float32")


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def random_array(rng, shape, dtype):
    """Normal values rounded to dtype, as a host array of that dtype."""
    return rng.standard_normal(shape, dtype=np.float32).astype(np_dtype(dtype))


def to_device(a):
    import cupy

    return cupy.asarray(a)


def to_host64(x):
    return np.asarray(x.get()).astype(np.float64)


class OnHost:
    """A torch tensor or a JAX array where the helpers here expect a CuPy array (``.get()``)."""

    def __init__(self, x):
        self.x = x

    def get(self):
        if hasattr(self.x, "detach"):  # torch
            return self.x.detach().float().cpu().numpy()
        return np.asarray(self.x.astype(np.float32))


def max_err(a, b):
    return float(np.max(np.abs(a - b), initial=0.0))


def check_forward(out, q, k, v, *, causal, scale=None, dtype, mask=None):
    """The kernel's o against float64 within 2x plain attention in dtype; l and m to fp32.

    q, k, v: host arrays (in dtype) the kernel saw. out: the AttentionOutput from cuflash, or
    (o,) alone from an API that returns no statistics.
    mask: the element mask (True = allowed) the kernel applied besides causal, if any.
    """
    o, *stats = (to_host64(x) for x in out)
    exact = ref.standard_attention(q, k, v, causal=causal, scale=scale, mask=mask)
    assert o.shape == exact.o.shape
    assert not np.isnan(o).any(), "NaN in o (unwritten output or bad masking)"
    err = max_err(o, exact.o)
    if dtype == "float32":
        rel = np.linalg.norm(o - exact.o) / max(np.linalg.norm(exact.o), 1e-30)
        assert rel < 1e-5, f"float32 relative error {rel:.3g}"
    else:
        plain = ref.lowp_attention(q, k, v, dtype=dtype, causal=causal, scale=scale, mask=mask)
        bound = 2 * max_err(plain.o, exact.o) + 1e-6
        assert err <= bound, f"max |o - ref| = {err:.3g} > 2 x plain {dtype} error ({bound:.3g})"
    empty = np.isneginf(exact.m)
    np.testing.assert_array_equal(o[empty], 0.0)
    if not stats:
        return err
    l, m = stats
    assert l.shape == exact.l.shape and m.shape == exact.m.shape
    assert not np.isnan(l).any() and not np.isnan(m).any(), "NaN in l or m"
    np.testing.assert_array_equal(np.isneginf(m), empty)
    np.testing.assert_array_equal(l[empty], 0.0)
    np.testing.assert_allclose(m[~empty], exact.m[~empty], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(l[~empty], exact.l[~empty], rtol=1e-4)
    return err


def check_backward(grads, do, q, k, v, *, causal, scale=None, dtype, mask=None):
    """dq, dk, dv against float64 within 3x plain attention's gradients in dtype (float32:
    2e-5 of the gradient's scale). mask as in check_forward. Returns the kernel's max errors."""
    got = [to_host64(x) for x in grads]
    options = dict(causal=causal, scale=scale, mask=mask)
    exact = ref.standard_attention_backward(do, q, k, v, **options)
    plain = None if dtype == "float32" else ref.lowp_attention_backward(do, q, k, v, dtype=dtype, **options)
    return compare_gradients(got, exact, plain, dtype)


def compare_gradients(got, exact, plain, dtype, rows=(None, None, None)):
    """The gradient error rule on host float64 dq, dk, dv: within 3x ``plain`` (the same
    gradients of plain attention in dtype) against ``exact`` (float64), or for float32 2e-5 of
    the gradient's scale. ``rows``: per gradient, the rows of axis 1 compared (None: all).
    Returns the max errors."""
    errors = []
    # float32: elementwise, against the gradient's own largest entry, or a tenth of the largest
    # entry of all three. Some gradients are exactly 0 (one key per row: softmax is constant)
    # and what remains there is float32 cancellation in dP - D, relative to dV's scale.
    floor = 0.1 * max(np.max(np.abs(e), initial=0.0) for e in exact)
    for i, (name, g, e, r) in enumerate(zip(("dq", "dk", "dv"), got, exact, rows)):
        assert g.shape == e.shape, f"{name} shape {g.shape} != {e.shape}"
        p = None if plain is None else plain[i]
        if r is not None:
            g, e, p = g[:, r], e[:, r], None if p is None else p[:, r]
        assert not np.isnan(g).any(), f"NaN in {name}"
        err = max_err(g, e)
        if dtype == "float32":
            rel = err / max(np.max(np.abs(e), initial=0.0), floor, 1e-30)
            assert rel < 2e-5, f"{name}: float32 error {err:.3g}, {rel:.3g} of the gradient's scale"
        else:
            bound = 3 * max_err(p, e) + 1e-6
            assert err <= bound, f"{name}: max error {err:.3g} > 3 x plain {dtype} error ({bound:.3g})"
        errors.append(err)
    return errors


@contextlib.contextmanager
def launched_variants():
    """Records the variant of every kernel launched inside the block, in launch order (every
    launch goes through a bound cuflash._driver.Kernel)."""
    from cuflash import _driver

    launched = []
    launch = _driver.Kernel.launch

    def recording(self, drv, stream):
        launched.append(self.variant)
        return launch(self, drv, stream)

    _driver.Kernel.launch = recording
    try:
        yield launched
    finally:
        _driver.Kernel.launch = launch


@contextlib.contextmanager
def head_group_forced(form):
    """Inside the block the wgmma key pass walks 'all' query heads of a k/v group a CTA, or
    'half' of them (then dK and dV are still summed over the two halves by grad_reduce.cu),
    whatever the SM count says; None keeps the rule (_config.backward_head_group). Plans are
    rebuilt on the way in and out. Yields the head groups the plans chose."""
    from cuflash import _config

    rule = _config.backward_head_group
    chosen = []

    def forced(kv_group, num_batch, key_tiles, sm_count):
        group = rule(kv_group, num_batch, key_tiles, sm_count) if form is None else (
            kv_group if form == "all" else kv_group // 2)
        chosen.append(group)
        return group

    _config.backward_head_group = forced
    _config.bump_generation()
    try:
        yield chosen
    finally:
        _config.backward_head_group = rule
        _config.bump_generation()


@contextlib.contextmanager
def tma_refused():
    """Inside the block the copy engine 'cannot map' any input, as for inputs it really cannot
    take: the wgmma forward's and backward's launches fall back to their cp.async forms. Plans are rebuilt on the
    way in and out (their generation changes), so cached ones neither hide nor keep it."""
    from cuflash import _config, _tma

    encode = _tma.encode
    _tma.encode = lambda *args, **kwargs: None
    _config.bump_generation()
    try:
        yield
    finally:
        _tma.encode = encode
        _config.bump_generation()
