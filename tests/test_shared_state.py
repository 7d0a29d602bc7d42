"""Host-side state shared between calls (mok_cute/shared_state.py): the LRU bound and its
eviction callback, and the stream ordering's no-op paths (CPU); the GPU behaviour is in
tests/test_moe_forward_gpu.py (two streams, graph capture, many batch sizes)."""

import pytest
import torch

from mok_cute.shared_state import BoundedCache, StreamOrder, capturing


def test_bounded_cache_evicts_the_least_recently_used_into_its_callback():
    evicted = []
    cache = BoundedCache(2, on_evict=evicted.append)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recently used
    cache.put("c", 3)
    assert evicted == [2] and "b" not in cache and len(cache) == 2
    assert cache.get("missing") is None
    cache.put("a", 10)  # a new value for a key: no eviction
    assert evicted == [2] and cache.items() == [("c", 3), ("a", 10)]
    cache.max_entries = 1
    cache.put("d", 4)
    assert evicted == [2, 3, 10] and cache.values() == [4]
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="max_entries: expected >= 1, got 0"):
        BoundedCache(0)


def test_bounded_cache_keeps_pinned_values_past_its_bound():
    """Values a CUDA graph captured (``pinned``) are never evicted: the next least recently
    used unpinned one goes, and with none left the cache grows past its bound."""
    evicted = []
    cache = BoundedCache(2, on_evict=evicted.append, pinned=lambda v: v.startswith("graph"))
    cache.put(1, "graph a")
    cache.put(2, "b")
    cache.put(3, "c")
    assert evicted == ["b"] and cache.values() == ["graph a", "c"]
    cache.put(4, "graph d")
    assert evicted == ["b", "c"] and cache.values() == ["graph a", "graph d"]
    cache.put(5, "e")  # nothing evictable but itself: kept, past the bound
    assert evicted == ["b", "c"] and len(cache) == 3
    cache.put(6, "f")
    assert evicted == ["b", "c", "e"] and cache.values() == ["graph a", "graph d", "f"]


def test_stream_order_does_nothing_off_cuda():
    order = StreamOrder()
    with order.around("cpu"):
        pass
    order.enter(torch.device("cpu"))
    order.leave("cpu")
    order.wait()  # no launch recorded: returns at once
    assert not capturing() or torch.cuda.is_available()
