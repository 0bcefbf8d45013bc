"""vLLM CPU as on an AVX2-only machine (scripts/bench_vllm.py --isa avx2): on PYTHONPATH
of vLLM's server, every process it starts imports this first. vLLM picks its kernel
library (`_C`, `_C_AVX512`, `_C_AVX2`) and its AMX / AVX-512 code paths by torch.cpu's
CPUID probes, which no environment variable caps; they answer no here. The rest of
torch is capped by the environment isa_build.py's `avx2` sets (oneDNN, ATen, MKL)."""

import torch.cpu

for _probe in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
