"""CPU tests of cuflash.masks (BlockMask, patterns, sliding windows, the kernels' tile lists) and the
block-sparse reference (forward and backward)."""

import doctest
import gc
import itertools
import struct
import zlib

import numpy as np
import pytest

from cuflash import masks as M
from cuflash import reference as ref

RTOL, ATOL = 1e-10, 1e-12


@pytest.fixture(autouse=True)
def no_float_warnings():
    """Any divide-by-zero, overflow or invalid op (NaN) is a test failure; underflow is fine."""
    with np.errstate(divide="raise", over="raise", invalid="raise", under="ignore"):
        yield


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# --------------------------------------------------------------------------
# Patterns and their literal definitions
# --------------------------------------------------------------------------


def _is_power_of_two(x):
    return x > 0 and bin(x).count("1") == 1


# name -> (factory(n, block_size), brute-force rule(i, j) or None, grid sizes to try)
PATTERNS = {
    "butterfly": (lambda n, bs: M.butterfly(n, block_size=bs), lambda i, j: i == j or _is_power_of_two(i ^ j), (1, 2, 8, 16)),
    "fixed": (lambda n, bs: M.fixed(n, 3, 1, block_size=bs), lambda i, j: i // 3 == j // 3 or j % 3 >= 2, (1, 7, 8, 10)),
    "fixed_c2": (lambda n, bs: M.fixed(n, 4, 2, block_size=bs), lambda i, j: i // 4 == j // 4 or j % 4 >= 2, (5, 8, 9)),
    "strided": (
        lambda n, bs: M.strided(n, 3, block_size=bs),
        lambda i, j: 0 <= i - j <= 3 or (i - j) % 3 == 0,
        (1, 7, 8, 12),
    ),
    "local": (lambda n, bs: M.local(n, 2, block_size=bs), lambda i, j: abs(i - j) <= 2, (1, 6, 8)),
    "causal": (lambda n, bs: M.causal(n, block_size=bs), lambda i, j: j <= i, (1, 5, 8)),
    "global": (lambda n, bs: M.global_tokens(n, 2, block_size=bs), lambda i, j: i < 2 or j < 2, (1, 3, 8)),
    "random": (lambda n, bs: M.random(n, 0.3, seed=7, block_size=bs), None, (1, 8, 13)),
    "dense": (lambda n, bs: M.dense(n, block_size=bs), lambda i, j: True, (1, 4, 8)),
    "bigbird": (
        lambda n, bs: M.global_tokens(n, 1, block_size=bs) | M.local(n, 1, block_size=bs) | M.random(n, 0.2, 3, block_size=bs),
        None,
        (8,),
    ),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_definition_shape_density_repr(name):
    factory, rule, sizes = PATTERNS[name]
    for n in sizes:
        bm = factory(n, (16, 32))
        assert bm.shape == (n, n) and bm.batch_shape == ()
        assert bm.block_size == (16, 32)
        blocks = bm.to_dense()
        assert blocks.dtype == np.bool_ and blocks.shape == (n, n)
        if rule is not None:
            want = np.array([[rule(i, j) for j in range(n)] for i in range(n)], dtype=bool)
            np.testing.assert_array_equal(blocks, want, err_msg=f"{name} n={n}")
        assert bm.nnz == blocks.sum()
        assert bm.density == pytest.approx(blocks.sum() / blocks.size, abs=0)
        text = repr(bm)
        assert "(16, 32)" in text and f"{bm.density:.4f}" in text and str(bm.shape) in text
        lines = bm.to_text().split("\n")
        assert len(lines) == n and all(len(line) == n for line in lines)
        assert set("".join(lines)) <= {"█", "·"}
    assert factory(8, 128).block_size == (128, 128)


def test_pattern_default_block_size_and_docstring_pictures():
    assert M.dense(2).block_size == (128, 128)
    assert M.butterfly(4).block_size == (128, 128)
    result = doctest.testmod(M, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted >= 8  # one 8x8 picture per pattern
    for fn in (M.butterfly, M.fixed, M.strided, M.local, M.causal, M.global_tokens, M.random, M.dense):
        picture = [line.strip() for line in fn.__doc__.splitlines() if set(line.strip()) <= {"#", "."} and line.strip()]
        assert len(picture) == 8 and all(len(line) == 8 for line in picture), fn.__name__


def test_butterfly_density_and_power_of_two():
    for n in (2, 4, 8, 32, 64):
        bm = M.butterfly(n)
        assert np.all(bm.kv_num_blocks == 1 + int(np.log2(n)))
        np.testing.assert_array_equal(bm.to_dense(), bm.to_dense().T)
    for bad in (3, 6, 12, 100):
        with pytest.raises(ValueError, match=str(bad)):
            M.butterfly(bad)


def test_random_pattern_reproducible_with_diagonal():
    a, b, c = M.random(32, 0.25, seed=5), M.random(32, 0.25, seed=5), M.random(32, 0.25, seed=6)
    np.testing.assert_array_equal(a.to_dense(), b.to_dense())
    assert not np.array_equal(a.to_dense(), c.to_dense())
    assert np.all(np.diag(a.to_dense()))
    off = a.to_dense()[~np.eye(32, dtype=bool)]
    assert 0.15 < off.mean() < 0.35
    np.testing.assert_array_equal(M.random(6, 0.0).to_dense(), np.eye(6, dtype=bool))
    assert M.random(6, 1.0).density == 1.0
    rect = M.random(3, 0.0, n_k_blocks=5)
    assert rect.shape == (3, 5)
    np.testing.assert_array_equal(rect.to_dense(), np.eye(3, 5, dtype=bool))
    with pytest.raises(ValueError, match="density"):
        M.random(4, 1.5)


def test_rectangular_patterns():
    assert M.dense(3, n_k_blocks=5).shape == (3, 5)
    g = M.global_tokens(3, 1, n_k_blocks=5).to_dense()
    np.testing.assert_array_equal(g, [[1] * 5] + [[1, 0, 0, 0, 0]] * 2)


def test_pattern_argument_errors():
    with pytest.raises(ValueError, match="c <= block"):
        M.fixed(8, 2, 3)
    with pytest.raises(ValueError, match="stride"):
        M.strided(8, 0)
    with pytest.raises(ValueError, match="window_blocks"):
        M.local(8, -1)
    with pytest.raises(ValueError, match="n_blocks"):
        M.causal(0)
    with pytest.raises(TypeError, match="n_blocks"):
        M.dense(2.5)
    with pytest.raises(ValueError, match="block_size"):
        M.dense(2, block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        M.dense(2, block_size=(16, 16, 16))
    with pytest.raises(TypeError, match="block_size"):
        M.dense(2, block_size=True)


def test_patterns_agree_with_window_block_mask():
    for n, b in ((8, 16), (5, 7)):
        np.testing.assert_array_equal(M.causal(n, block_size=b).to_dense(), M.window_block_mask(n * b, n * b, -1, 0, b).to_dense())
        for w in (0, 1, 3):
            np.testing.assert_array_equal(
                M.local(n, w, block_size=b).to_dense(), M.window_block_mask(n * b, n * b, w * b, w * b, b).to_dense()
            )
        np.testing.assert_array_equal(M.dense(n, block_size=b).to_dense(), M.window_block_mask(n * b, n * b, -1, -1, b).to_dense())


# --------------------------------------------------------------------------
# BlockMask: compact lists, conversions, errors
# --------------------------------------------------------------------------


def _check_lists(num, idx, dense):
    """num/idx are the compact row lists of dense (..., T, U)."""
    assert num.dtype == np.int32 and idx.dtype == np.int32
    assert num.shape == dense.shape[:-1]
    assert idx.shape == dense.shape[:-1] + (max(1, int(dense.sum(-1).max(initial=0))),)
    assert not num.flags.writeable and not idx.flags.writeable
    for index in np.ndindex(*dense.shape[:-1]):
        present = np.flatnonzero(dense[index])
        count = num[index]
        assert count == len(present)
        np.testing.assert_array_equal(idx[index][:count], present)
        padding = present[-1] if count else 0
        assert np.all(idx[index][count:] == padding)


def test_compact_lists_and_transposed_lists():
    rng = rng_for("lists")
    for shape in ((5, 7), (2, 3, 6, 4), (1, 9, 9), (3, 1, 1)):
        dense = rng.random(shape) < 0.4
        dense[..., 0, :] = False  # an empty query row
        dense[..., -1, :] = True  # a full one
        bm = M.BlockMask.from_dense(dense, block_size=(16, 8))
        assert bm.shape == shape
        np.testing.assert_array_equal(bm.to_dense(), dense)
        _check_lists(bm.kv_num_blocks, bm.kv_indices, dense)
        _check_lists(bm.q_num_blocks, bm.q_indices, np.swapaxes(dense, -1, -2))
        # The two lists describe the same set of blocks.
        from_kv = {(index, int(c)) for index in np.ndindex(*shape[:-1]) for c in bm.kv_indices[index][: bm.kv_num_blocks[index]]}
        from_q = set()
        for index in np.ndindex(*shape[:-2], shape[-1]):
            for r in bm.q_indices[index][: bm.q_num_blocks[index]]:
                from_q.add((index[:-1] + (int(r),), index[-1]))
        assert from_kv == from_q
        assert bm.nnz == len(from_kv) == dense.sum()


def test_all_empty_mask_lists_have_width_one():
    bm = M.BlockMask.from_dense(np.zeros((3, 4), dtype=bool), 16)
    assert bm.kv_indices.shape == (3, 1) and bm.q_indices.shape == (4, 1)
    assert np.all(bm.kv_indices == 0) and np.all(bm.kv_num_blocks == 0)
    assert bm.density == 0.0 and bm.nnz == 0


def test_from_dense_copies_and_is_immutable():
    dense = np.eye(4, dtype=bool)
    bm = M.BlockMask.from_dense(dense, 16)
    dense[0, 1] = True
    assert not bm.to_dense()[0, 1]
    out = bm.to_dense()
    out[:] = True
    assert bm.nnz == 4
    with pytest.raises(ValueError):
        bm.kv_indices[0, 0] = 3


def test_from_dense_inputs_and_errors():
    bm = M.BlockMask.from_dense([[1, 0], [1, 1]], 8)
    np.testing.assert_array_equal(bm.to_dense(), [[True, False], [True, True]])
    with pytest.raises(TypeError, match="boolean"):
        M.BlockMask.from_dense(np.ones((2, 2)) * 0.5, 8)
    with pytest.raises(TypeError, match="boolean"):
        M.BlockMask.from_dense(np.full((2, 2), 2), 8)
    with pytest.raises(ValueError, match=r"\(\.\.\., Tq, Tk\)"):
        M.BlockMask.from_dense(np.ones(4, dtype=bool), 8)


def test_constructor_from_lists():
    rng = rng_for("from-lists")
    dense = rng.random((2, 6, 9)) < 0.5
    a = M.BlockMask.from_dense(dense, (16, 32))
    b = M.BlockMask(a.kv_num_blocks, a.kv_indices, 9, (16, 32))
    np.testing.assert_array_equal(b.to_dense(), dense)
    np.testing.assert_array_equal(b.q_indices, a.q_indices)
    # Padding values are ignored; the stored padding is canonical.
    junk = np.array(a.kv_indices)
    junk[np.arange(junk.shape[-1]) >= a.kv_num_blocks[..., None]] = 99
    c = M.BlockMask(a.kv_num_blocks, junk, 9, (16, 32))
    np.testing.assert_array_equal(c.kv_indices, a.kv_indices)
    with pytest.raises(ValueError, match="strictly increasing"):
        M.BlockMask([2], [[3, 1]], 5)
    with pytest.raises(ValueError, match="n_k_blocks=5"):
        M.BlockMask([1], [[5]], 5)
    with pytest.raises(ValueError, match="kv_num_blocks"):
        M.BlockMask([3], [[0, 1]], 5)
    with pytest.raises(ValueError, match="shape"):
        M.BlockMask([1, 1], [[0]], 5)
    with pytest.raises(TypeError, match="integer"):
        M.BlockMask([1.0], [[0]], 5)


def _brute_elements(dense, bq, bk, nq, nk):
    out = np.zeros(dense.shape[:-2] + (nq, nk), dtype=bool)
    for index in np.ndindex(*dense.shape[:-2]):
        for i in range(nq):
            for j in range(nk):
                out[index + (i, j)] = dense[index + (i // bq, j // bk)]
    return out


def test_to_elements_ragged_and_batched():
    rng = rng_for("elements")
    for (bq, bk), (nq, nk) in (((16, 16), (113, 128)), ((16, 32), (128, 250)), ((8, 24), (60, 170)), ((4, 4), (1, 3))):
        tq, tk = -(-nq // bq), -(-nk // bk)
        dense = rng.random((2, tq, tk)) < 0.5
        bm = M.BlockMask.from_dense(dense, (bq, bk))
        elements = bm.to_elements(nq, nk)
        assert elements.shape == (2, nq, nk) and elements.dtype == np.bool_
        np.testing.assert_array_equal(elements, _brute_elements(dense, bq, bk, nq, nk))


def test_size_errors_quote_sizes():
    bm = M.dense(8, block_size=(16, 32))
    bm.check(113, 250)
    bm.check(128, 256, batch_shape=(2, 3))
    with pytest.raises(ValueError, match=r"Nq=200.*ceil\(200/16\) = 13.*Tq=8"):
        bm.to_elements(200, 256)
    with pytest.raises(ValueError, match=r"Nk=100.*ceil\(100/32\) = 4.*Tk=8"):
        bm.to_elements(128, 100)
    with pytest.raises(ValueError, match=r"\(16, 32\)"):
        bm.check(1, 1)
    per_head = M.BlockMask.from_dense(np.ones((3, 8, 8), dtype=bool), (16, 32))
    per_head.check(128, 256, batch_shape=(2, 3))
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 4\)"):
        per_head.check(128, 256, batch_shape=(2, 4))
    with pytest.raises(ValueError, match=r"\(3,\).*\(\)"):
        per_head.check(128, 256, batch_shape=())  # the mask would enlarge the batch


# --------------------------------------------------------------------------
# | and &
# --------------------------------------------------------------------------


def test_or_and_semantics_and_broadcasting():
    a, b = M.local(8, 1, block_size=16), M.butterfly(8, block_size=16)
    np.testing.assert_array_equal((a | b).to_dense(), a.to_dense() | b.to_dense())
    np.testing.assert_array_equal((a & b).to_dense(), a.to_dense() & b.to_dense())
    assert (a | b).block_size == (16, 16)
    _check_lists((a | b).kv_num_blocks, (a | b).kv_indices, a.to_dense() | b.to_dense())
    rng = rng_for("or-and")
    x = M.BlockMask.from_dense(rng.random((2, 1, 8, 8)) < 0.5, 16)
    y = M.BlockMask.from_dense(rng.random((3, 8, 8)) < 0.5, 16)
    both = x & y
    assert both.shape == (2, 3, 8, 8)
    np.testing.assert_array_equal(both.to_dense(), x.to_dense() & y.to_dense())
    np.testing.assert_array_equal((x | a).to_dense(), x.to_dense() | a.to_dense())
    # Identities.
    np.testing.assert_array_equal((a | M.dense(8, block_size=16)).to_dense(), np.ones((8, 8), bool))
    np.testing.assert_array_equal((a & M.dense(8, block_size=16)).to_dense(), a.to_dense())


def test_or_and_errors_name_both():
    a = M.local(8, 1, block_size=16)
    with pytest.raises(ValueError, match=r"block sizes.*\(16, 16\).*\(16, 32\)"):
        a | M.dense(8, block_size=(16, 32))
    with pytest.raises(ValueError, match=r"grids.*\(8, 8\).*\(4, 8\)"):
        a & M.dense(4, n_k_blocks=8, block_size=16)
    with pytest.raises(ValueError, match=r"broadcast.*\(2, 8, 8\).*\(3, 8, 8\)"):
        M.BlockMask.from_dense(np.ones((2, 8, 8), bool), 16) | M.BlockMask.from_dense(np.ones((3, 8, 8), bool), 16)
    with pytest.raises(TypeError):
        a | np.ones((8, 8), bool)


# --------------------------------------------------------------------------
# Pictures: text and PNG
# --------------------------------------------------------------------------


def test_to_text():
    bm = M.causal(3, block_size=16)
    assert bm.to_text() == "█··\n██·\n███"
    assert bm.to_text(ascii=True) == "#..\n##.\n###"
    big = M.BlockMask.from_dense(rng_for("text").random((100, 70)) < 0.5, 16)
    lines = big.to_text(max_blocks=32, ascii=True).split("\n")
    assert lines[0] == "(each character: 4 x 3 blocks)"
    assert len(lines) == 1 + 25 and all(len(line) == 24 for line in lines[1:])
    assert set("".join(lines[1:])) <= {"#", "+", "."}
    assert "+" in "".join(lines[1:])
    full = M.dense(100, block_size=16).to_text(max_blocks=10, ascii=True).split("\n")
    assert full[1:] == ["#" * 10] * 10
    batched = M.BlockMask.from_dense(np.ones((2, 2, 3, 4), bool), 16).to_text(ascii=True).split("\n")
    assert batched[0] == "[0, 0]" and batched[4] == "[0, 1]" and len(batched) == 4 * 4
    assert batched[1] == "####"


def decode_png(data):
    """Minimal PNG reader for 8-bit greyscale, non-interlaced, filter-0 images."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, compression, filtering, interlace) == (8, 0, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(height, width + 1)
    assert np.all(rows[:, 0] == 0)  # filter type None on every scanline
    return rows[:, 1:]


def test_save_png(tmp_path):
    bm = M.butterfly(8, block_size=16)
    path = tmp_path / "butterfly.png"
    assert bm.save_png(path, scale=3) == path
    pixels = decode_png(path.read_bytes())
    assert pixels.shape == (24, 24)
    want = np.repeat(np.repeat(np.where(bm.to_dense(), 0, 255), 3, 0), 3, 1)
    np.testing.assert_array_equal(pixels, want)

    rect = M.global_tokens(3, 1, n_k_blocks=5, block_size=16)
    rect.save_png(str(tmp_path / "rect.png"))
    assert decode_png((tmp_path / "rect.png").read_bytes()).shape == (12, 20)

    heads = M.BlockMask.from_dense(np.stack([M.causal(4).to_dense(), M.local(4, 0).to_dense()]), 16)
    heads.save_png(tmp_path / "heads.png", scale=2)
    pixels = decode_png((tmp_path / "heads.png").read_bytes())
    assert pixels.shape == (2 * 8 + 1, 8)
    assert np.all(pixels[8] == 160)  # separator line
    np.testing.assert_array_equal(pixels[9:], np.repeat(np.repeat(np.where(np.eye(4), 0, 255), 2, 0), 2, 1))

    with pytest.raises(ValueError, match="empty"):
        M.BlockMask.from_dense(np.zeros((0, 3), bool), 16).save_png(tmp_path / "empty.png")


# --------------------------------------------------------------------------
# Sliding windows
# --------------------------------------------------------------------------

WINDOW_SIDES = (-1, 0, 1, 5, 40)


def brute_window(nq, nk, left, right):
    out = np.zeros((nq, nk), dtype=bool)
    for i in range(nq):
        centre = i + nk - nq
        for j in range(nk):
            out[i, j] = (left == -1 or j >= centre - left) and (right == -1 or j <= centre + right)
    return out


def test_sliding_window_matches_loop_definition():
    for nq, nk in ((1, 1), (13, 13), (7, 30), (30, 7), (0, 5), (5, 0)):
        for left, right in itertools.product(WINDOW_SIDES, WINDOW_SIDES):
            got = M.sliding_window(nq, nk, left, right)
            assert got.shape == (nq, nk) and got.dtype == np.bool_
            np.testing.assert_array_equal(got, brute_window(nq, nk, left, right), err_msg=f"{nq} {nk} {left} {right}")
    for nq, nk in ((9, 9), (4, 11), (11, 4)):
        np.testing.assert_array_equal(M.sliding_window(nq, nk, -1, 0), ref.allowed_keys(nq, nk, causal=True))
        assert M.sliding_window(nq, nk, -1, -1).all()
    with pytest.raises(ValueError, match="left"):
        M.sliding_window(4, 4, -2, 0)
    with pytest.raises(ValueError, match="right"):
        M.sliding_window(4, 4, 0, -3)


def test_window_block_mask_is_the_set_of_touched_tiles():
    for nq, nk in ((1, 1), (7, 50), (50, 7), (33, 33), (16, 48), (0, 9)):
        for bs in (8, (4, 16), (16, 5)):
            bq, bk = M._block_pair(bs)
            tq, tk = -(-nq // bq), -(-nk // bk)
            for left, right in itertools.product((-1, 0, 3, 20), repeat=2):
                bm = M.window_block_mask(nq, nk, left, right, bs)
                assert bm.shape == (tq, tk) and bm.block_size == (bq, bk)
                elements = M.sliding_window(nq, nk, left, right)
                want = np.zeros((tq, tk), dtype=bool)
                for r, c in itertools.product(range(tq), range(tk)):
                    want[r, c] = elements[r * bq : (r + 1) * bq, c * bk : (c + 1) * bk].any()
                np.testing.assert_array_equal(bm.to_dense(), want, err_msg=f"{nq} {nk} {bs} {left} {right}")
                # Every allowed element lies in a present tile.
                assert not np.any(elements & ~bm.to_elements(nq, nk))


def test_element_mask():
    nq, nk, bs = 50, 70, (16, 32)
    bm = M.BlockMask.from_dense(rng_for("element-mask").random((2, 4, 3)) < 0.6, bs)
    got = ref.element_mask(nq, nk, block_mask=bm, window=(10, 3))
    assert got.shape == (2, nq, nk)
    np.testing.assert_array_equal(got, bm.to_elements(nq, nk) & brute_window(nq, nk, 10, 3))
    assert ref.element_mask(nq, nk, block_mask=bm, batch_shape=(5, 2)).shape == (5, 2, nq, nk)
    np.testing.assert_array_equal(ref.element_mask(nq, nk, window=(-1, 0)), ref.allowed_keys(nq, nk, causal=True))
    assert ref.element_mask(3, 4).all() and ref.element_mask(3, 4, batch_shape=(2,)).shape == (2, 3, 4)
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        ref.element_mask(nq, nk, block_mask=bm, batch_shape=(3,))
    with pytest.raises(ValueError, match="window"):
        ref.element_mask(nq, nk, window=5)
    with pytest.raises(ValueError, match="Nq=65"):
        ref.element_mask(65, nk, block_mask=bm)


# --------------------------------------------------------------------------
# Block-sparse reference (Algorithm 5) against the materialised oracle
# --------------------------------------------------------------------------

# (block size, nq, nk): 8 x 8 block grids with ragged ends and Nq != Nk.
GEOMETRIES = (((16, 16), 113, 128), ((16, 32), 128, 250), ((8, 24), 60, 170))


def assert_outputs_close(got, want):
    for name in ("o", "l", "m"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape, name
        assert not np.isnan(g).any(), name
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=name)


def oracle(q, k, v, bm, *, causal=False, scale=None, window=None):
    nq, nk = q.shape[-2], k.shape[-2]
    mask = ref.element_mask(nq, nk, block_mask=bm, window=window)
    return ref.standard_attention(q, k, v, causal=causal, scale=scale, mask=mask)


def assert_grads_close(got, want):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=name)


def sparse_forward_backward(q, k, v, do, bm, **kwargs):
    o, l, m = ref.block_sparse_forward_tiled(q, k, v, bm, **kwargs)
    return ref.block_sparse_backward_tiled(do, q, k, v, o, l, m, bm, **kwargs)


def analytic_grads(do, q, k, v, bm, *, causal=False, scale=None, window=None):
    mask = ref.element_mask(q.shape[-2], k.shape[-2], block_mask=bm, window=window)
    return ref.standard_attention_backward(do, q, k, v, causal=causal, scale=scale, mask=mask)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_block_sparse_matches_oracle_for_every_pattern(name, causal):
    """Forward against the materialised oracle, backward against the analytic gradient."""
    factory = PATTERNS[name][0]
    for bs, nq, nk in GEOMETRIES:
        rng = rng_for("pattern", name, causal, bs)
        q, k, v = rng.standard_normal((2, nq, 8)) * 1.5, rng.standard_normal((2, nk, 8)) * 1.5, rng.standard_normal((2, nk, 5))
        do = rng.standard_normal((2, nq, 5))
        bm = factory(8, bs)
        got = ref.block_sparse_forward_tiled(q, k, v, bm, causal=causal, scale=0.3)
        assert_outputs_close(got, oracle(q, k, v, bm, causal=causal, scale=0.3))
        grads = ref.block_sparse_backward_tiled(do, q, k, v, *got, bm, causal=causal, scale=0.3)
        assert_grads_close(grads, analytic_grads(do, q, k, v, bm, causal=causal, scale=0.3))


def test_dense_block_mask_equals_flash_forward_tiled():
    rng = rng_for("dense-equals-flash")
    q, k, v = rng.standard_normal((3, 45, 8)), rng.standard_normal((3, 70, 8)), rng.standard_normal((3, 70, 4))
    for causal in (False, True):
        got = ref.block_sparse_forward_tiled(q, k, v, M.dense(3, n_k_blocks=5, block_size=(16, 16)), causal=causal)
        want = ref.flash_forward_tiled(q, k, v, causal=causal, block_rows=16, block_cols=16)
        assert_outputs_close(got, want)
        assert_outputs_close(got, ref.standard_attention(q, k, v, causal=causal))


def test_block_sparse_broadcast_and_grouped_heads():
    rng = rng_for("grouped")
    nq, nk, bs = 40, 90, (16, 32)  # 3 x 3 blocks
    q = rng.standard_normal((2, 4, nq, 8))
    k = rng.standard_normal((2, 2, nk, 8))  # grouped: 4 query heads on 2 kv heads
    v = rng.standard_normal((1, 2, nk, 6))  # broadcast over batch
    per_head = np.stack([rng.random((3, 3)) < 0.5 for _ in range(4)])
    per_head[1] = False  # a head that sees nothing
    for blocks in (per_head, per_head[None], rng.random((2, 1, 3, 3)) < 0.5, rng.random((3, 3)) < 0.5):
        bm = M.BlockMask.from_dense(blocks, bs)
        for causal in (False, True):
            got = ref.block_sparse_forward_tiled(q, k, v, bm, causal=causal)
            assert got.o.shape == (2, 4, nq, 6)
            assert_outputs_close(got, oracle(q, k, v, bm, causal=causal))
    got = ref.block_sparse_forward_tiled(q, k, v, M.BlockMask.from_dense(per_head, bs))
    assert np.all(got.o[:, 1] == 0) and np.all(got.l[:, 1] == 0) and np.all(got.m[:, 1] == -np.inf)
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 4\)"):
        ref.block_sparse_forward_tiled(q, k, v, M.BlockMask.from_dense(np.ones((3, 3, 3), bool), bs))
    with pytest.raises(ValueError, match=r"\(1, 2, 4\).*\(2, 4\)"):
        ref.block_sparse_forward_tiled(q, k, v, M.BlockMask.from_dense(np.ones((1, 2, 4, 3, 3), bool), bs))


def test_block_sparse_rows_without_allowed_keys():
    rng = rng_for("empty-rows")
    bs = (8, 8)
    # An empty block row; causal with Nq > Nk (the first Nq - Nk rows see nothing);
    # a window that leaves rows empty.
    nq, nk = 40, 20
    q, k, v = rng.standard_normal((nq, 4)), rng.standard_normal((nk, 4)), rng.standard_normal((nk, 3))
    blocks = np.ones((5, 3), dtype=bool)
    blocks[2] = False
    bm = M.BlockMask.from_dense(blocks, bs)
    cases = [dict(), dict(causal=True), dict(window=(3, 2)), dict(causal=True, window=(0, 0))]
    for kwargs in cases:
        got = ref.block_sparse_forward_tiled(q, k, v, bm, **kwargs)
        want = oracle(q, k, v, bm, **kwargs)
        assert_outputs_close(got, want)
        empty = ~ref.allowed_keys(nq, nk, causal=kwargs.get("causal", False), mask=ref.element_mask(nq, nk, block_mask=bm, window=kwargs.get("window"))).any(-1)
        assert empty[16:24].all() and empty.any()
        assert np.all(got.o[empty] == 0) and np.all(got.l[empty] == 0) and np.all(got.m[empty] == -np.inf)
        assert np.all(got.l[~empty] > 0)
    none = M.BlockMask.from_dense(np.zeros((5, 3), bool), bs)
    got = ref.block_sparse_forward_tiled(q, k, v, none)
    assert np.all(got.o == 0) and np.all(got.l == 0) and np.all(got.m == -np.inf)


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_with_sliding_window(causal):
    for bs, nq, nk in GEOMETRIES + (((16, 16), 100, 37),):
        rng = rng_for("window", bs, nq, nk, causal)
        q, k, v = rng.standard_normal((2, nq, 8)), rng.standard_normal((2, nk, 8)), rng.standard_normal((2, nk, 5))
        for left, right in ((-1, 0), (0, 0), (5, 5), (40, -1), (-1, 17), (-1, -1), (0, 3)):
            window_tiles = M.window_block_mask(nq, nk, left, right, bs)
            brute = brute_window(nq, nk, left, right)
            want = ref.standard_attention(q, k, v, causal=causal, mask=brute)
            # The window's own tiles: exact windowed attention, with tile skipping.
            got = ref.block_sparse_forward_tiled(q, k, v, window_tiles, causal=causal, window=(left, right))
            assert_outputs_close(got, want)
            # Dense tiles give the same answer (the window masks elements).
            tq, tk = window_tiles.shape
            got = ref.block_sparse_forward_tiled(q, k, v, M.dense(tq, n_k_blocks=tk, block_size=bs), causal=causal, window=(left, right))
            assert_outputs_close(got, want)
            # Combined with a pattern.
            if tq == tk:
                bm = window_tiles & M.random(tq, 0.5, seed=(left + 1) + 7 * (right + 1), block_size=bs)
                got = ref.block_sparse_forward_tiled(q, k, v, bm, causal=causal, window=(left, right))
                assert_outputs_close(got, oracle(q, k, v, bm, causal=causal, window=(left, right)))


def test_block_sparse_visits_exactly_the_present_tiles():
    rng = rng_for("visits")
    bs, nq, nk = (16, 32), 113, 250
    q, k, v = rng.standard_normal((2, 3, nq, 8)), rng.standard_normal((2, 3, nk, 8)), rng.standard_normal((2, 3, nk, 8))
    blocks = rng.random((3, 8, 8)) < 0.3
    bm = M.BlockMask.from_dense(blocks, bs)
    visited = []
    ref.block_sparse_forward_tiled(q, k, v, bm, causal=True, on_tile=lambda index, i, j: visited.append(index + (i, j)))
    assert len(visited) == len(set(visited)) == 2 * bm.nnz
    expanded = np.broadcast_to(blocks, (2, 3, 8, 8))
    assert set(visited) == {tuple(int(x) for x in t) for t in zip(*np.nonzero(expanded))}
    # Within a head the order is Algorithm 5's: column by column, rows ascending.
    head = [t[2:] for t in visited if t[:2] == (1, 2)]
    assert head == sorted(head, key=lambda ij: (ij[1], ij[0]))


def test_block_sparse_never_reads_absent_tiles():
    """Poison every Q row block and K/V column block that only absent tiles cover."""
    rng = rng_for("poison")
    bs, nq, nk = (16, 16), 70, 90  # 5 x 6 blocks
    blocks = rng.random((5, 6)) < 0.5
    blocks[1] = False  # query block 1 has no tile
    blocks[:, 3] = False  # key block 3 has no tile
    bm = M.BlockMask.from_dense(blocks, bs)
    q, k, v = rng.standard_normal((nq, 8)), rng.standard_normal((nk, 8)), rng.standard_normal((nk, 4))
    want = oracle(q, k, v, bm)
    q_bad, k_bad, v_bad = q.copy(), k.copy(), v.copy()
    q_bad[16:32] = np.nan
    k_bad[48:64] = np.nan
    v_bad[48:64] = np.inf
    got = ref.block_sparse_forward_tiled(q_bad, k_bad, v_bad, bm)
    assert_outputs_close(got, want)
    assert np.all(got.m[16:32] == -np.inf)


def test_block_sparse_argument_errors():
    q = k = v = np.ones((20, 4))
    with pytest.raises(TypeError, match="BlockMask"):
        ref.block_sparse_forward_tiled(q, k, v, np.ones((2, 2), bool))
    with pytest.raises(ValueError, match=r"Nq=20.*ceil\(20/8\) = 3.*Tq=2"):
        ref.block_sparse_forward_tiled(q, k, v, M.dense(2, block_size=(8, 16)))
    with pytest.raises(ValueError, match="window"):
        ref.block_sparse_forward_tiled(q, k, v, M.dense(2, block_size=16), window=(1, 2, 3))
    with pytest.raises(ValueError, match="window left"):
        ref.block_sparse_forward_tiled(q, k, v, M.dense(2, block_size=16), window=(-5, 2))


# --------------------------------------------------------------------------
# Per-tile lists for the kernels
# --------------------------------------------------------------------------


def brute_tile_lists(bm, nq, nk, tile_rows, tile_cols, transpose, causal, window):
    """Element by element: for every (query tile, key tile) the set of elements in it, and
    whether it is listed / partial by the definition in BlockMask.tile_lists."""
    elements = bm.to_elements(nq, nk).reshape((-1, nq, nk))
    band = ref.allowed_keys(nq, nk, causal=causal, mask=M.sliding_window(nq, nk, *(window or (-1, -1))))
    n_qt, n_kt = -(-nq // tile_rows), -(-nk // tile_cols)
    outer, inner = (n_kt, n_qt) if transpose else (n_qt, n_kt)
    lists = [[[] for _ in range(outer)] for _ in range(elements.shape[0])]
    for b in range(elements.shape[0]):
        for t in range(outer):
            for u in range(inner):
                r, c = (u, t) if transpose else (t, u)
                rows, cols = slice(r * tile_rows, (r + 1) * tile_rows), slice(c * tile_cols, (c + 1) * tile_cols)
                present = elements[b, rows, cols]
                if present.any() and band[rows, cols].any():
                    lists[b][t].append(u | (0 if present.all() else M.PARTIAL_TILE))
    return lists


def check_tile_lists(tiles, want, blocks):
    mb, outer = len(want), len(want[0])
    assert tiles.counts.dtype == np.int32 and tiles.lists.dtype == np.int32 and tiles.blocks.dtype == np.uint8
    assert tiles.counts.shape == (mb, outer) and tiles.lists.shape[:2] == (mb, outer)
    assert tiles.n_outer == outer and tiles.list_stride == max([1] + [len(x) for row in want for x in row])
    assert all(a.flags.c_contiguous and not a.flags.writeable for a in tiles)
    np.testing.assert_array_equal(tiles.blocks, blocks.reshape((-1,) + blocks.shape[-2:]))
    for b in range(mb):
        for t in range(outer):
            count = tiles.counts[b, t]
            assert count == len(want[b][t])
            row = tiles.lists[b, t]
            assert row[:count].tolist() == want[b][t], (b, t)
            assert np.all(row[count:] == (row[count - 1] if count else 0))  # padding repeats the last entry


TILE_CASES = (
    # (block size, nq, nk, tile_rows, tile_cols): tiles that divide blocks, blocks that divide
    # tiles, neither, ragged ends and Nq != Nk.
    ((16, 16), 100, 100, 32, 8),
    ((16, 24), 75, 130, 8, 40),
    ((24, 16), 130, 75, 48, 48),
    ((7, 9), 50, 44, 5, 11),
    ((32, 32), 1, 70, 16, 64),
)


@pytest.mark.parametrize("transpose", (False, True), ids=("query-major", "transposed"))
@pytest.mark.parametrize("case", TILE_CASES, ids=[str(c) for c in TILE_CASES])
def test_tile_lists_match_brute_force(case, transpose):
    bs, nq, nk, tile_rows, tile_cols = case
    tq, tk = -(-nq // bs[0]), -(-nk // bs[1])
    rng = rng_for("tile-lists", case)
    for batch in ((), (2, 3)):
        blocks = rng.random(batch + (tq, tk)) < 0.5
        blocks[..., 0, :] = False  # an empty block row
        bm = M.BlockMask.from_dense(blocks, bs)
        for causal, window in ((False, None), (True, None), (False, (9, 4)), (True, (-1, 20)), (False, (0, -1))):
            tiles = bm.tile_lists(nq, nk, tile_rows, tile_cols, transpose=transpose, causal=causal, window=window)
            want = brute_tile_lists(bm, nq, nk, tile_rows, tile_cols, transpose, causal, window)
            check_tile_lists(tiles, want, blocks)


def test_tile_lists_of_a_dense_mask_and_an_empty_one():
    full = M.dense(4, n_k_blocks=3, block_size=(16, 32)).tile_lists(64, 96, 32, 16)
    np.testing.assert_array_equal(full.counts, [[6, 6]])
    np.testing.assert_array_equal(full.lists, [[range(6), range(6)]])  # no flags: nothing to look up
    empty = M.BlockMask.from_dense(np.zeros((2, 4, 3), bool), (16, 32)).tile_lists(64, 96, 32, 16, transpose=True)
    assert empty.counts.shape == (2, 6) and not empty.counts.any()
    assert empty.lists.shape == (2, 6, 1) and not empty.lists.any()
    no_keys = M.BlockMask.from_dense(np.ones((2, 3, 0), bool), 16).tile_lists(40, 0, 32, 16)
    assert no_keys.counts.shape == (2, 2) and not no_keys.counts.any() and no_keys.blocks.shape == (2, 3, 0)


def test_tile_lists_are_cached_and_keys_normalised():
    bm = M.butterfly(8, block_size=16)
    a = bm.tile_lists(128, 128, 32, 16, window=None)
    assert bm.tile_lists(128, 128, 32, 16, window=(-1, -1)) is a  # (-1, -1) is no window
    assert bm.tile_lists(128, 128, 32, 16, transpose=True) is not a
    assert bm.tile_lists(120, 128, 32, 16) is not a
    for i in range(2 * M._MAX_CACHED_LISTS):  # the cache stays bounded
        bm.tile_lists(128, 128, 8 + i, 16)
    assert len(bm._host_lists) <= M._MAX_CACHED_LISTS


def test_tile_lists_argument_errors():
    bm = M.butterfly(4, block_size=16)
    with pytest.raises(ValueError, match=r"Nq=100.*Tq=4"):
        bm.tile_lists(100, 64, 32, 32)
    with pytest.raises(ValueError, match="tile_rows"):
        bm.tile_lists(64, 64, 0, 32)
    with pytest.raises(ValueError, match="window left"):
        bm.tile_lists(64, 64, 32, 32, window=(-2, 0))


def test_tile_lists_at_64k_are_fast():
    """Block level only: 64k tokens in 128-blocks (512 x 512), per-head masks."""
    import time

    bm = M.BlockMask.from_dense(rng_for("64k").random((8, 512, 512)) < 0.1, 128)
    start = time.perf_counter()
    fwd = bm.tile_lists(65536, 65536, 128, 64, causal=True)
    bwd = bm.tile_lists(65536, 65536, 64, 128, transpose=True, causal=True)
    assert time.perf_counter() - start < 5.0
    assert fwd.counts.shape == (8, 512) and bwd.counts.shape == (8, 512)
    # Tiles that nest inside the blocks never straddle two: no flags. Causal keeps both
    # 64-key halves of every present block on or below the diagonal.
    assert not (fwd.lists & M.PARTIAL_TILE).any() and not (bwd.lists & M.PARTIAL_TILE).any()
    assert fwd.counts.sum() == 2 * np.tril(bm.to_dense()).sum()


def test_tokens_name_live_masks():
    a, b = M.dense(2), M.butterfly(2)
    assert a.token != b.token and M.BlockMask.from_token(b.token) is b
    assert (a | b).token not in (a.token, b.token)
    token = a.token
    del a
    gc.collect()
    with pytest.raises(LookupError, match=f"token {token}.*garbage-collected"):
        M.BlockMask.from_token(token)


# --------------------------------------------------------------------------
# Block-sparse backward reference against the analytic gradient
# --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_backward_with_windows_and_grouped_heads(causal):
    rng = rng_for("backward-window", causal)
    nq, nk, bs = 70, 45, (16, 8)  # 5 x 6 blocks, ragged, Nq > Nk
    q = rng.standard_normal((2, 4, nq, 8))
    k = rng.standard_normal((2, 2, nk, 8))  # grouped heads
    v = rng.standard_normal((1, 2, nk, 6))  # broadcast over batch
    do = rng.standard_normal((2, 4, nq, 6))
    per_head = rng.random((4, 5, 6)) < 0.5
    per_head[2] = False  # a head that sees nothing: zero gradients from it
    bm = M.BlockMask.from_dense(per_head, bs)
    for window in (None, (-1, 0), (0, 0), (7, 3), (-1, 11), (20, -1)):
        got = sparse_forward_backward(q, k, v, do, bm, causal=causal, window=window)
        assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
        assert_grads_close(got, analytic_grads(do, q, k, v, bm, causal=causal, window=window))
    dq = sparse_forward_backward(q, k, v, do, bm, causal=causal)[0]
    assert np.all(dq[:, 2] == 0)


def test_block_sparse_backward_never_reads_absent_tiles():
    """NaN in Q rows / K, V columns that only absent tiles cover, as in the forward test."""
    rng = rng_for("backward-poison")
    bs, nq, nk = (16, 16), 70, 90
    blocks = rng.random((5, 6)) < 0.5
    blocks[1] = False
    blocks[:, 3] = False
    bm = M.BlockMask.from_dense(blocks, bs)
    q, k, v = rng.standard_normal((nq, 8)), rng.standard_normal((nk, 8)), rng.standard_normal((nk, 4))
    do = rng.standard_normal((nq, 4))
    want = analytic_grads(do, q, k, v, bm)
    o, l, m = ref.block_sparse_forward_tiled(q, k, v, bm)
    q[16:32], k[48:64], v[48:64], do[16:32] = np.nan, np.nan, np.inf, np.nan
    dq, dk, dv = ref.block_sparse_backward_tiled(do, q, k, v, o, l, m, bm)
    keep = np.ones(nq, bool)
    keep[16:32] = False
    keys = np.ones(nk, bool)
    keys[48:64] = False
    np.testing.assert_allclose(dq[keep], want[0][keep], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(dk[keys], want[1][keys], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(dv[keys], want[2][keys], rtol=1e-9, atol=1e-11)
    assert np.all(dq[16:32] == 0)  # query block 1: never loaded
    assert np.all(dk[48:64] == 0) and np.all(dv[48:64] == 0)  # key block 3: never loaded


def test_block_sparse_backward_argument_errors():
    x = np.ones((20, 4))
    with pytest.raises(TypeError, match="BlockMask"):
        ref.block_sparse_backward_tiled(x, x, x, x, x, x[:, 0], x[:, 0], np.ones((2, 2), bool))
    with pytest.raises(ValueError, match=r"Nq=20.*Tq=2"):
        ref.block_sparse_backward_tiled(x, x, x, x, x, x[:, 0], x[:, 0], M.dense(2, block_size=(8, 16)))


def test_device_lists_are_uploaded_once_per_device(monkeypatch):
    """The GPU copies, with the upload replaced by a NumPy copy that counts its calls."""
    pytest.importorskip("cupy")
    uploads = []

    def fake_upload(arrays, device_id):
        uploads.append((device_id, len(arrays)))
        return tuple(np.array(a) for a in arrays)

    monkeypatch.setattr(M._device_cache, "_upload", fake_upload)
    bm = M.random(8, 0.3, seed=4, block_size=(16, 32))
    a = bm.device_tile_lists(128, 256, 32, 64, device=0)
    assert uploads == [(0, 1), (0, 2)]  # the block bytes, then counts and lists
    assert bm.device_tile_lists(128, 256, 32, 64, device=0, window=(-1, -1)) is a
    assert not bm._host_lists  # the host lists were not kept
    b = bm.device_tile_lists(128, 256, 32, 64, transpose=True, device=0)
    c = bm.device_tile_lists(128, 256, 32, 64, device=1)
    assert uploads[2:] == [(0, 2), (1, 1), (1, 2)]  # the block bytes once per device
    assert b.blocks is a.blocks and c.blocks is not a.blocks
    host = bm.tile_lists(128, 256, 32, 64)
    for got, want in zip(a, host):
        np.testing.assert_array_equal(got, want)
