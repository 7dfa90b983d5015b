"""The one plan cache (cuflash/_cache.py): bounded, least recently used first out, built once
under concurrent look-ups, emptied when the choices change."""

import threading

from cuflash import _cache, _config


def test_the_bound_holds_and_recently_used_entries_stay():
    cache = _cache.PlanCache(8)
    cache.get_or_build("hot", lambda: "hot plan")
    for i in range(40):
        cache.get_or_build(("cold", i), lambda: i)
        if i % 3 == 0:  # used at least once every bound // 2 insertions
            assert cache.get("hot") == "hot plan"
        assert len(cache) <= 8
    assert cache.get("hot") == "hot plan"
    assert cache.get(("cold", 0)) is None  # unused since: dropped
    assert cache.get(("cold", 39)) == 39


def test_a_hit_is_a_lookup_in_the_recent_dict():
    cache = _cache.PlanCache(8)
    built = []
    assert cache.get_or_build("k", lambda: built.append(1) or "plan") == "plan"
    assert cache.recent.get("k") == "plan" and cache.get_or_build("k", lambda: built.append(1)) == "plan"
    assert built == [1]


def test_older_entries_move_back_to_the_recent_dict():
    cache = _cache.PlanCache(4)
    cache.get_or_build("a", lambda: "A")
    cache.get_or_build("b", lambda: "B")
    cache.get_or_build("c", lambda: "C")  # recent held 2: a and b became the older ones
    assert cache.recent.get("a") is None and cache.get("a") == "A" and cache.recent.get("a") == "A"


def test_unhashable_arguments_build_every_time():
    cache = _cache.PlanCache(8)
    built = []
    for _ in range(3):
        cache.get_or_build(None, lambda: built.append(1))
    assert len(built) == 3 and len(cache) == 0


def test_threads_asking_for_one_plan_build_it_once():
    cache = _cache.PlanCache(64)
    built, start = [], threading.Barrier(8)

    def build():
        built.append(threading.get_ident())
        return object()

    results = []

    def ask():
        start.wait()
        results.append(cache.get_or_build(("forward", 1), build))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len({id(r) for r in results}) == 1


def test_a_change_of_the_choices_empties_the_cache():
    _cache.PLANS.get_or_build(("forward", "test entry"), lambda: "plan")
    assert _cache.PLANS.get(("forward", "test entry")) == "plan"
    with _config.wgmma_forward(False):
        assert _cache.PLANS.get(("forward", "test entry")) is None


def test_a_plan_built_across_a_change_of_the_choices_is_not_kept():
    cache = _cache.PlanCache(8)

    def build():
        _config.bump_generation()  # as a switch flipped by another thread during the build
        return "stale"

    assert cache.get_or_build("k", build) == "stale" and cache.get("k") is None


def test_plan_counts_count_plans_by_kind():
    cache = _cache.PLANS
    before = _cache.plan_counts()
    cache.get_or_build(("forward", "counted"), lambda: "f")
    cache.get_or_build(("cupy forward", "shortcut"), lambda: "f")
    assert _cache.plan_counts() == (before[0] + 1, before[1])
