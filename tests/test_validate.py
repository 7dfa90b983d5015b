"""cuflash._validate, the opt-in checks of page tables, lengths and cu_seqlens, with NumPy arrays
standing in for device arrays (each check copies its array to the host first, so the rules are
the same); on a GPU, CuPy arrays, and a check inside a stream capture (skipped)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_gpu
from cuflash import _validate


def test_lengths_inside_the_capacity_pass_and_the_first_outside_is_named():
    _validate.check_seqlens_k(np.array([0, 7, 300], np.int32), capacity=300)
    with pytest.raises(ValueError, match=r"seqlens_k\[1\] = -3 is outside \[0, 300\].*2 of 4 lengths"):
        _validate.check_seqlens_k(np.array([5, -3, 301, 300], np.int32), capacity=300)
    with pytest.raises(ValueError, match=r"seqlens_k\[0\] = 301 is outside \[0, 300\]"):
        _validate.check_seqlens_k(np.array([301], np.int32), capacity=300)


def test_only_the_entries_a_sequence_reads_are_checked():
    table = np.array([[0, 1, -1, 99],    # length 20, pages of 16: entries 0 and 1 read
                      [2, -7, 5, 6],     # length 0: nothing read
                      [3, 4, 7, 2**31 - 1]], np.int32)  # length 64: all four read
    lengths = np.array([20, 0, 48], np.int32)
    _validate.check_page_table(table, lengths, num_pages=8, page_size=16)
    with pytest.raises(ValueError, match=r"page_table\[2, 3\] = 2147483647 is outside \[0, 8\).*sequence 2 of "
                                         r"length 64 reads it for keys 48..63; 1 entries"):
        _validate.check_page_table(table, np.array([20, 0, 64], np.int32), num_pages=8, page_size=16)
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 8 is outside \[0, 8\).*keys 16..16"):
        _validate.check_page_table(np.array([[0, 8]], np.int32), np.array([17], np.int32), num_pages=8, page_size=16)


def test_a_length_past_the_capacity_reads_every_page_as_the_kernel_clamps_it():
    table = np.array([[0, -1]], np.int32)
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = -1.*length 32"):
        _validate.check_page_table(table, np.array([1000], np.int32), num_pages=4, page_size=16)


def test_page_table_shapes_are_checked():
    with pytest.raises(ValueError, match=r"page_table must have shape \(batch, max_pages\), got \(4,\)"):
        _validate.check_page_table(np.zeros(4, np.int32), np.zeros(4, np.int32), num_pages=4, page_size=16)
    with pytest.raises(ValueError, match=r"seqlens_k must have shape \(2,\) for page_table \(2, 3\), got \(3,\)"):
        _validate.check_page_table(np.zeros((2, 3), np.int32), np.zeros(3, np.int32), num_pages=4, page_size=16)


def test_cu_seqlens_outside_the_rows_or_falling_are_named():
    _validate.check_cu_seqlens(np.array([0, 0, 5, 9], np.int32), total=9)
    _validate.check_cu_seqlens(np.array([2, 5], np.int32), total=9)  # rows 0-1 and 5-8 left unwritten: allowed
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\] = 10 is outside \[0, 9\]"):
        _validate.check_cu_seqlens(np.array([0, 4, 10], np.int32), total=9, name="cu_seqlens_q")
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] = -1 is outside"):
        _validate.check_cu_seqlens(np.array([-1, 4], np.int32), total=9)
    with pytest.raises(ValueError, match=r"must not decrease: cu_seqlens_k\[2\] = 3 is less than cu_seqlens_k\[1\] = 6 "
                                         r"\(sequence 1 would end before it starts\)"):
        _validate.check_cu_seqlens(np.array([0, 6, 3, 9], np.int32), total=9, name="cu_seqlens_k")
    with pytest.raises(ValueError, match=r"1-D"):
        _validate.check_cu_seqlens(np.zeros((2, 2), np.int32), total=9)


def test_non_integer_arrays_are_refused():
    with pytest.raises(TypeError, match="seqlens_k must hold integers, got dtype float32"):
        _validate.check_seqlens_k(np.zeros(3, np.float32), capacity=10)


def test_the_combined_checks_name_each_argument():
    table, lengths = np.array([[0, 1]], np.int32), np.array([17], np.int32)
    _validate.check_decode_inputs(table, lengths, capacity=32, num_pages=2, page_size=16)
    _validate.check_decode_inputs(None, lengths, capacity=17)
    with pytest.raises(ValueError, match=r"seqlens_k\[0\] = 17 is outside \[0, 16\]"):
        _validate.check_decode_inputs(None, lengths, capacity=16)
    with pytest.raises(ValueError, match="needs seqlens_k"):
        _validate.check_decode_inputs(table, None, capacity=32, num_pages=2, page_size=16)
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 1 is outside \[0, 1\)"):
        _validate.check_decode_inputs(table, lengths, capacity=32, num_pages=1, page_size=16)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[1\] = 8"):
        _validate.check_varlen_inputs(np.array([0, 3], np.int32), np.array([0, 8], np.int32), total_q=3, total_k=7)


@pytest.mark.parametrize("value,expected", (("1", True), ("0", False), ("", False)))
def test_the_environment_switch_is_read_at_import(value, expected):
    code = "from cuflash import _api, _validate; print(_validate.enabled(), _api._VALIDATE)"
    env = {"CUFLASH_VALIDATE": value, "PATH": ""}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.split() == [str(expected)] * 2  # the CuPy front end's switch is the one read


@requires_gpu
def test_device_arrays_are_copied_to_the_host_except_while_a_stream_captures():
    import cupy

    lengths = cupy.asarray(np.array([0, 9], np.int32))
    with pytest.raises(ValueError, match=r"seqlens_k\[1\] = 9 is outside \[0, 8\]"):
        _validate.check_seqlens_k(lengths, capacity=8)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[1\] = 9"):
        _validate.check_varlen_inputs(lengths, lengths, total_q=8, total_k=9)
    marker = cupy.zeros(4, np.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        stream.begin_capture()
        try:
            _validate.check_seqlens_k(lengths, capacity=8)  # a host copy would break the capture: skipped
            marker.fill(1)
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert int(marker.sum()) == 4
