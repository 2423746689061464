"""``server.lru.LRUCache``: bounded, least recently used out."""

from server.lru import LRUCache


def test_the_least_recently_used_entry_goes_first() -> None:
    cache: LRUCache[int, str] = LRUCache(2)
    cache.put(1, "a")
    cache.put(2, "b")
    assert cache.get(1) == "a"  # 1 is now the most recent
    cache.put(3, "c")
    assert (cache.get(1), cache.get(2), cache.get(3)) == ("a", None, "c")
    cache.put(3, "c2")  # replacing keeps the size
    assert (cache.get(1), cache.get(3)) == ("a", "c2")
