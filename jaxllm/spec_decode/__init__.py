"""Speculative decoding (issue 22): proposers of draft tokens that the target model
verifies in one ragged step. The configuration (`speculative_config`, vLLM's form) and
the two proposers (n-gram lookup, `ngram_proposer`; a draft model, `draft_model`) live
here; the model runner proposes after each step, the scheduler gives each request's
drafts their slots in the next one (a decode row of k drafts is a query of k + 1
tokens), and the runner verifies them by sampling every position as a decode would
(jaxllm.worker.model_runner)."""
