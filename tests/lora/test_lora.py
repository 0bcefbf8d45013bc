"""LoRA adapters (issue 23): PEFT folders read as PEFT reads them (the oracle: HF
transformers + peft on the same base folder), many adapters in one batch each request
getting the tokens it gets alone, the adapter slots reused when they are fewer than the
adapters, and every refusal naming its reason."""

import re
from pathlib import Path

import make_test_model
import numpy as np
import pytest
import torch

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.loaders import load_model
from jaxllm.lora.peft import load_adapter
from jaxllm.lora.request import LoRAConfig
from jaxllm.models.lora import lora_partition_specs
from tests.support.llm import LAZY

peft = pytest.importorskip("peft")

TOL = 1e-4
KV_BYTES_PER_BLOCK = 16 * 2 * 2 * 64 * 4  # the llama test model: block_size x (K,V) x layers x kv_size x float32


@pytest.fixture(scope="module")
def adapters(test_models_dir, tmp_path_factory):
    """Three adapters of the llama test model: every module at rank 8; three modules at
    rank 4 with rsLoRA; every module at rank 16 (for max_lora_rank refusals)."""
    base, out = test_models_dir / "llama", tmp_path_factory.mktemp("lora")
    a1 = make_test_model.write_lora_adapter(base, out / "a1", rank=8, seed=1, scale=0.1)
    a2 = make_test_model.write_lora_adapter(base, out / "a2", rank=4, seed=2, scale=0.1, use_rslora=True,
                                            targets=("q_proj", "v_proj", "down_proj"), layers=[1])
    a3 = make_test_model.write_lora_adapter(base, out / "a3", rank=16, seed=3, scale=0.1)
    return {"a1": LoRARequest("a1", 1, str(a1)), "a2": LoRARequest("a2", 2, str(a2)),
            "a3": LoRARequest("a3", 3, str(a3))}


def make_llm(test_models_dir, **options):
    """A 32-token budget (chunked prefill), a 24-block pool, adapters of rank <= 8."""
    config = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, block_size=16,
                  kv_cache_memory=25 * KV_BYTES_PER_BLOCK, enable_lora=True, max_loras=2, max_lora_rank=8,
                  attention_backend="cpu", linear_backend="cpu", progress=False, **LAZY)  # nothing measured at start-up
    return LLM(str(test_models_dir / "llama"), **(config | options))


@pytest.fixture(scope="module")
def llm(test_models_dir):
    return make_llm(test_models_dir)


def run(llm: LLM, prompts, params, lora_request=None):
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    core = llm.llm_engine.core
    assert not core.has_unfinished_requests() and core.kv_cache_manager.num_used_blocks == 0
    assert core.runner.num_compilations_after_warmup == 0
    return outputs


