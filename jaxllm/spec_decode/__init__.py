"""Speculative decoding (issue 22, in progress): proposers of draft tokens that the
target model verifies in one ragged step. Landed so far: the configuration and the
n-gram (prompt lookup) proposer; the scheduler's budgeting of draft tokens and the
verification inside the step come next, and until then no engine option enables it."""
