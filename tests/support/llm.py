"""Engines on the tiny test models (scripts/make_test_model.py) and what the tests check
on them: the engine tests' standard LLM, no leaked blocks or shapes outside the buckets, and one
engine's numbers of two fixed prompts."""

import numpy as np

from jaxllm import LLM, SamplingParams

KV_BYTES_PER_BLOCK = 16 * 2 * 2 * 64 * 4  # block_size x (K,V) x layers x kv_size x float32


# Test engines compile each step shape at its first step (`warm_up=False`): a test runs a few of
# them, and the step executables are the run's costliest compiles on a clean machine. Warm-up's
# own tests ask for it: warm_up=True.
LAZY = dict(warm_up=False)


def make_llm(test_models_dir, **options):
    config = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, block_size=16,
                  kv_cache_memory=64 * KV_BYTES_PER_BLOCK, attention_backend="cpu", linear_backend="cpu",
                  progress=False,  # nothing measured at start-up (tests/worker/test_autotune.py covers `auto`)
                  **LAZY)
    return LLM(str(test_models_dir / "llama"), **(config | options))


def assert_no_leaks(llm: LLM) -> None:
    core = llm.llm_engine.core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_used_blocks == 0
    assert core.runner.num_compilations_after_warmup == 0
    # a LAZY engine's steps compiled shapes of its fixed buckets alone, as warm-up would have
    assert set(core.runner.compilation._compiled) <= {*core.runner.buckets, *core.runner.loop_buckets}
    core.step()  # an empty step delivers the last finished ids to the runner
    assert len(core.runner.input_batch) == 0


# engines with few step shapes (six: 1, 4, 8 and 16 tokens, decode loops of 1 and 4 sequences;
# a longer prompt is chunked), no attention measurement, and each shape compiled at its first
# step: the tests are of the weights, and each compiled shape costs seconds of the test budget
SMALL = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, attention_backend="cpu", progress=False,
             **LAZY)


def engine_numbers(path, quantization, linear_backend, dtype="float32") -> np.ndarray:
    """Greedy tokens, sample and prompt logprobs (top 3 / 2) of two fixed prompts through
    LLM: what a kept-blocks engine must reproduce bit for bit (activations in float: the
    default "auto" multiplies int16 ones on the cpu kernel). Single decode steps: the four
    step shapes alone, no decode loops (each ~2x a step shape's compile time here); the
    loops run kept blocks in make_llm's q8_0 engine (tests/engine/test_update_weights.py)
    and tests/models/test_activation_quantization.py's engines."""
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 500, n)]} for n in (5, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    llm = LLM(str(path), quantization=quantization, linear_backend=linear_backend, dtype=dtype,
              activation_quantization="none", **(SMALL | dict(num_scheduler_steps=1)))
    values = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        steps = o.outputs[0].logprobs + o.prompt_logprobs[1:]
        values += o.outputs[0].token_ids + [lp.logprob for step in steps for lp in step.values()]
    return np.array(values)