def hf_prompt_logprobs(base, adapter: str | None, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()
    return logprobs[np.arange(len(ids) - 1), ids[1:]]


def prompt_ids(n: int, seed: int, length: int = 45) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, int(rng.integers(length // 2, length))).tolist() for _ in range(n)]


@pytest.mark.parametrize("name", [None, "a1", "a2"])
def test_prompt_logprobs_match_hf_peft(llm, adapters, test_models_dir, name):
    """Every prompt position's logprob as HF + PEFT computes it, through chunked
    prefill (a 45-token prompt in 32-token steps); the adapters move them well past
    the tolerance (so the comparison can fail)."""
    (ids,) = prompt_ids(1, 7, 46)
    lora = None if name is None else adapters[name]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = run(llm, [ids], params, lora)[0]
    got = np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    want = hf_prompt_logprobs(test_models_dir / "llama", None if lora is None else lora.lora_path, ids)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    if lora is not None:
        base = hf_prompt_logprobs(test_models_dir / "llama", None, ids)
        assert np.abs(want - base).max() > 100 * TOL


def test_mixed_batch_gives_each_request_its_tokens_alone(llm, adapters):
    """The same prompts under the base model, a1 and a2 in one call (sharing steps and
    prompts, so a prefix cache shared across adapters would give wrong tokens) equal
    each one run alone; the adapters' tokens differ from the base model's."""
    prompts = prompt_ids(4, 3)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    names = [None, "a1", "a2"]
    alone = {n: [o.outputs[0].token_ids for o in run(llm, prompts, params, None if n is None else adapters[n])]
             for n in names}
    loras = [None if n is None else adapters[n] for n in names for _ in prompts]
    mixed = run(llm, prompts * len(names), params, loras)
    for i, n in enumerate(names):
        assert [o.outputs[0].token_ids for o in mixed[i * len(prompts):(i + 1) * len(prompts)]] == alone[n], n
    assert alone["a1"] != alone[None] and alone["a2"] != alone[None]


def test_beam_search_under_adapters(llm, adapters, test_models_dir):
    """Beams under an adapter (mixed with the base model's in one call) are HF + PEFT's
    beam search, and not the base model's."""
    from transformers import AutoModelForCausalLM

    from jaxllm.sampling_params import BeamSearchParams

    prompts = prompt_ids(2, 5)
    params = BeamSearchParams(3, 8, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts * 2], params,
                           lora_request=[adapters["a1"]] * 2 + [None] * 2)
    core = llm.llm_engine.core
    assert not core.has_unfinished_requests() and core.kv_cache_manager.num_used_blocks == 0
    base = AutoModelForCausalLM.from_pretrained(test_models_dir / "llama", dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None  # EOS ignored, as the engine was told
    model = peft.PeftModel.from_pretrained(base, adapters["a1"].lora_path).eval()
    for ids, out in zip(prompts, outs[:2]):
        want = model.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, do_sample=False,
                              max_new_tokens=8, pad_token_id=0)[:, len(ids):].tolist()
        assert [s.output_token_ids for s in out.sequences] == want
    assert [[s.output_token_ids for s in o.sequences] for o in outs[:2]] != \
        [[s.output_token_ids for s in o.sequences] for o in outs[2:]]


# one slot: test_more_adapters_than_slots_wait_for_one's engine, and the server test's (the run's shared compilation
# cache: whichever starts second loads what the first compiled)
ONE_SLOT = dict(max_loras=1, max_cpu_loras=1)
ONE_SLOT_SERVER_FLAGS = ("--max-num-batched-tokens", "32", "--kv-cache-memory", str(25 * KV_BYTES_PER_BLOCK),
                         "--attention-backend", "cpu", "--linear-backend", "cpu", "--max-loras", "1",
                         "--max-lora-rank", "8")


@pytest.mark.slow  # (25 s: the default run's budget) adapters sharing a batch by default above
def test_more_adapters_than_slots_wait_for_one(test_models_dir, adapters, shared_cache_dir):
    """One device slot, two adapters and the base model asked at once, with seeded
    sampling: each request waits for the slot rather than failing, and gets what it
    gets alone; the slot is reloaded as the adapters take turns."""
    llm = make_llm(test_models_dir, compilation_cache_dir=str(shared_cache_dir), **ONE_SLOT)
    prompts = prompt_ids(3, 5)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
    order = ["a1", None, "a2", "a1", "a2", None]
    loras = [None if n is None else adapters[n] for n in order]
    mixed = run(llm, [prompts[i % 3] for i in range(len(order))], params, loras)
    for i, n in enumerate(order):
        alone = run(llm, [prompts[i % 3]], params, None if n is None else adapters[n])[0]
        assert mixed[i].outputs[0].token_ids == alone.outputs[0].token_ids, (i, n)


@pytest.mark.slow  # the 15-minute budget; speculation and adapters each run by default
def test_speculative_decoding_under_adapters(test_models_dir, adapters, llm):
    """n-gram drafts verified under each request's adapter: greedy tokens identical to
    the same engine without speculation, base and two adapters in one batch."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec = make_llm(test_models_dir, speculative_config=ngram)
    rng = np.random.default_rng(6)
    prompts = [(rng.integers(3, 500, 5).tolist() * 8)[:int(rng.integers(20, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    loras = [None, adapters["a1"], adapters["a2"]] * 2
    want = [o.outputs[0].token_ids for o in run(llm, prompts, params, loras)]
    assert [o.outputs[0].token_ids for o in run(spec, prompts, params, loras)] == want
    assert spec.llm_engine.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_adapter_refusals(llm, adapters, test_models_dir, tmp_path):
    base = test_models_dir / "llama"
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="rank 16 exceeds max_lora_rank 8"):
        llm.generate(["hi"], params, lora_request=adapters["a3"])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(["hi"], params, lora_request=LoRARequest("x", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id 1 is already 'a1'"):
        llm.generate(["hi"], params, lora_request=LoRARequest("other", 1, adapters["a2"].lora_path))
    dora = make_test_model.write_lora_adapter(base, tmp_path / "dora", extra_config={"use_dora": True})
    with pytest.raises(ValueError, match="DoRA"):
        llm.generate(["hi"], params, lora_request=LoRARequest("dora", 10, str(dora)))
    embed = make_test_model.write_lora_adapter(base, tmp_path / "embed", rank=4)
    _add_tensor(embed, "base_model.model.model.embed_tokens.lora_embedding_A", np.zeros((4, 512), np.float32))
    with pytest.raises(ValueError, match="embed_tokens.lora_embedding_A is not a LoRA A/B"):
        llm.generate(["hi"], params, lora_request=LoRARequest("embed", 11, str(embed)))
    with pytest.raises(ValueError, match="1 given for 2 prompts"):
        llm.generate(["a", "b"], params, lora_request=[adapters["a1"]])
    assert not llm.llm_engine.core.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "p")
    with pytest.raises(ValueError, match="max_cpu_loras: must be an integer >= max_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)


def test_engine_without_lora_refuses_adapters(adapters):
    from types import SimpleNamespace

    from jaxllm.engine.core import EngineCore

    core = SimpleNamespace(runner=SimpleNamespace(lora=None))  # an engine core built without enable_lora
    with pytest.raises(ValueError, match="without LoRA; start it with enable_lora=True"):
        EngineCore.add_lora(core, adapters["a1"])


def test_unsupported_engines_refused(test_models_dir):
    with pytest.raises(ValueError, match="mixture-of-experts model is not supported"):
        LLM(str(test_models_dir / "mixtral"), enable_lora=True, max_model_len=64, kv_cache_memory="1MiB",
            progress=False)
    cfg = load_model(test_models_dir / "llama", dtype="float32").config  # 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size=4 exceeds the model's 2 KV heads"):
        lora_partition_specs(cfg, 4)


def test_partition_specs_follow_the_projections(llm):
    """A split like its projection's inputs (row-parallel o / down), each B like its
    outputs (column-parallel q | k | v, gate | up)."""
    from jax.sharding import PartitionSpec as P

    specs = lora_partition_specs(llm.llm_engine.core.model.config, 2)
    for layer in specs.layers:
        assert layer["wo"].a == P("model", None, None, None) and layer["wo"].b == (P(None, None, None),)
        assert layer["w_down"].a == P("model", None, None, None) and layer["w_down"].b == (P(None, None, None),)
        assert layer["wqkv"].a == P(None, None, None, None) and layer["wqkv"].b == (P(None, None, "model"),) * 3
        assert layer["w_gate_up"].b == (P(None, None, "model"),) * 2


@pytest.mark.slow  # 58 s beside three workers (two engines in a subprocess); the specs are checked above
def test_tensor_parallel_equals_one_device(test_models_dir, tmp_path):
    """Two shards (the adapters' A and B split as their projections) give one device's
    tokens and logprobs, two adapters and the base model in one batch."""
    from tests.support import multidevice

    multidevice.run("lora_matches", str(test_models_dir / "llama"), str(tmp_path), "2", devices=2)
    with pytest.raises(ValueError, match="LoRA kernels need a power of two >= 16, got 8"):
        make_llm(test_models_dir, linear_backend="pallas")


@pytest.mark.slow
def test_pallas_kernels_through_the_engine(test_models_dir, adapters, llm):
    """The pallas linear backend's LoRA kernels (interpret mode here) give the XLA
    path's tokens, two adapters and the base model in one batch."""
    prompts = prompt_ids(3, 4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    loras = [adapters["a1"], None, adapters["a2"]]
    want = [o.outputs[0].token_ids for o in run(llm, prompts, params, loras)]
    pallas = make_llm(test_models_dir, linear_backend="pallas", max_lora_rank=16)
    assert [o.outputs[0].token_ids for o in run(pallas, prompts, params, loras)] == want


def test_scaling_and_padding(adapters, test_models_dir, llm):
    """rsLoRA scales by alpha / sqrt(r); ranks below max_lora_rank are zero-padded;
    modules an adapter leaves out are zeros."""
    cfg = llm.llm_engine.core.model.config
    weights, rank = load_adapter(adapters["a2"].lora_path, cfg, 8)
    assert rank == 4
    from safetensors.numpy import load_file
    tensors = load_file(adapters["a2"].lora_path + "/adapter_model.safetensors")
    b = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    wqkv = weights.layers[1]["wqkv"]
    np.testing.assert_allclose(wqkv.b[2][:4], b.T * 16 / 2, rtol=1e-6)  # alpha 16, sqrt(4)
    assert not wqkv.b[2][4:].any() and not wqkv.b[1].any() and not wqkv.a[:, 1].any()
    assert not any(p.a.any() for p in weights.layers[0].values())


def _add_tensor(folder, name: str, value: np.ndarray) -> None:
    from safetensors.numpy import load_file, save_file

    file = folder / "adapter_model.safetensors"
    tensors = load_file(str(file)) | {name: value}
    save_file(tensors, str(file))


# ---- the server: adapters by `model`, loaded and unloaded at run time ------------------------

def test_server_loads_serves_and_unloads_adapters(test_models_dir, adapters, llm, shared_cache_dir):
    """`--lora-modules` at start-up and /v1/load_lora_adapter later; /v1/models lists
    them; a completion under an adapter gives the offline engine's tokens; with one
    slot, two adapters asked at once both finish; unload then reload; unknown names
    404; a bad adapter is a 400 with the reason; the routes need the API key."""
    import concurrent.futures

    import httpx

    from tests.support.server import API_KEY, Server

    prompt = prompt_ids(1, 9)[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = {n: run(llm, [prompt], params, None if n is None else adapters[n])[0].outputs[0].text
            for n in (None, "a1", "a2")}
    roots = str(Path(adapters["a2"].lora_path).parent)
    server = Server(test_models_dir / "llama", shared_cache_dir, "--served-model-name", "tiny", "--enable-lora",
                    *ONE_SLOT_SERVER_FLAGS, "--lora-modules", f"a1={adapters['a1'].lora_path}",
                    "--allow-runtime-lora-updating", "--lora-allowed-roots", roots)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        client = server.client()

        def complete(model: str) -> str:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.model == model
            return r.choices[0].text

        def post(route: str, body: dict, headers=auth) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/{route}", json=body, headers=headers, timeout=60)

        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", "a1"} and models["a1"].parent == "tiny"
        assert complete("tiny") == want[None] and complete("a1") == want["a1"]
        with pytest.raises(Exception, match="The model `a2` does not exist"):
            complete("a2")
        assert post("load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"].lora_path},
                    headers={}).status_code == 401
        # outside the allowed roots: one answer whether the path exists, is a folder or not
        refused = [post("load_lora_adapter", {"lora_name": "x", "lora_path": p}).json()["error"]["message"]
                   for p in ("/etc", "/no/such/dir", f"{roots}/../{Path(roots).name}-sibling", "/etc/passwd")]
        assert len(set(refused)) == 1 and "lora_path: not under a folder" in refused[0]
        r = post("load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"].lora_path})
        assert r.status_code == 200, r.text
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # one slot: they take turns
            assert list(pool.map(complete, ["a1", "a2", "a1", "a2"])) == [want["a1"], want["a2"]] * 2
        r = post("load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"].lora_path})
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        r = post("load_lora_adapter", {"lora_name": "a3", "lora_path": adapters["a3"].lora_path})
        assert r.status_code == 400 and "rank 16 exceeds max_lora_rank 8" in r.json()["error"]["message"]
        assert post("unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
        assert post("unload_lora_adapter", {"lora_name": "a2"}).status_code == 404
        with pytest.raises(Exception, match="The model `a2` does not exist"):
            complete("a2")
        assert post("load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"].lora_path}).status_code == 200
        assert complete("a2") == want["a2"] and complete("tiny") == want[None]
        info = re.search(r'^vllm:lora_requests_info\{(.*)\} ', httpx.get(f"{server.url}/metrics").text, re.M)
        assert info and 'max_lora="1"' in info.group(1) and 'waiting_lora_adapters=""' in info.group(1)
        assert {m.id for m in client.models.list().data} == {"tiny", "a1", "a2"}
    finally:
        server.stop()


