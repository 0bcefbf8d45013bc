"""The hybrid KV cache (jaxllm.kv_cache_groups, jaxllm.core.hybrid_kv_cache_manager):
layer groups, sliding groups freeing the blocks their window no longer sees, prefix
hits every group can serve, and a hypothesis state machine that plays the scheduler
against a simulated cache of every group over one shared pool."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.engine.config import EngineConfig
from jaxllm.kv_cache_groups import cdiv, kv_cache_groups
from tests.support.llm import LAZY

GEMMA3_270M = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]


def make_request(request_id: str, prompt: list[int], **kwargs) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(prompt), **kwargs)


# ---- layout ------------------------------------------------------------------------


def test_gemma3_groups_of_three_layers():
    """Gemma 3 270M: 3 full layers and 15 sliding ones make six groups of three; group
    g's j-th layer stores its K/V in array j."""
    groups = kv_cache_groups(GEMMA3_270M)
    assert groups.group_size == 3 and groups.num_groups == 6
    assert groups.layers[0] == (5, 11, 17) and groups.windows[0] is None
    assert groups.layers[1:] == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert groups.windows[1:] == (512,) * 5
    assert (groups.group_of(12), groups.slot_of(12)) == (4, 1)


def test_one_group_when_layers_attend_alike_or_hybrid_is_off():
    full = kv_cache_groups([None] * 4)
    assert (full.layers, full.windows, full.group_size) == (((0, 1, 2, 3),), (None,), 4)
    every = kv_cache_groups([24] * 4)  # Mistral: every layer slides, and the one group frees
    assert (every.layers, every.windows, every.group_size) == (((0, 1, 2, 3),), (24,), 4)
    off = kv_cache_groups(GEMMA3_270M, hybrid=False)
    assert (off.num_groups, off.windows, off.group_size) == (1, (None,), 18)


def test_uneven_types_leave_a_short_last_group():
    groups = kv_cache_groups([8, None, 8, 8, None, 8, 8])
    assert groups.layers == ((1, 4), (0, 2), (3, 5), (6,)) and groups.group_size == 2


def test_peak_blocks():
    groups = kv_cache_groups(GEMMA3_270M)
    # 8k tokens, block 16, chunks of 512: the full group 512 blocks, each sliding group
    # the window and a chunk: ceil((511 + 512) / 16) + 1 = 65
    assert groups.peak_blocks(8192, 16, 512) == 512 + 5 * 65
    assert groups.peak_blocks(100, 16, 512) == 6 * 7  # shorter than the window: every block
    assert kv_cache_groups(GEMMA3_270M, hybrid=False).peak_blocks(8192, 16, 512) == 512


# ---- sliding-window manager ----------------------------------------------------------


def decode(manager, request: Request, num_tokens: int) -> None:
    """Compute one token at a time, as decode steps do (sampling the token 1)."""
    for _ in range(num_tokens):
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.cache_blocks(request, request.num_computed_tokens)
        request.append_output_token_ids(1)


