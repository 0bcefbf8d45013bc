"""Reusing what other requests scored: PromptScores against block records, and the KV
cache manager's partly shared blocks (no JAX)."""

from jaxllm.core.block_contents import BlockContent, BlockContents
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.prompt_scores import PromptScores
from jaxllm.core.request import Request
from jaxllm.messages import LogprobsLists

BS = 4


def rows_for(tokens: list[int], k: int, start: int = 0, end: int | None = None) -> LogprobsLists:
    """Fake rows that name what they score: row p scores tokens[p + 1] at -(p + 1)."""
    end = len(tokens) - 1 if end is None else end
    ps = range(start, end)
    return LogprobsLists([[tokens[p + 1]] + [900 + j for j in range(k)] for p in ps],
                         [[-(p + 1.0)] + [-0.5 * (j + 1) for j in range(k)] for p in ps], [p + 2 for p in ps])


def scored(tokens: list[int], k: int) -> PromptScores:
    s = PromptScores(k)
    s.extend(rows_for(tokens, k))
    return s


def records_of(tokens: list[int], scores: PromptScores | None, num_written: int | None = None) -> list[BlockContent]:
    """The records a writer of `tokens` leaves, as KVCacheManager.record_contents
    makes them (parents are not looked at here)."""
    n = len(tokens) if num_written is None else num_written
    out = []
    for j in range(-(-n // BS)):
        block = tokens[j * BS:min((j + 1) * BS, n)]
        rows = [] if scores is None else ([None] if j == 0 else []) + scores.rows[max(j * BS - 1, 0):j * BS - 1 + len(block)]
        out.append(BlockContent(j + 1, b"", block, rows, -1 if scores is None else scores.k))
    return out


def test_a_shared_context_is_reused_to_the_token_before_the_first_difference():
    context = list(range(10, 21))  # 11 tokens: blocks 0, 1 full, then 3 tokens of block 2
    a = context + [50, 51, 52]
    records = records_of(a, scored(a, 2))
    b = context + [60, 61]
    fresh = PromptScores(2)
    # KV is shared for 11 tokens, but skipping token 10 needs the row predicting
    # token 11 (60 here, 50 in a): b computes position 10 itself
    assert fresh.reusable(records, b, len(b), BS, limit=11) == 10
    fresh.fill(records, b, len(b), BS, 10)
    want = rows_for(b, 2, 0, 10)  # rows predicting tokens 1..10
    assert fresh.rows == list(zip(want.token_ids, want.logprobs, want.ranks))
    # a prompt that also shares token 11 skips position 10 too
    c = a[:12] + [70]
    assert PromptScores(2).reusable(records, c, len(c), BS, limit=12) == 11


def test_rows_with_fewer_alternatives_do_not_serve_more_and_unscored_writers_serve_none():
    a = list(range(30, 43))
    records = records_of(a, scored(a, 1))
    assert PromptScores(3).reusable(records, a, len(a), BS, limit=12) == 0
    assert PromptScores(1).reusable(records, a, len(a), BS, limit=12) == 12
    fewer = PromptScores(0)
    fewer.fill(records, a, len(a), BS, 8)
    assert len(fewer.rows) == 8 and all(len(ids) == 1 for ids, _, _ in fewer.rows)
    assert PromptScores(0).reusable(records_of(a, None), a, len(a), BS, limit=12) == 0


def test_rows_already_emitted_are_not_needed_again_and_generated_tokens_need_none():
    a = list(range(5, 18))
    assert scored(a, 1).reusable([], a, len(a), BS, limit=12) == 12  # a preempted, fully scored request
    partial = PromptScores(1)
    partial.extend(rows_for(a, 1, 0, 6))  # rows predicting tokens 1..6
    assert partial.reusable([None, None], a, len(a), BS, limit=8) == 6
    generated = a + [99, 98]  # the prompt is a; 2 tokens generated before a preemption
    done = scored(a, 1)
    assert done.reusable([], generated, len(a), BS, limit=14) == 14


def test_take_unsent():
    s = PromptScores(1)
    assert s.take_unsent() is None
    s.extend(rows_for(list(range(9)), 1, 0, 3))
    assert len(s.take_unsent().ranks) == 3 and s.take_unsent() is None


def make_request(request_id: str, prompt: list[int], **kwargs) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(prompt), **kwargs)


def run(manager: KVCacheManager, request: Request) -> list:
    """Admit with the longest reusable prefix, compute the rest, record it; the new
    blocks."""
    prefix = manager.get_computed_prefix(request)
    num_new = request.num_tokens - prefix.num_tokens
    new = manager.allocate_slots(request, num_new, prefix.num_tokens, prefix.blocks, prefix.num_tail_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_tokens)
    manager.record_contents(request, num_new)
    return prefix, new


def test_a_partly_shared_block_is_found_copied_and_forgotten_on_reuse():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # block 0 full, block 1 = [5, 6, 7]
    prefix, _ = run(manager, a)
    assert prefix.num_tokens == 0
    b = make_request("b", [1, 2, 3, 4, 5, 6, 9, 9])
    prefix, new = run(manager, b)
    a_blocks = manager.get_block_ids("a")
    assert prefix.num_tokens == 6 and prefix.num_tail_tokens == 2 and prefix.tail.block_id == a_blocks[1]
    assert manager.get_block_ids("b")[0] == a_blocks[0] and new[0].block_id != a_blocks[1]
    # the lookup never covers the last token, and another salt never matches
    assert manager.get_computed_prefix(make_request("c", [1, 2, 3, 4, 5, 6])).num_tokens == 5
    assert manager.get_computed_prefix(make_request("d", [1, 2, 3, 9], cache_salt="x")).num_tokens == 0
    assert manager.get_computed_prefix(make_request("e", [1, 2, 9])).num_tokens == 2  # a tail in block 0
    # once a's tail block is handed out again, its content is gone
    b_blocks = manager.get_block_ids("b")
    manager.free(a)
    manager.free(b)
    taken, i = [], 0
    while a_blocks[1] not in taken:
        run(manager, make_request(f"x{i}", [50 + i] * 3))
        taken += manager.get_block_ids(f"x{i}")
        i += 1
    assert manager.block_pool.contents.get(a_blocks[1]).tokens == [50 + i - 1] * 3  # its new writer's
    tail = manager.get_computed_prefix(make_request("f", [1, 2, 3, 4, 5, 6, 1])).tail
    assert tail.block_id == manager.block_pool.blocks[b_blocks[1]].block_id  # b's block [5, 6, 9, 9]


def test_block_contents_index_by_parent():
    contents = BlockContents()
    contents.set(BlockContent(3, b"p", [1, 2], [], -1))
    contents.set(BlockContent(4, b"p", [1, 5], [], -1))
    contents.set(BlockContent(3, b"q", [7], [], -1))  # block 3 reused under another parent
    assert [c.block_id for c in contents.children(b"p")] == [4]
    assert [c.tokens for c in contents.children(b"q")] == [[7]]
    contents.forget(4)
    assert contents.children(b"p") == [] and len(contents) == 1