def test_runtime_updates_are_off_by_default_and_confined_to_their_roots(tmp_path):
    """Without --allow-runtime-lora-updating both routes answer 404 before reading the
    body (vLLM keeps them off likewise); with it, only paths under the allowed roots or
    the --lora-modules folders are taken (symlinks and `..` resolved first)."""
    import asyncio

    from jaxllm.entrypoints.openai.api_server import Handlers, ServerSettings
    from jaxllm.entrypoints.openai.errors import APIError

    handlers = Handlers(None, ServerSettings(model_name="m"))
    for route in (handlers.load_lora_adapter, handlers.unload_lora_adapter):
        with pytest.raises(APIError) as off:
            asyncio.run(route(None))
        assert off.value.status == 404 and "--allow-runtime-lora-updating" in off.value.message
    (tmp_path / "roots" / "a").mkdir(parents=True)
    (tmp_path / "module").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "roots" / "link").symlink_to(tmp_path / "outside")
    settings = ServerSettings(model_name="m", runtime_lora_updating=True, lora_allowed_roots=(str(tmp_path / "roots"),),
                              lora_modules=(LoRARequest("mod", 1, str(tmp_path / "module")),))
    assert settings.lora_path_allowed(str(tmp_path / "roots" / "a"))
    assert settings.lora_path_allowed(str(tmp_path / "module"))
    for refused in ("outside", "roots/link", "roots/../outside", "roots-sibling", "module/../outside"):
        assert not settings.lora_path_allowed(str(tmp_path / refused)), refused