def test_a_sliding_group_holds_its_window_and_frees_the_rest():
    window, bs = 10, 4
    manager = KVCacheManager(64, bs, sliding_window=window)
    request = make_request("r", [5] * 6)
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 6
    request.append_output_token_ids(1)
    for _ in range(60):
        decode(manager, request, 1)
        blocks = manager.get_blocks("r")
        real = [j for j, b in enumerate(blocks) if not b.is_null]
        assert len(real) <= cdiv(window, bs) + 1
        # held: the blocks the window of the token just computed (position
        # num_computed - 1) read, and no earlier one (freed at the next allocation)
        first = max(request.num_computed_tokens - window, 0)
        assert real == list(range(first // bs, len(blocks)))
    assert manager.num_used_blocks == len(real)
    manager.free(request)
    assert manager.num_used_blocks == 0 and manager.block_pool.null_block.ref_cnt == 0


def test_sliding_hits_need_only_the_window():
    """A sliding group's prefix hit is the longest prefix whose window (the blocks its
    next token reads) is cached; the earlier blocks come back as the null block."""
    window, bs = 6, 4
    manager = KVCacheManager(8, bs, sliding_window=window)  # 7 usable blocks
    prompt = list(range(1, 29))
    first = make_request("a", prompt)
    assert manager.allocate_slots(first, 28) is not None
    first.num_computed_tokens = 28
    manager.cache_blocks(first, 28)
    manager.free(first)  # last block first: the tail is evicted first
    again = make_request("c", prompt + [7, 7])
    prefix = manager.get_computed_prefix(again)
    # 7 full blocks before the last token; a window of 6 reads the last 2 of them
    assert prefix.num_tokens == 28
    assert [b.is_null for b in prefix.blocks] == [True] * 5 + [False] * 2
    other = make_request("b", [9] * 12)  # takes 3 blocks: evicts the prompt's blocks 6, 5, 4
    assert manager.allocate_slots(other, 12) is not None
    manager.free(other)
    prefix = manager.get_computed_prefix(again)
    assert prefix.num_tokens == 16 and [b.is_null for b in prefix.blocks] == [True, True, False, False]
    assert manager.allocate_slots(again, 14, 16, prefix.blocks) is not None
    assert manager.get_block_ids("c")[:2] == [0, 0] and manager.block_pool.null_block.ref_cnt == 0


def test_hybrid_prefix_is_what_every_group_serves():
    """The full group needs every block of the prefix; when it lost one, the hit ends
    there even though the sliding group still holds its window."""
    groups = kv_cache_groups([None, 8])
    manager = HybridKVCacheManager(40, 4, groups, chunk=64)
    prompt = list(range(1, 26))
    a = make_request("a", prompt)
    new = manager.allocate_slots(a, 25)
    assert [len(n) for n in new] == [7, 7]
    a.num_computed_tokens = 25
    manager.cache_blocks(a, 25)
    manager.free(a)
    b = make_request("b", prompt + [3])
    prefix = manager.get_computed_prefix(b)
    assert prefix.num_tokens == 24 and [len(g) for g in prefix.group_blocks] == [6, 6]
    assert sum(not x.is_null for x in prefix.group_blocks[1]) == 2  # the window of 8: two blocks
    # the full group's block 2 evicted: the prefix ends at block 2 (and the sliding group
    # serves that shorter prefix too, from its blocks 0 and 1)
    full_block_2 = prefix.group_blocks[0][2]
    manager.block_pool.uncache([full_block_2])
    prefix = manager.get_computed_prefix(b)
    assert prefix.num_tokens == 8 and [len(g) for g in prefix.group_blocks] == [2, 2]
    new = manager.allocate_slots(b, 26 - 8, 8, prefix.group_blocks)
    assert new is not None and [len(n) for n in new] == [5, 5]
    assert manager.group_block_ids("b")[0][:2] == [blk.block_id for blk in prefix.group_blocks[0]]


def test_hybrid_allocation_is_all_groups_or_none():
    groups = kv_cache_groups([None, 8, 8])  # three groups of one layer
    manager = HybridKVCacheManager(8, 4, groups, chunk=64)  # 7 usable blocks
    a = make_request("a", list(range(1, 10)))  # 3 blocks a group: 9 > 7
    assert manager.allocate_slots(a, 9) is None
    assert manager.num_free_blocks == 7 and manager.group_block_ids("a") == ([], [], [])
    assert [len(n) for n in manager.allocate_slots(a, 8)] == [2, 2, 2]


def test_hybrid_check_fits_counts_the_window_not_the_whole_request():
    groups = kv_cache_groups([None, 16])
    manager = HybridKVCacheManager(70, 4, groups, chunk=8)  # 69 usable
    long = make_request("a", [1] * 200)
    manager.check_fits(long, 200)  # 50 full + ceil((15 + 8) / 4) + 1 = 7
    with pytest.raises(ValueError, match="needs 71 KV cache blocks"):
        manager.check_fits(long, 256)


# ---- state machine ------------------------------------------------------------------

BLOCK_SIZE = 2
NUM_BLOCKS = 24
WINDOWS = (None, 5, 5)  # a full group, two sliding ones (as Gemma's, smaller)
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 1, 0, 0, 5, 5], [7] * 10]


