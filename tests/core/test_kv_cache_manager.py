"""Tests of jaxllm.core.kv_cache_manager.KVCacheManager: unit tests and a hypothesis
state machine that plays scheduler against a simulated KV cache."""

from collections import Counter

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.kv_cache_utils import BlockHash, hash_token_blocks
from jaxllm.core.request import Request


def make_request(request_id: str, prompt: list[int], **kwargs) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(prompt), **kwargs)


def computed_blocks(manager: KVCacheManager, request: Request) -> tuple[list, int]:
    """The request's cached whole blocks and their tokens, the lookup counted."""
    hits = manager.longest_cache_hit(request)
    manager.count_lookup(request, len(hits) * manager.block_size)
    return hits, len(hits) * manager.block_size


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """Prefix-cache lookup + allocation of a whole prompt (or a first chunk), as the
    scheduler does; returns (hit blocks, hit tokens, new blocks)."""
    hits, num_hit_tokens = computed_blocks(manager, request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
    return hits, num_hit_tokens, new_blocks


def compute(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Pretend the model computed ``num_tokens`` more tokens, then cache full blocks."""
    request.num_computed_tokens += num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


# ---- unit tests --------------------------------------------------------------------------


def test_identical_prefixes_share_physical_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    prefix = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = make_request("a", prefix + [1, 2, 3])
    hits, num_hit, new_blocks = admit(manager, a)
    assert (hits, num_hit) == ([], 0)
    assert [b.block_id for b in new_blocks] == [1, 2, 3, 4]
    assert a.num_cached_tokens == 0
    compute(manager, a, a.num_tokens)

    b = make_request("b", prefix + [7, 7, 7, 7, 7])
    hits, num_hit, new_blocks = admit(manager, b)
    assert num_hit == 8 and b.num_cached_tokens == 8
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")[:2] == [1, 2]
    assert manager.get_block_ids("b")[2:] == [5, 6]
    assert [blk.ref_cnt for blk in manager.get_blocks("a")] == [2, 2, 1, 1]
    assert manager.num_cached_blocks == {"a": 3, "b": 2}
    assert manager.num_used_blocks == 6


def test_tokens_held_counts_shared_blocks_once():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    prefix = list(range(100, 110))  # 2 full blocks + 2 tokens
    a, b = make_request("a", prefix + [1, 2, 3]), make_request("b", prefix + [7, 7, 7, 7, 7])
    admit(manager, a)
    compute(manager, a, a.num_tokens)  # 13 tokens in 4 blocks
    admit(manager, b)
    compute(manager, b, b.num_tokens - b.num_computed_tokens)  # 15 tokens, 8 of them in a's blocks
    assert manager.num_used_blocks == 6
    # distinct tokens: a's 13 + b's 7 of its own; not 13 + 15
    assert manager.num_tokens_held([a, b]) == 20
    # a request with blocks allocated ahead of its computed tokens: those slots are empty
    c = make_request("c", [5] * 6)
    admit(manager, c)
    compute(manager, c, 3)
    assert manager.num_tokens_held([a, b, c]) == 23


def test_lookup_never_covers_the_last_token():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly 2 full blocks
    a = make_request("a", prompt)
    admit(manager, a)
    compute(manager, a, 8)
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    b = make_request("b", prompt)
    hits, num_hit, new_blocks = admit(manager, b)
    assert num_hit == 4 and [blk.block_id for blk in hits] == [1]
    assert len(new_blocks) == 1  # block 2 content is recomputed into a new block
    c = make_request("c", prompt + [8])
    _, num_hit, _ = admit(manager, c)
    assert num_hit == 8


def test_hits_on_free_blocks_leave_the_free_queue():
    manager = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(manager, a)
    compute(manager, a, 5)
    manager.free(a)
    assert free_ids(manager) == [4, 5, 3, 2, 1]  # freed tail first
    b = make_request("b", [1, 2, 3, 4, 9])
    hits, num_hit, new_blocks = admit(manager, b)
    assert [blk.block_id for blk in hits] == [1, 2] and num_hit == 4
    assert [blk.block_id for blk in new_blocks] == [4]
    assert free_ids(manager) == [5, 3]
    assert [blk.ref_cnt for blk in manager.get_blocks("b")] == [1, 1, 1]
    # a's partial third block (block 3) was never full, so never cached.
    assert manager.block_pool.blocks[3].block_hash is None


def test_free_evicts_the_tail_before_the_prefix():
    manager = KVCacheManager(num_blocks=5, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    admit(manager, a)
    compute(manager, a, 7)
    manager.free(a)
    cached = manager.block_pool.cached_block_hash_to_block
    hashes = hash_token_blocks(a.all_token_ids, 2)
    assert [cached[h].block_id for h in hashes] == [1, 2, 3]
    # One new block evicts a's last full block, not its first.
    b = make_request("b", [9, 9])
    admit(manager, b)
    assert [blk.block_id for blk in manager.get_blocks("b")] == [4]  # the partial block goes first
    c = make_request("c", [8, 8])
    admit(manager, c)
    assert manager.get_block_ids("c") == [3]
    assert hashes[2] not in cached and cached[hashes[0]].block_id == 1


def test_allocation_failure_has_no_side_effects():
    manager = KVCacheManager(num_blocks=6, block_size=4)  # 5 usable blocks
    a = make_request("a", list(range(12)))
    admit(manager, a)
    compute(manager, a, 12)
    manager.free(a)  # 3 free cached blocks
    holder = make_request("h", [50, 51, 52, 53, 54])
    admit(manager, holder)  # takes blocks 4, 5: free queue is a's 3 cached blocks
    # 13 tokens: 3 hit blocks (all free) + 1 new block = 4 blocks > 3 free.
    b = make_request("b", list(range(12)) + [99])
    before = (
        free_ids(manager),
        [(blk.ref_cnt, blk.block_hash) for blk in manager.block_pool.blocks],
        dict(manager.block_pool.cached_block_hash_to_block),
        dict(manager.num_cached_blocks),
    )
    hits, num_hit, new_blocks = admit(manager, b)
    assert num_hit == 12 and new_blocks is None
    after = (
        free_ids(manager),
        [(blk.ref_cnt, blk.block_hash) for blk in manager.block_pool.blocks],
        dict(manager.block_pool.cached_block_hash_to_block),
        dict(manager.num_cached_blocks),
    )
    assert before == after
    assert "b" not in manager.req_to_blocks and b.num_cached_tokens == -1
    # After the holder leaves, the same allocation succeeds and reuses a's blocks.
    manager.free(holder)
    hits, num_hit, new_blocks = admit(manager, b)
    assert [blk.block_id for blk in hits] == [1, 2, 3] and num_hit == 12
    assert manager.get_block_ids("b") == [1, 2, 3, 5]  # holder freed 5 before 4


def test_decode_allocates_a_block_every_block_size_tokens_and_caches_outputs():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", [1, 2, 3])
    _, _, first_blocks = admit(manager, a)
    compute(manager, a, 3)
    allocated = []
    for step in range(9):
        a.append_output_token_ids(10 + step)
        new_blocks = manager.allocate_slots(a, 1)
        allocated.append(len(new_blocks))
        compute(manager, a, 1)
    assert allocated == [0, 1, 0, 0, 0, 1, 0, 0, 0]
    assert [b.block_id for b in first_blocks] == [1]  # returned lists are not the block table
    assert a.num_computed_tokens == 12 and len(manager.get_blocks("a")) == 3
    assert len(a.block_hashes) == 3 and len(manager.block_pool.cached_block_hash_to_block) == 3
    # Preempt and resume: the request hits its own blocks, output tokens included.
    manager.free(a)
    a.num_computed_tokens = 0
    a.append_output_token_ids(99)
    hits, num_hit, _ = admit(manager, a)
    assert num_hit == 12 and [blk.block_id for blk in hits] == [1, 2, 3]
    assert a.num_cached_tokens == 0  # set on the first scheduling only


def test_extra_keys_isolate_cache_entries():
    manager = KVCacheManager(num_blocks=32, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    base = make_request("base", prompt)
    admit(manager, base)
    compute(manager, base, 5)
    for i, kwargs in enumerate([{"cache_salt": "x"}, {"lora_id": 1}, {"lora_id": 1, "cache_salt": "x"}]):
        req = make_request(f"r{i}", prompt, **kwargs)
        assert admit(manager, req)[1] == 0
        compute(manager, req, 5)
    for i, kwargs in enumerate([{"cache_salt": "x"}, {"lora_id": 1}, {"lora_id": 1, "cache_salt": "x"}, {}]):
        req = make_request(f"again{i}", prompt, **kwargs)
        assert admit(manager, req)[1] == 4


def test_prefix_cache_stats_and_usage():
    manager = KVCacheManager(num_blocks=11, block_size=4)
    assert (manager.num_usable_blocks, manager.num_free_blocks, manager.usage) == (10, 10, 0.0)
    a = make_request("a", list(range(10)))
    admit(manager, a)
    compute(manager, a, 10)
    b = make_request("b", list(range(9)))
    admit(manager, b)
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 19, 8)
    assert stats.hit_rate == 8 / 19
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert manager.num_used_blocks == 4 and manager.usage == 0.4
    manager.free(a)
    manager.free(b)
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == 10


def test_caching_disabled_computes_no_hash():
    manager = KVCacheManager(num_blocks=10, block_size=2, enable_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(manager, a)
    compute(manager, a, 5)
    manager.free(a)
    b = make_request("b", [1, 2, 3, 4, 5])
    hits, num_hit, new_blocks = admit(manager, b)
    assert (hits, num_hit, len(new_blocks)) == ([], 0, 3)
    compute(manager, b, 5)
    assert a.block_hashes == [] and b.block_hashes == []
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.prefix_cache_stats.requests == 0


def test_check_fits_rejects_requests_larger_than_the_pool():
    manager = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks = 16 tokens
    fits = make_request("fits", list(range(10)))
    manager.check_fits(fits, 16)
    manager.check_fits(fits)
    with pytest.raises(ValueError) as info:
        manager.check_fits(fits, 17)
    message = str(info.value)
    assert "'fits'" in message and "needs 5 KV cache blocks" in message
    assert "17 tokens" in message and "only 4 usable blocks" in message
    too_long = make_request("too-long", list(range(17)))
    with pytest.raises(ValueError, match="'too-long' needs 5"):
        manager.check_fits(too_long)


def test_stale_hits_are_rejected():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(manager, a)
    compute(manager, a, 5)
    manager.free(a)
    b = make_request("b", [1, 2, 3, 4, 5])
    hits, num_hit = computed_blocks(manager, b)
    assert num_hit == 4
    thief = make_request("thief", [7] * 6)
    admit(manager, thief)  # evicts every free block, the hits included
    with pytest.raises(ValueError, match="evicted or reused"):
        manager.allocate_slots(b, 1, num_hit, hits)


def test_argument_errors():
    manager = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_tokens must be positive"):
        manager.allocate_slots(a, 0)
    with pytest.raises(ValueError, match="without new_computed_blocks"):
        manager.allocate_slots(a, 1, num_new_computed_tokens=2)
    admit(manager, a)
    with pytest.raises(ValueError, match="already holds"):
        computed_blocks(manager, a)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=8, block_size=0)


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(manager, a)
    compute(manager, a, 5)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert admit(manager, make_request("b", [1, 2, 3, 4, 5]))[1] == 0


# ---- property-based: random scheduling against a simulated KV cache ----------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 12  # 11 usable blocks = 44 tokens: a few requests fill the pool
PREFIXES = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 0, 0, 0, 0, 5, 5], [7] * 12]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheMachine(RuleBasedStateMachine):
    """Plays a scheduler: admits requests drawn from shared prefixes, schedules prefill
    chunks and decodes, caches blocks, preempts and finishes requests. The "model"
    writes into ``self.kv[block_id][slot]`` the token prefix ending at that position
    (what a real KV entry depends on), so cache hits can be checked for content."""

    enable_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=self.enable_caching)
        self.waiting: dict[str, Request] = {}  # admitted, holding no blocks
        self.running: dict[str, Request] = {}  # holding blocks
        self.max_tokens: dict[str, int] = {}
        self.kv: dict[int, list[tuple[int, ...] | None]] = {}
        self.hash_content: dict[BlockHash, tuple[str | None, tuple[int, ...]]] = {}
        self.next_id = 0

    # -- helpers --

    def record_hashes(self, request: Request) -> None:
        """Remember what every computed hash stands for (and catch collisions)."""
        tokens = request.all_token_ids
        for i, block_hash in enumerate(request.block_hashes):
            content = (request.cache_salt, tuple(tokens[: (i + 1) * BLOCK_SIZE]))
            assert self.hash_content.setdefault(block_hash, content) == content

    def expected_kv(self, tokens: list[int], block_index: int) -> list[tuple[int, ...]]:
        start = block_index * BLOCK_SIZE
        return [tuple(tokens[: start + s + 1]) for s in range(BLOCK_SIZE)]

    def snapshot(self):
        pool = self.manager.block_pool
        return (
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
            {rid: [b.block_id for b in blocks] for rid, blocks in self.manager.req_to_blocks.items()},
            dict(self.manager.num_cached_blocks),
            {rid: r.num_cached_tokens for rid, r in {**self.waiting, **self.running}.items()},
        )

    def run_step(self, request: Request, num_hit_tokens: int, num_new_tokens: int, data) -> None:
        """Write the KV of the scheduled tokens, advance the request, sample if caught up."""
        blocks = self.manager.get_blocks(request.request_id)
        tokens = request.all_token_ids
        start = request.num_computed_tokens + num_hit_tokens
        for pos in range(start, start + num_new_tokens):
            block = blocks[pos // BLOCK_SIZE]
            slots = self.kv.setdefault(block.block_id, [None] * BLOCK_SIZE)
            slots[pos % BLOCK_SIZE] = tuple(tokens[: pos + 1])
        request.num_computed_tokens = start + num_new_tokens
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(data.draw(st.integers(0, 3), label="sampled token"))
            if len(request.output_token_ids) == self.max_tokens[request.request_id]:
                if data.draw(st.booleans(), label="cache before finishing"):
                    self.manager.cache_blocks(request, request.num_computed_tokens)
                    self.record_hashes(request)
                self.manager.free(request)
                del self.running[request.request_id]

    def allocate(self, request: Request, num_new_tokens: int, hits, num_hit_tokens: int, data) -> bool:
        """allocate_slots, checking the outcome against the pool's free count."""
        manager = self.manager
        held = len(manager.get_blocks(request.request_id))
        num_total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(num_total, BLOCK_SIZE) - held - len(hits))
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        free_before = manager.num_free_blocks
        cached_before = len(manager.block_pool.cached_block_hash_to_block)
        should_fit = num_new_blocks + num_free_hits <= free_before
        before = self.snapshot()
        new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
        if new_blocks is None:
            assert not should_fit
            assert self.snapshot() == before
            event("allocation failed")
            return False
        assert should_fit
        assert len(new_blocks) == num_new_blocks
        assert all(not b.is_null and b.ref_cnt == 1 and b.block_hash is None for b in new_blocks)
        assert manager.num_free_blocks == free_before - num_new_blocks - num_free_hits
        if len(manager.block_pool.cached_block_hash_to_block) < cached_before:
            event("evicted cached blocks")
        self.run_step(request, num_hit_tokens, num_new_tokens, data)
        return True

    # -- rules --

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.sampled_from([4, 8, 12]) | st.integers(0, 12),
        tail=st.just([]) | st.lists(st.integers(0, 3), max_size=10),
        salt=st.sampled_from([None, None, None, "tenant"]),
        max_tokens=st.integers(1, 12),
    )
    def add_request(self, prefix, cut, tail, salt, max_tokens):
        prompt = prefix[:cut] + tail or [0]
        request = make_request(f"r{self.next_id}", prompt, cache_salt=salt)
        self.next_id += 1
        max_len = len(prompt) + max_tokens - 1
        if cdiv(max_len, BLOCK_SIZE) > NUM_BLOCKS - 1:
            with pytest.raises(ValueError, match=request.request_id):
                self.manager.check_fits(request, max_len)
            return
        self.manager.check_fits(request, max_len)
        self.waiting[request.request_id] = request
        self.max_tokens[request.request_id] = max_tokens

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_waiting(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.waiting)), label="waiting request")
        request = self.waiting[request_id]
        hits, num_hit_tokens = computed_blocks(self.manager, request)
        self.record_hashes(request)
        assert num_hit_tokens == len(hits) * BLOCK_SIZE < request.num_tokens
        tokens = request.all_token_ids
        for i, block in enumerate(hits):
            assert self.hash_content[block.block_hash] == (request.cache_salt, tuple(tokens[: (i + 1) * BLOCK_SIZE]))
            assert self.kv[block.block_id] == self.expected_kv(tokens, i)
        if hits:
            event("prefix hit")
        remaining = request.num_tokens - num_hit_tokens
        num_new_tokens = data.draw(st.integers(1, remaining), label="first chunk")
        running_before = dict(self.running)
        self.running[request_id] = request  # run_step may finish it
        del self.waiting[request_id]
        if not self.allocate(request, num_new_tokens, hits, num_hit_tokens, data):
            self.running = running_before
            self.waiting[request_id] = request

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def schedule_running(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.running)), label="running request")
        request = self.running[request_id]
        remaining = request.num_tokens - request.num_computed_tokens
        num_new_tokens = data.draw(st.integers(1, remaining), label="chunk")
        self.allocate(request, num_new_tokens, [], 0, data)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache_blocks(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.running)), label="running request")
        request = self.running[request_id]
        self.manager.cache_blocks(request, request.num_computed_tokens)
        self.record_hashes(request)
        if self.enable_caching:
            assert self.manager.num_cached_blocks.get(request_id, 0) == request.num_computed_tokens // BLOCK_SIZE

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.running)), label="running request")
        request = self.running.pop(request_id)
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.waiting[request_id] = request

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted({**self.running, **self.waiting})), label="aborted")
        request = self.running.pop(request_id, None) or self.waiting.pop(request_id)
        self.manager.free(request)

    # -- invariants --

    @invariant()
    def blocks_are_either_held_or_free_once(self):
        manager = self.manager
        pool = manager.block_pool
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) == pool.free_block_queue.num_free_blocks
        assert set(manager.req_to_blocks) == set(self.running)
        holders: Counter[int] = Counter()
        for request_id, request in self.running.items():
            blocks = manager.get_blocks(request_id)
            assert len({b.block_id for b in blocks}) == len(blocks)
            assert len(blocks) == cdiv(request.num_computed_tokens, BLOCK_SIZE)
            holders.update(b.block_id for b in blocks)
        null = pool.null_block
        assert null.block_id == 0 and null.ref_cnt == 0 and null.block_hash is None
        assert 0 not in holders and 0 not in free
        free_set = set(free)
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in free_set)
        assert manager.num_used_blocks == len(holders)
        assert manager.usage == len(holders) / (NUM_BLOCKS - 1)

    @invariant()
    def cached_blocks_hold_their_content(self):
        pool = self.manager.block_pool
        cached = pool.cached_block_hash_to_block
        assert sum(b.block_hash is not None for b in pool.blocks) == len(cached)
        for block_hash, block in cached.items():
            assert block.block_hash == block_hash
            _, prefix = self.hash_content[block_hash]
            assert self.kv[block.block_id] == self.expected_kv(list(prefix), len(prefix) // BLOCK_SIZE - 1)
        if not self.enable_caching:
            assert not cached
            assert all(not r.block_hashes for r in {**self.waiting, **self.running}.values())

    def teardown(self):
        for request in list(self.running.values()):
            self.manager.free(request)
        pool = self.manager.block_pool
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert self.manager.num_used_blocks == 0 and self.manager.req_to_blocks == {}
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert sorted(b.block_id for b in pool.free_block_queue.get_all_free_blocks()) == list(range(1, NUM_BLOCKS))


class KVCacheMachineNoCaching(KVCacheMachine):
    enable_caching = False


TestKVCacheManagerStateful = KVCacheMachine.TestCase
TestKVCacheManagerStateful.settings = settings(max_examples=250, stateful_step_count=40, deadline=None)
TestKVCacheManagerNoCachingStateful = KVCacheMachineNoCaching.TestCase
TestKVCacheManagerNoCachingStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
