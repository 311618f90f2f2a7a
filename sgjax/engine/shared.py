"""What engines in one process share (the jitted step and readouts, the loaded weights), made once per key and
kept only while an engine holds it, plus the few most recently asked for.

Why bounded: each compiled step program holds its machine code in memory maps of its own (a few hundred for a
CPU step), and a process may hold at most `vm.max_map_count` (65530 by default) of them. Unbounded caches kept
every engine's programs and weights for the life of the process, so a process that made many engines (a test
worker: 33k maps after four test files) reached the limit; XLA then failed to link the next program and the
process died unwinding that error (issue #42). An engine holds what it uses, so dropping the cache's own
reference frees it once the last engine using it is gone.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from typing import Any, Callable, Hashable

# The share of the kernel's memory-map limit past which an engine drops its step's compiled shapes before compiling
# a new one (engine/runner.py): one step may hold hundreds of shapes over a long run, ~250 maps each for SmolLM2.
MAP_BUDGET = 0.5


class Held:
    """A value the cache can hold weakly (a tuple or a dict cannot be weakly referenced): engines keep this."""

    __slots__ = ("value", "__weakref__")

    def __init__(self, value: Any):
        self.value = value


class Shared:
    """make(*key) once per key while anything holds the result (values must be weakly referenceable), and the
    `keep` most recently asked-for results held here too, so an engine made again with the same settings (a test
    module after another, a sweep, a restarted engine) reuses them."""

    def __init__(self, make: Callable[..., Any], keep: int):
        self.make, self.keep = make, keep
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._recent: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.RLock()

    def __call__(self, *key: Hashable) -> Any:
        with self._lock:
            value = self._live.get(key)
            return self.put(key, self.make(*key) if value is None else value)

    def put(self, key: tuple, value: Any) -> Any:
        """Share `value` under `key`, and count it as the latest asked for."""
        with self._lock:
            self._live[key] = value
            self._recent[key] = value
            self._recent.move_to_end(key)
            while len(self._recent) > self.keep:
                self._recent.popitem(last=False)
            return value

    def forget(self, key: tuple) -> None:
        """Stop sharing `key`'s value (its holders keep theirs): the next ask makes it anew."""
        with self._lock:
            self._live.pop(key, None)
            self._recent.pop(key, None)

    def drop_recent(self) -> None:
        """Let go of the cache's own references: what no engine holds is freed."""
        with self._lock:
            self._recent.clear()


def memory_maps() -> int | None:
    """The memory maps this process holds now (None where /proc is missing)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def max_memory_maps() -> int | None:
    """The kernel's limit on a process's memory maps (vm.max_map_count; None where it cannot be read)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def maps_near_limit(budget: float | None = None) -> tuple[int, int] | None:
    """(maps held, limit) when this process holds more than `budget` (MAP_BUDGET) of the limit, else None."""
    limit, held = max_memory_maps(), memory_maps()
    if limit is None or held is None or held <= (MAP_BUDGET if budget is None else budget) * limit:
        return None
    return held, limit