class HybridKVCacheMachine(RuleBasedStateMachine):
    """Plays a scheduler against HybridKVCacheManager: admits requests sharing
    prefixes, schedules chunks and decodes, preempts and finishes. The "model" writes
    into ``kv[block][slot]`` (group, token prefix ending there); before each step the
    positions its queries read (every earlier one in a full group, the window's in a
    sliding one) must be in the request's blocks with that content."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = kv_cache_groups(list(WINDOWS))
        self.manager = HybridKVCacheManager(NUM_BLOCKS, BLOCK_SIZE, self.groups, chunk=6)
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.max_tokens: dict[str, int] = {}
        self.kv: dict[int, list] = {}
        self.next_id = 0

    def check_reads(self, request: Request, start: int, num_new: int) -> None:
        """What the step's queries (positions start .. start + num_new - 1) read is there."""
        tokens = request.all_token_ids
        for g, window in enumerate(self.groups.windows):
            blocks = self.manager.managers[g].get_blocks(request.request_id)
            first = 0 if window is None else max(start - window + 1, 0)
            for pos in range(first, start):
                block = blocks[pos // BLOCK_SIZE]
                assert not block.is_null, (g, pos)
                assert self.kv[block.block_id][pos % BLOCK_SIZE] == (g, tuple(tokens[:pos + 1])), (g, pos)

    def step(self, request: Request, num_hit: int, num_new: int, data) -> None:
        start = request.num_computed_tokens + num_hit
        self.check_reads(request, start, num_new)
        tokens = request.all_token_ids
        for g in range(self.groups.num_groups):
            blocks = self.manager.managers[g].get_blocks(request.request_id)
            for pos in range(start, start + num_new):
                block = blocks[pos // BLOCK_SIZE]
                assert not block.is_null
                self.kv.setdefault(block.block_id, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = (g, tuple(tokens[:pos + 1]))
        request.num_computed_tokens = start + num_new
        self.manager.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(data.draw(st.integers(0, 3), label="sampled"))
            if len(request.output_token_ids) == self.max_tokens[request.request_id]:
                self.manager.free(request)
                del self.running[request.request_id]

    @rule(prompt=st.sampled_from(PROMPTS), cut=st.integers(1, 10), extra=st.lists(st.integers(0, 3), max_size=4),
          max_tokens=st.integers(1, 12))
    def add_request(self, prompt, cut, extra, max_tokens):
        request = make_request(f"r{self.next_id}", prompt[:cut] + extra)
        self.next_id += 1
        try:
            self.manager.check_fits(request, request.num_tokens + max_tokens - 1)
        except ValueError:
            assert self.groups.peak_blocks(request.num_tokens + max_tokens - 1, BLOCK_SIZE, 6) > NUM_BLOCKS - 1
            return
        self.waiting[request.request_id] = request
        self.max_tokens[request.request_id] = max_tokens

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_waiting(self, data):
        request = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)), label="waiting")]
        prefix = self.manager.get_computed_prefix(request)
        num_hit = prefix.num_tokens
        if num_hit:
            event("prefix hit")
        num_new = data.draw(st.integers(1, min(request.num_tokens - num_hit, 6)), label="first chunk")
        free_before = self.manager.num_free_blocks
        if self.manager.allocate_slots(request, num_new, num_hit, prefix.group_blocks) is None:
            assert self.manager.num_free_blocks == free_before and self.manager.group_block_ids(request.request_id) \
                == ([],) * self.groups.num_groups
            event("allocation failed")
            return
        del self.waiting[request.request_id]
        self.running[request.request_id] = request
        self.manager.count_lookup(request, num_hit)
        self.step(request, num_hit, num_new, data)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def schedule_running(self, data):
        request = self.running[data.draw(st.sampled_from(sorted(self.running)), label="running")]
        num_new = data.draw(st.integers(1, min(request.num_tokens - request.num_computed_tokens, 6)), label="chunk")
        if self.manager.allocate_slots(request, num_new) is None:
            event("allocation failed")
            return
        self.step(request, 0, num_new, data)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running)), label="preempted"))
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.waiting[request.request_id] = request

    @invariant()
    def blocks_are_held_or_free_once(self):
        pool = self.manager.block_pool
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) == pool.free_block_queue.num_free_blocks
        holders: Counter[int] = Counter()
        for m, window in zip(self.manager.managers, self.groups.windows):
            assert set(m.req_to_blocks) == set(self.running)
            for request_id, request in self.running.items():
                blocks = m.get_blocks(request_id)
                assert len(blocks) == cdiv(request.num_computed_tokens, BLOCK_SIZE)
                real = [b.block_id for b in blocks if not b.is_null]
                if window is not None and request.num_computed_tokens:
                    # after a step, at most the window of the next token and the chunk
                    assert len(real) <= cdiv(window - 1 + 6, BLOCK_SIZE) + 1
                holders.update(real)
        assert pool.null_block.ref_cnt == 0 and 0 not in free and pool.null_block.block_hash is None
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in set(free))

    def teardown(self):
        for request in list(self.running.values()):
            self.manager.free(request)
        assert self.manager.num_used_blocks == 0
        assert all(b.ref_cnt == 0 for b in self.manager.block_pool.blocks)


TestHybridKVCacheStateful = HybridKVCacheMachine.TestCase
TestHybridKVCacheStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---- through the engine ------------------------------------------------------------


def _generate(path, total: int, memory: str, disable: bool, attention: str, decode_steps: int | None = None):
    """Greedy continuations of two short prompts to `total` tokens each; the most real
    blocks a request held in a sliding group after any step (hybrid only).
    `decode_steps`: num_scheduler_steps (default the engine's)."""
    from jaxllm import LLM, SamplingParams

    # explicit backends: nothing measured at start-up; 16-token steps (the two prompts' 13 tokens in the first):
    # one step shape fewer to compile than 32
    llm = LLM(str(path), max_model_len=total, max_num_seqs=2, max_num_batched_tokens=16, block_size=4,
              kv_cache_memory=memory, disable_hybrid_kv_cache_manager=disable, attention_backend=attention,
              linear_backend="xla", progress=False, **LAZY,
              num_scheduler_steps=decode_steps or EngineConfig().num_scheduler_steps)
    engine = llm.llm_engine
    prompts = [list(range(3, 11)), list(range(40, 45))]
    params = SamplingParams(max_tokens=total - 8, temperature=0, ignore_eos=True)
    engine.add_requests([(str(i), {"prompt_token_ids": p}, params) for i, p in enumerate(prompts)])
    manager, outputs, most = engine.core.kv_cache_manager, {}, 0
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        for m in getattr(manager, "managers", ())[1:]:
            most = max([most] + [sum(not b.is_null for b in blocks) for blocks in m.req_to_blocks.values()])
    assert engine.core.scheduler.num_preemptions == 0  # both ran all along: every step after the first decodes
    return [outputs[str(i)] for i in range(len(prompts))], most


