"""The encoder cache's slots (issue 65): an image is found by its hash while it is
encoded; a slot held by a request is never given to another image; once nobody holds
it, it is reused by a later request with the same image (a hit) until a new image
needs it, least recently used first."""

from jaxllm.core.encoder_cache_manager import EncoderCacheManager


def test_holds_hits_and_least_recently_used_eviction():
    cache = EncoderCacheManager(num_slots=2)
    a = cache.allocate("a", "r1")
    b = cache.allocate("b", "r2")
    assert {a, b} == {0, 1} and not cache.can_allocate()  # both held
    assert cache.lookup("a", "r3") == a  # another request finds it: a hit, held by both
    cache.release("a", "r1")
    assert not cache.can_allocate()  # r3 still holds it
    cache.release("a", "r3")
    cache.release("b", "r2")
    assert cache.lookup("b", "r4") == b  # found after being let go: b is the most recently used
    c = cache.allocate("c", "r5")  # evicts a, the least recently used free one
    assert c == a and cache.lookup("a", "r6") is None and cache.stats.encoded == 3
    cache.release("b", "r4")
    cache.release("b", "r4")  # twice: no effect
    assert list(cache.free) == ["b"]
