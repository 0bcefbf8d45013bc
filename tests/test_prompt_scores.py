"""PromptScoresCache: the prompt logprob rows of cached blocks, keyed so that a row is
reused only where every token it depends on matches (no JAX)."""

from jaxllm.core.kv_cache_utils import hash_block_tokens
from jaxllm.core.prompt_scores import PromptScores, PromptScoresCache
from jaxllm.engine.protocol import LogprobsLists

BS = 4


def hashes(tokens: list[int]) -> list:
    out, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS], b"")
        out.append(parent)
    return out


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


def test_a_shared_context_is_reused_up_to_its_last_full_block():
    cache = PromptScoresCache(BS, capacity=100)
    context = list(range(10, 21))  # 11 tokens: blocks 0, 1 full, block 2 partial
    a = context + [50, 51, 52]  # block 2 = [18, 19, 20, 50]
    cache.record(scored(a, 2), hashes(a))
    assert len(cache) == 3  # rows predicting blocks 0..2 (positions -1..10)

    b = context + [60, 61]
    fresh = PromptScores(2)
    # b hits blocks 0, 1 (its block 2 differs); skipping both needs the row that
    # predicts token 8 (block 2 of b, not cached): so only block 0 is skipped
    assert cache.usable_hits(fresh, len(b), hashes(b), 2) == 1
    cache.fill(fresh, len(b), hashes(b), 1 * BS)
    want = rows_for(b, 2, 0, BS)
    assert fresh.rows == list(zip(want.token_ids, want.logprobs, want.ranks))
    # a prompt identical to a's first 12 tokens can skip two blocks
    c = a[:12] + [70]
    assert cache.usable_hits(PromptScores(2), len(c), hashes(c), 2) == 2


def test_rows_with_fewer_alternatives_do_not_serve_more():
    cache = PromptScoresCache(BS, capacity=100)
    a = list(range(30, 43))
    cache.record(scored(a, 1), hashes(a))
    assert cache.usable_hits(PromptScores(3), len(a), hashes(a), 2) == 0
    assert cache.usable_hits(PromptScores(1), len(a), hashes(a), 2) == 2
    fewer = PromptScores(0)
    cache.fill(fewer, len(a), hashes(a), 2 * BS)
    assert len(fewer.rows) == 2 * BS and all(len(ids) == 1 for ids, _, _ in fewer.rows)
    cache.record(scored(a, 3), hashes(a))  # more alternatives replace the entries
    assert cache.usable_hits(PromptScores(3), len(a), hashes(a), 2) == 2


def test_rows_already_emitted_are_not_needed_again():
    """A preempted request that scored its whole prompt can take every hit."""
    cache = PromptScoresCache(BS, capacity=100)
    a = list(range(5, 18))
    done = scored(a, 1)
    assert cache.usable_hits(done, len(a), hashes(a), 3) == 3
    partial = PromptScores(1)
    partial.extend(rows_for(a, 1, 0, 6))
    assert cache.usable_hits(partial, len(a), hashes(a), 1) == 1  # rows 0..3 already there
    assert cache.usable_hits(partial, len(a), hashes(a), 2) == 1  # rows 6, 7 are not cached


def test_take_unsent_and_capacity():
    s = PromptScores(1)
    assert s.take_unsent() is None
    s.extend(rows_for(list(range(9)), 1, 0, 3))
    assert len(s.take_unsent().ranks) == 3 and s.take_unsent() is None
    cache = PromptScoresCache(BS, capacity=2)
    a = list(range(100, 117))
    cache.record(scored(a, 1), hashes(a))
    assert len(cache) == 2  # the least recently used blocks went
