"""jaxllm: LLM inference and serving in JAX, after vLLM.

    from jaxllm import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].outputs[0].text)

    embedder = LLM("all-MiniLM-L6-v2")  # an encoder: served for pooling (embeddings)
    print(embedder.embed("Hello world")[0].outputs.embedding[:4])

Exports are resolved lazily, so the plain-Python parts (the scheduler, the KV cache
manager) can be imported without loading JAX.
"""

import logging as _logging

# Backend discovery on a machine with a CUDA plugin but no usable GPU logs warnings;
# the CPU fallback is expected, so keep that quiet (this does not import jax).
_logging.getLogger("jax._src.xla_bridge").setLevel(_logging.ERROR)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "PoolingRequestOutput", "ScoringRequestOutput", "EngineConfig", "LoRARequest"]

_EXPORTS = {
    "LLM": "jaxllm.entrypoints.llm",
    "SamplingParams": "jaxllm.sampling_params",
    "BeamSearchParams": "jaxllm.sampling_params",
    "PoolingParams": "jaxllm.pooling_params",
    "EmbeddingRequestOutput": "jaxllm.outputs",
    "PoolingRequestOutput": "jaxllm.outputs",
    "ScoringRequestOutput": "jaxllm.outputs",
    "RequestOutput": "jaxllm.outputs",
    "CompletionOutput": "jaxllm.outputs",
    "EngineConfig": "jaxllm.engine.config",
    "LoRARequest": "jaxllm.lora.request",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
