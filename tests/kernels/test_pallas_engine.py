"""attention_backend="pallas" through the whole engine (the kernels in interpret mode
on CPU): greedy outputs token-identical to the xla backend on a workload that mixes
chunked prefills (budget 32 tokens, prompts up to 60) with decodes."""

import pytest

from jaxllm import LLM
from tests.support.llm import KV_BYTES_PER_BLOCK, assert_no_leaks
from tests.support.multidevice import pallas_engine_workload


@pytest.mark.slow  # 24 s in interpret mode; by default the kernel's step compositions (test_pallas_ragged_paged_attention)
def test_pallas_backend_matches_xla_through_the_engine(test_models_dir):
    prompts, params = pallas_engine_workload()
    results = {}
    for backend in ("xla", "pallas"):
        # float32 (auto would be bfloat16 on a GPU, whose rounding flips near-tied tokens between the backends)
        llm = LLM(str(test_models_dir / "llama"), attention_backend=backend, dtype="float32", max_model_len=128,
                  max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=14 * KV_BYTES_PER_BLOCK, progress=False)
        assert llm.llm_engine.core.runner.plan.backends("attention") == [backend]
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_leaks(llm)
    assert results["pallas"] == results["xla"]