@pytest.mark.parametrize("total,attention", [
    (256, "cpu"),
    pytest.param(4096, "cpu", marks=pytest.mark.slow),
    pytest.param(512, "xla", marks=pytest.mark.slow),
    pytest.param(128, "pallas", marks=pytest.mark.slow),  # interpret mode
])
def test_engine_frees_what_the_window_no_longer_sees(test_models_dir, total, attention):
    """The Gemma-3-shaped test model (a sliding layer of window 12 and a full layer;
    blocks of 4 tokens): two greedy generations to `total` tokens hold at most
    ceil((12 + K - 1) / 4) + 1 blocks each in the sliding group after every step (the
    window and the slots of a call's K decode steps ahead: 4 for K = 1, 5 for the
    default 4), while their
    tokens equal a run whose blocks are never freed. The hybrid run's pool is too small
    to hold the two requests' every block, so freed blocks are reused while the tables
    still name them (their layers never read there)."""
    path = test_models_dir / "gemma3"
    # one float32 layer of a token: K and V, 32 dims = 256 bytes; a block of 4 = 1 KiB
    hybrid_memory = f"{total // 2 + 16}KiB"  # both full tables and 15 blocks more: a sliding block is reused
    got, most = _generate(path, total, hybrid_memory, False, attention)  # about every 8 steps
    # 2 layers x 2 requests; single decode steps (the same tokens by another path, and no decode loops to compile)
    want, _ = _generate(path, total, f"{total + 32}KiB", True, attention, decode_steps=1)
    k = EngineConfig().num_scheduler_steps
    assert most <= cdiv(12 + k - 1, 4) + 1
    assert got == want


@pytest.mark.slow  # 38 s alone, 115 s beside three workers; hits per group: the state machine and the test below
def test_engine_prefix_hits_in_every_group(test_models_dir):
    """Prompts sharing a long prefix (past the window) through the hybrid cache: the
    later ones hit blocks in both groups, and every output equals the run that keeps
    every block and caches nothing."""
    from jaxllm import LLM, SamplingParams

    shared = [(7 * i) % 400 + 3 for i in range(50)]
    prompts = [shared + [5, 6], shared + [9], shared[:37] + [11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = {}
    for disable in (False, True):
        llm = LLM(str(test_models_dir / "gemma3"), max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
                  block_size=4, disable_hybrid_kv_cache_manager=disable, enable_prefix_caching=not disable,
                  attention_backend="cpu", linear_backend="xla", progress=False, **LAZY)
        outs[disable] = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
                         for p in prompts]  # one by one: each later one finds the earlier ones' blocks
        if not disable:
            stats = llm.llm_engine.core.kv_cache_manager.prefix_cache_stats
            assert stats.hits == 48 + 36  # 12 blocks of the shared 50 (the last token's own is computed); 9
    assert outs[False] == outs[True]


@pytest.mark.slow  # 34 s cold; the hybrid manager's hits on recorded prompt rows: its unit tests, by default
def test_engine_prompt_scoring_reuses_whole_blocks(test_models_dir):
    """Requests scoring their prompts (lm-eval's loglikelihood) sharing a prefix: the
    hybrid cache reuses whole blocks whose prompt rows the full group recorded, and the
    prompt logprobs agree with a run that caches nothing (within float32's
    reassociation across step shapes)."""
    from jaxllm import LLM, SamplingParams

    shared = [(7 * i) % 400 + 3 for i in range(50)]
    prompts = [shared + [5, 6], shared + [9], shared[:37] + [11, 12, 13]]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    scores = {}
    for caching in (True, False):
        llm = LLM(str(test_models_dir / "gemma3"), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                  block_size=4, enable_prefix_caching=caching, attention_backend="cpu", linear_backend="xla",
                  progress=False, **LAZY)
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        scores[caching] = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
        if caching:  # whole blocks whose rows are recorded: at least the second prompt's 12
            hits = llm.llm_engine.core.kv_cache_manager.prefix_cache_stats.hits
            assert hits >= 48 and hits % 4 == 0
    for got, want in zip(scores[True], scores[False], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
