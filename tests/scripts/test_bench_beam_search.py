"""scripts/bench_beam_search.py's own logic (the benchmark itself is not run here)."""

import bench_beam_search


def test_agreement_counts_prompts_whose_sequences_all_match():
    mine = [[[1, 2], [3]], [[4], [5]]]
    assert bench_beam_search.agreement(mine, [[[1, 2], [3]], [[4], [6]]]) == 0.5
    assert bench_beam_search.agreement(mine, mine) == 1.0
    assert bench_beam_search.agreement(mine, [[[3], [1, 2]], [[4], [5]]]) == 0.5  # order counts
