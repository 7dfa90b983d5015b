"""scripts/soak.py without a GPU: its arguments, the signatures it calls, the flatness rule and
the summary."""

import collections

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def soak():
    return load_script("soak")


def test_arguments_and_their_defaults(soak, tmp_path):
    args = soak.parse_args([])
    assert (args.seconds, args.threads, args.check_every, args.seed) == (120.0, 4, 8, 0)
    args = soak.parse_args(["--seconds", "30", "--threads", "2", "--out", str(tmp_path), "--check-every", "1"])
    assert (args.seconds, args.threads, args.out, args.check_every) == (30.0, 2, tmp_path, 1)
    for bad in (["--seconds", "0"], ["--threads", "0"], ["--check-every", "0"], ["--threads", "two"]):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)


def test_a_few_hundred_distinct_signatures_of_every_kind(soak):
    signatures = soak.signatures(0)
    assert 200 <= len(signatures) == len(set(signatures)) <= 500
    kinds = collections.Counter(s.kind for s in signatures)
    assert set(kinds) == {"train", "decode", "paged", "varlen"} and min(kinds.values()) >= 30
    assert signatures == soak.signatures(0) and signatures != soak.signatures(1)
    assert any(s.heads[0] > s.heads[1] for s in signatures if s.kind == "train")  # grouped heads
    assert any(s.nq != s.nk for s in signatures if s.kind == "train")
    assert any(s.window for s in signatures if s.kind == "train") and any(s.causal for s in signatures)
    assert {"float16", "bfloat16", "float32"} <= {s.dtype for s in signatures}


def test_decoding_steps_grow_the_cache_one_key_a_step(soak):
    decode = [s for s in soak.signatures(0) if s.kind == "decode"]
    for stream in {(s.dtype, s.batch, s.heads, s.d) for s in decode}:
        lengths = [s.nk for s in decode if (s.dtype, s.batch, s.heads, s.d) == stream]
        assert lengths == list(range(lengths[0], lengths[0] + len(lengths))) and lengths[0] >= 64


def test_signatures_are_calls_cuflash_takes(soak):
    """Every signature passes the host-side checks of its path: head dims, grouped heads,
    decoding's limits, page sizes, packed lengths of 0 and 1."""
    from cuflash import _checks, _constants, _tiles

    signatures = soak.signatures(0)
    for s in signatures:
        hq, hk = s.heads
        assert hq % hk == 0 and s.dtype in _constants.SUPPORTED_DTYPES
        if s.kind == "varlen":
            assert len(s.lengths) == s.batch
            continue
        _checks.check_head_dims((s.batch, hq, s.nq, s.d), (s.batch, hk, s.nk, s.d), (s.batch, hk, s.nk, s.d))
        if s.kind in ("decode", "paged"):
            assert s.dtype in _constants.TENSOR_CORE_DTYPES and s.d <= _tiles.DECODE_HEAD_DIM_BUCKETS[-1]
            assert 1 <= s.nq <= _constants.MAX_DECODE_QUERIES
        if s.kind == "paged":
            assert s.page_size in _constants.DECODE_PAGE_SIZES and s.nk % s.page_size == 0
    packed = [n for s in signatures if s.kind == "varlen" for pair in s.lengths for n in pair]
    assert 0 in packed and 1 in packed


def test_paged_lengths_grow_and_come_round_to_zero_and_the_capacity(soak):
    capacity = 64
    lengths = [soak.paged_lengths(step, 3, capacity) for step in range(capacity + 1)]
    assert all(x.dtype == "int32" and x.shape == (3,) for x in lengths)
    for b in range(3):
        assert sorted(int(x[b]) for x in lengths) == list(range(capacity + 1))
    assert int(lengths[1][0]) == int(lengths[0][0]) + 1


def _samples(pool_held, plans, pool_used=None):
    pool_used = pool_used or [0] * len(pool_held)
    return [{"t": i, "pool used": u, "pool held": p, "plans 0": n}
            for i, (u, p, n) in enumerate(zip(pool_used, pool_held, plans))]


def test_flatness(soak):
    mib = 2**20
    steady = _samples([900 * mib, 1000 * mib, 990 * mib, 1000 * mib, 1010 * mib, 1040 * mib], [5] * 6)
    verdict = soak.flatness(steady, 0)
    assert verdict["pool held"] == {"first": 1000 * mib, "last": 1040 * mib, "flat": True, "judged": True}
    assert verdict["plans 0"]["flat"] and soak.memory_flat(verdict)
    growing = _samples([100 * mib, 200 * mib, 300 * mib, 400 * mib, 500 * mib, 600 * mib], [1, 2, 3, 4, 5, 6])
    verdict = soak.flatness(growing, 0)
    assert not verdict["pool held"]["flat"] and not verdict["plans 0"]["flat"] and not soak.memory_flat(verdict)
    one_more_plan = _samples([mib] * 6, [5, 5, 5, 5, 5, 6])
    assert not soak.flatness(one_more_plan, 0)["plans 0"]["flat"]  # plan caches: no growth at all
    assert not soak.memory_flat(soak.flatness(one_more_plan, 0))
    assert soak.flatness(steady, 4) is None and not soak.memory_flat(None)  # too few samples after warm-up
    # samples before the start (warm-up) are not judged
    assert soak.flatness(_samples([1, 5000 * mib, mib, mib, mib], [1, 9, 9, 9, 9]), 2)["plans 0"]["flat"]


def test_bytes_in_use_are_reported_but_not_judged(soak):
    """The pool's bytes in use, sampled while threads have calls in flight, rose 333 -> 512 MiB
    in a soak whose held pool, device memory, host RSS and plans were flat: that passes; the
    held pool growing by 369 MiB fails."""
    mib = 2**20
    in_flight = _samples([4131 * mib] * 6, [280] * 6, pool_used=[333 * mib, 300 * mib, 200 * mib, 100 * mib,
                                                                  512 * mib, 400 * mib])
    verdict = soak.flatness(in_flight, 0)
    assert verdict["pool used"] == {"first": 333 * mib, "last": 512 * mib, "flat": False, "judged": False}
    assert soak.memory_flat(verdict)
    held_grows = _samples([4131 * mib] * 4 + [4500 * mib] * 2, [280] * 6)
    assert not soak.memory_flat(soak.flatness(held_grows, 0))


def test_summary_names_the_counts_and_the_verdict(soak):
    result = {"seconds": 120.4, "threads": 4, "signatures": 310, "calls": {"train": 10, "paged": 5},
              "checks": {"train: forward rows": 2}, "error_count": 0, "wrong_count": 1, "warm_at": 25.0,
              "unseen": 0, "flat": {"pool held": {"first": 2**30, "last": 2**30, "flat": True, "judged": True},
                                    "pool used": {"first": 2**20, "last": 2**21, "flat": False, "judged": False}},
              "graph": {"steps": ["paged decoding"], "replays": 7, "mismatches": 0}, "passed": False}
    text = "\n".join(soak.summary_lines(result))
    assert "120 s, 4 threads, 310 signatures, 15 (paged 5, train 10) calls" in text
    assert "errors: 0; wrong results: 1" in text and "pool held: 1024 MiB -> 1024 MiB flat" in text
    assert "pool used: 1 MiB -> 2 MiB (calls in flight: not judged)" in text and "GROWS" not in text
    assert "7 replays, 0 mismatches" in text and text.endswith("verdict: FAIL")
    result.update(warm_at=None, unseen=3)
    assert "not judged: 3 signatures never called" in "\n".join(soak.summary_lines(result))
