"""Host-side state shared between calls (mok_cute/shared_state.py): the LRU bound, what it
hands back to retire, pinned values (CPU); the stream ordering's no-op paths (CPU); the GPU
behaviour is in tests/test_moe_forward_gpu.py (two streams, graph capture, many batch sizes)."""

import pytest
import torch

from mok_cute.shared_state import BoundedCache, StreamOrder, capturing


def test_bounded_cache_hands_back_the_least_recently_used():
    cache = BoundedCache(2)
    assert cache.put("a", 1) == [] and cache.put("b", 2) == []
    assert cache.get("a") == 1  # "a" is now the most recently used
    assert cache.put("c", 3) == [2] and "b" not in cache and len(cache) == 2
    assert cache.get("missing") is None
    assert cache.put("a", 10) == []  # a new value for a key: nothing evicted
    assert cache.items() == [("c", 3), ("a", 10)]
    cache.max_entries = 1
    assert cache.put("d", 4) == [3, 10] and cache.values() == [4]
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="max_entries: expected >= 1, got 0"):
        BoundedCache(0)


def test_bounded_cache_keeps_pinned_values_past_its_bound():
    """Values a CUDA graph captured (``pinned``) are never evicted: the next least recently
    used unpinned one goes, and with none left the cache grows past its bound."""
    cache = BoundedCache(2, pinned=lambda v: v.startswith("graph"))
    cache.put(1, "graph a")
    cache.put(2, "b")
    assert cache.put(3, "c") == ["b"] and cache.values() == ["graph a", "c"]
    assert cache.put(4, "graph d") == ["c"] and cache.values() == ["graph a", "graph d"]
    assert cache.put(5, "e") == [] and len(cache) == 3  # nothing evictable but itself
    assert cache.put(6, "f") == ["e"] and cache.values() == ["graph a", "graph d", "f"]


def test_retire_all_retires_every_value_and_raises_the_first_error():
    from mok_cute.shared_state import retire_all

    done = []

    def retire(v):
        done.append(v)
        if v in ("b", "c"):
            raise RuntimeError(f"pending error of {v}")

    with pytest.raises(RuntimeError, match="pending error of b"):
        retire_all(["a", "b", "c", "d"], retire)
    assert done == ["a", "b", "c", "d"]
    retire_all([], retire)


def test_stream_order_does_nothing_off_cuda():
    order = StreamOrder()
    with order.around("cpu"):
        pass
    order.enter(torch.device("cpu"))
    order.leave("cpu")
    order.wait()  # no launch recorded: returns at once
    assert not capturing() or torch.cuda.is_available()
