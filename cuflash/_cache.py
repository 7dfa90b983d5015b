"""The plan cache: every plan a call can look up, in one bounded, thread-safe store.

Each entry is keyed by a tuple whose first item names its kind: a plan by its signature
(``("forward", ...)``, ``("backward", ...)``, ``("decode", ...)``), or a front end's shortcut
from the raw arguments of a call it has seen (``("cupy forward", shapes, byte strides, ...)``),
which lets a repeated call skip even the normalisation of its arguments. A key names the
device wherever what it holds is bound to one. Plans hold what a signature decides under the
choices in force (cuflash/_config.py): when a switch or a tile override changes those choices
(``_config.bump_generation``), the cache empties, so no plan of another generation is found.

A hit is one dict lookup, without a lock (``PLANS.recent.get(key)``, bound once by the front
ends); building and inserting take the lock, so a plan is built once however many threads ask
for it. Bounded like a least-recently-used cache without bookkeeping on a hit: inserts go into
``recent``; when it holds half the bound, its entries become the ``older`` ones (the previous
older ones are dropped), and an older entry found again moves back into ``recent``. So an entry
used at least once every ``bound // 2`` insertions is never dropped, and at most ``bound``
entries (a plan may keep a block mask's device lists alive) are held.
"""

from __future__ import annotations

import threading

from . import _config

MAX_PLANS = 1024


class PlanCache:
    """One bounded store of plans (see the module's docstring)."""

    def __init__(self, bound: int):
        self.recent: dict = {}  # the hit path's dict: never replaced, only cleared
        self._older: dict = {}
        self._bound = bound
        # Reentrant: a plan's build may look up another plan (its decoding route, for one).
        self._lock = threading.RLock()

    def get(self, key):
        """The entry under ``key``, or None."""
        entry = self.recent.get(key)
        if entry is None and self._older:
            with self._lock:
                entry = self._older.pop(key, None)
                if entry is not None:
                    self._insert(key, entry)
        return entry

    def get_or_build(self, key, build, *args):
        """The entry under ``key``, made by ``build(*args)`` (once, under the lock) if there is
        none; a key of None (a call whose arguments cannot be hashed) builds every time. (The
        arguments, not a closure: a lambda in a front end's call would make every local it
        reads a cell, which costs that call's hit path too.)"""
        if key is None:
            return build(*args)
        entry = self.get(key)
        if entry is None:
            with self._lock:
                entry = self.get(key)
                if entry is None:
                    generation = _config.GENERATION[0]
                    entry = build(*args)
                    if generation == _config.GENERATION[0]:  # else built under choices no longer in force
                        self._insert(key, entry)
        return entry

    def _insert(self, key, entry):
        if key not in self.recent and len(self.recent) >= self._bound // 2:
            self._older = dict(self.recent)  # a copy: ``recent`` stays the dict the front ends hold
            self.recent.clear()
        self._older.pop(key, None)
        self.recent[key] = entry

    def clear(self):
        with self._lock:
            self.recent.clear()
            self._older.clear()

    def kinds(self) -> dict:
        """How many entries of each kind (the first item of their keys) are held."""
        with self._lock:
            counts: dict = {}
            for key in (*self.recent, *self._older):
                counts[key[0]] = counts.get(key[0], 0) + 1
            return counts

    def __len__(self):
        return len(self.recent) + len(self._older)


PLANS = PlanCache(MAX_PLANS)
_config.on_generation_change(PLANS.clear)


def plan_counts() -> tuple:
    """(forward, backward) plans held (built once per signature; the front ends' shortcuts to
    them are not counted)."""
    kinds = PLANS.kinds()
    return kinds.get("forward", 0), kinds.get("backward", 0)


def clear():
    """Drop every plan (the next call of each signature builds its plan again)."""
    PLANS.clear()