def test_an_update_waits_for_every_data_parallel_replica():
    """/v1/load_lora_adapter through data-parallel replicas: the update is done when each
    replica answered, and fails with the first refusal any of them sent."""
    import asyncio
    from types import SimpleNamespace

    from jaxllm.engine import serialization as wire
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.engine.protocol import LoRAUpdateResult

    async def scenario(replies: list[str | None]):
        engine = AsyncLLM.__new__(AsyncLLM)  # the LoRA update path only: no core processes
        sent = []
        engine.client = SimpleNamespace(num_replicas=len(replies), send=lambda kind, payload: sent.append(payload))
        engine.dead_reason, engine._lora_ops, engine._next_op = None, {}, 0
        engine._loop = asyncio.get_running_loop()
        update = asyncio.create_task(engine.add_lora(LoRARequest("x", 5, "/p")))
        await asyncio.sleep(0)
        assert sent[0].add.lora_int_id == 5
        for error in replies:
            assert not update.done()
            engine._on_core_message(wire.LORA_RESULT, LoRAUpdateResult(sent[0].op_id, error))
            await asyncio.sleep(0)
        return await update

    assert asyncio.run(scenario([None, None])) is None
    with pytest.raises(ValueError, match="rank 32 exceeds"):
        asyncio.run(scenario([None, "lora_path: rank 32 exceeds max_lora_rank 16"]))
