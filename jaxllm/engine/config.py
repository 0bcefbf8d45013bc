"""EngineConfig: every option of the engine, as LLM(...) and `python -m jaxllm.serve`
take them. Each option is declared once, as a field with its default, help and (for a
choice) the names it accepts; `add_cli_args` makes the serve CLI's flags from the
fields (the names with dashes). Plain Python."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing

from jaxllm.config import (
    ACTIVATION_QUANTIZATIONS,
    ATTENTION_BACKENDS,
    CONVERT_TYPES,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    QUANTIZATIONS,
    RUNNER_TYPES,
    ModelConfig,
)
from jaxllm.lora.request import LoRAConfig
from jaxllm.pooling_params import PoolerConfig
from jaxllm.reasoning import PARSERS as REASONING_PARSERS
from jaxllm.spec_decode.config import SpeculativeConfig

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30}
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30  # CPU devices report no memory: 2 GiB, as vLLM's CPU default
DEFAULT_DEVICE_MEMORY_FRACTION = 0.9
DEFAULT_IMAGES_PER_PROMPT = 999  # vLLM's default limit per modality


def parse_memory(value: str | int | float | None) -> int | float | None:
    """'4GiB', '512MiB', 2e9 (bytes) -> bytes; a number in (0, 1] -> fraction of device memory."""
    if value is None or isinstance(value, (int, float)):
        if value is not None and value <= 0:
            raise ValueError(f"kv_cache_memory: must be positive, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} (examples: 4GiB, 512MiB, 0.8)")
    number = float(m.group(1))
    if not m.group(2) and number <= 1:
        return number
    return int(number * _UNITS[m.group(2).lower()])


def _option(default, help: str, choices: tuple[str, ...] | None = None,
            aliases: tuple[str, ...] = ()):
    """A field with the help its CLI flag shows (`add_cli_args`), the names it accepts
    when it is a choice, and short flags for it."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = _option(None, "HF folder, GGUF file or converted checkpoint (default: the embedded "
                                      "SmolLM2-135M-Instruct)")
    runner: str = _option("auto", "generate tokens, or pool hidden states into embeddings (/v1/embeddings, /pooling, "
                                  "/score, /rerank); auto is pooling for an encoder (BertModel) or a "
                                  "sentence-transformers folder, else generate", RUNNER_TYPES)
    convert: str = _option("auto", "how the pooling runner serves a generative checkpoint: embed (its final-normed "
                                   "hidden states pooled, LAST by default); auto is embed under --runner pooling; none "
                                   "refuses it", CONVERT_TYPES)
    pooler_config: PoolerConfig | str | dict | None = _option(
        None, "the pooling runner's pooler, as vLLM's JSON: {\"pooling_type\": \"MEAN\", \"normalize\": true} "
              "(pooling_type LAST, MEAN, CLS or ALL); unset fields are the model's: a sentence-transformers folder's "
              "modules, else CLS for an encoder and LAST for a decoder, normalized")
    dtype: str = _option("auto", "weights and activations: auto is bfloat16 on a GPU; on a CPU, a bfloat16 or float16 "
                                 "checkpoint's bfloat16 where the CPU multiplies it natively (AVX512_BF16), else "
                                 "float32; bfloat16 on a CPU keeps float32 activations (docs/quantization.md)",
                         DTYPE_NAMES)
    quantization: str | None = _option(None, "projection weights: as stored by default; none dequantizes them to dtype; "
                                             "a format quantizes a float checkpoint at load, a checkpoint method checks "
                                             "it is stored so (docs/quantization.md)", QUANTIZATIONS)
    activation_quantization: str | None = _option(
        "auto", "inputs of the projections kept in blocks, on the CPU kernel: auto is bfloat16 where it has AMX (but "
                "float32 at the step sizes where start-up measures that faster), int16 where it has integer dot "
                "products, else none (docs/quantization.md)", ACTIVATION_QUANTIZATIONS)
    max_model_len: int | None = _option(None, "tokens per sequence (default: the model's context length)")
    block_size: int = _option(16, "tokens per KV cache block (a power of two)")
    kv_cache_memory: str | int | float | None = _option(
        None, "KV cache size per device: bytes, 4GiB, 512MiB, or a fraction of device memory (CPU default 2GiB)")
    kv_cache_dtype: str = _option("auto", "KV cache elements: auto is the model's dtype, but bfloat16 where the "
                                          "projections multiply quantized activations (a GGUF's defaults on a CPU); "
                                          "int8 has a scale per token and KV head, fp8 one per layer and KV head where "
                                          "calculate_kv_scales or the checkpoint gives them (docs/quantization.md)",
                                  KV_CACHE_DTYPES)
    calculate_kv_scales: bool = _option(False, "fp8 KV cache: scale K and V per layer and KV head, from the first "
                                               "batch's largest values (vLLM's); else a checkpoint's k_scale / v_scale "
                                               "where it has them, or none")
    max_num_seqs: int = _option(64, "sequences in one step")
    max_num_batched_tokens: int = _option(512, "tokens in one step")
    scheduling_policy: str = _option("fcfs", "which waiting request runs next: fcfs (first come, first served) or "
                                             "priority (a request's priority, lower first, then arrival; the "
                                             "running request preempted is the last of that order)",
                                     ("fcfs", "priority"))
    enable_prefix_caching: bool = _option(True, "reuse the K/V of prompt prefixes already computed")
    enable_sleep_mode: bool = _option(False, "allow sleep(level) and wake_up(): give the device memory of the KV "
                                             "cache and the weights back between uses (an RL loop's rollouts)")
    disable_hybrid_kv_cache_manager: bool = _option(
        False, "keep every block of every layer in models mixing sliding-window and full layers (Gemma 2/3), instead of "
               "freeing what a window no longer sees")
    speculative_config: SpeculativeConfig | str | dict | None = _option(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4} or "
              "{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 3}; the same greedy and "
              "seeded tokens (docs/design.md)")
    async_scheduling: bool | None = _option(
        None, "prepare each step while the one before runs, the same tokens (default: on, except with speculative "
              "decoding or num_processes > 1, as the log says)")
    num_scheduler_steps: int = _option(
        4, "decode steps one device call may run while every request decodes and none waits: the same tokens, "
           "arriving that many at a time; 1 turns it off (docs/design.md)")
    enable_lora: bool = _option(False, "serve LoRA adapters (PEFT folders) beside the base model, each request under "
                                       "its own, many in one batch")
    max_loras: int = _option(1, "LoRA adapters in device slots at once (a step runs at most this many)")
    max_lora_rank: int = _option(16, "the largest LoRA rank served (every slot is this wide)")
    max_cpu_loras: int | None = _option(None, "LoRA adapters kept read on the host (default: max_loras)")
    seed: int = _option(0, "seed of the engine's draws (requests without a seed)")
    attention_backend: str = _option("auto", "attention kernels (auto: the fastest that runs here)", ATTENTION_BACKENDS)
    linear_backend: str = _option("auto", "projection kernels (jaxllm.models.linear); auto takes the faster at "
                                          "start-up of the C++ kernel and XLA's dot on a CPU (the kernel alone for "
                                          "quantized weights), of XLA's dot and the Pallas weight-only matmul for "
                                          "quantized weights on a GPU", LINEAR_BACKENDS)
    batch_invariant: bool = _option(
        False, "each sequence's logits and logprobs the same bits whatever it is batched with (the CPU kernels, "
               "float32: one summation order per row; prefill is slower), and equal to "
               "jaxllm.models.dense.sequence_logprobs(..., batch_invariant=True), a trainer's forward (docs/design.md)")
    chat_template: str | None = _option(None, "a Jinja chat template, or a file holding one")
    limit_mm_per_prompt: dict | str | None = _option(
        None, "a vision-language model's images per prompt at most, as vLLM's JSON: {\"image\": 2} (default: "
              f"{DEFAULT_IMAGES_PER_PROMPT}); more is a 400")
    reasoning_parser: str | None = _option(
        None, "keep a reasoning model's thinking (<think>...</think>) apart from its answer: deepseek_r1 (the output "
              "starts inside the thinking) or qwen3 (it thinks where the template or the output opens a block); "
              "structured outputs apply after the thinking", tuple(REASONING_PARSERS))
    compilation_cache_dir: str | None = _option(None, "where compiled steps and converted models are kept "
                                                      "(default ~/.cache/jaxllm/xla)")
    warm_up: bool = _option(True, "compile (or load from the compilation cache) every step shape at start-up, so no "
                                  "request waits for a compile; --no-warm-up compiles each shape at the first step "
                                  "that needs it: a quicker start where a few prompts run (a notebook, a test), each "
                                  "new shape's first step slower")
    served_model_name: str | None = _option(None, "the model name clients use (default: from --model)")
    tensor_parallel_size: int = _option(1, "devices to shard the model over, by heads (tensor parallelism)",
                                        aliases=("-tp",))
    pipeline_parallel_size: int = _option(1, "stages to split the model's layers into, each on its own "
                                             "tensor_parallel_size devices, micro-batches flowing through them "
                                             "(pipeline parallelism)", aliases=("-pp",))
    data_parallel_size: int = _option(1, "engine replicas, each on its own tensor_parallel_size x "
                                         "pipeline_parallel_size devices "
                                         "(the server routes requests between them)", aliases=("-dp",))
    data_parallel_backend: str = _option(
        "mp", "where data-parallel replicas run: mp, processes on this host; ray, actors on any node of the Ray "
              "cluster", ("mp", "ray"))
    distributed_executor_backend: str = _option(
        "mp", "what runs an engine's processes: mp, this process alone (one host); ray, one process per node of "
              "the Ray cluster (num_processes of them), placed and supervised by Ray", ("mp", "ray"))
    num_processes: int = _option(1, "processes (hosts) one engine spans, each driving its node's share of the "
                                    "tensor_parallel_size x pipeline_parallel_size devices (needs "
                                    "distributed_executor_backend ray)")

    def __post_init__(self) -> None:
        if self.activation_quantization is None:  # what None meant before "auto" was the default
            object.__setattr__(self, "activation_quantization", "none")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices and not (f.default is None and
                                                                        getattr(self, f.name) is None):
                raise ValueError(f"{f.name}: unknown {getattr(self, f.name)!r}; choose one of {', '.join(map(str, choices))}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size", "data_parallel_size", "num_processes", "num_scheduler_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be positive, got {self.max_model_len}")
        parse_memory(self.kv_cache_memory)
        LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # checks them, with or without enable_lora
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
        object.__setattr__(self, "limit_mm_per_prompt", _parse_mm_limits(self.limit_mm_per_prompt))
        if self.runner == "generate" and self.pooler_config is not None:
            raise ValueError("pooler_config: only with the pooling runner (--runner pooling)")
        if self.num_processes > 1 and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size: not yet with num_processes > 1 (one engine spans the hosts)")
        if self.num_processes > 1 and self.distributed_executor_backend != "ray":
            raise ValueError("num_processes: an engine over several processes is placed by Ray; add "
                             "--distributed-executor-backend ray (and `ray start` on each node)")
        if self.calculate_kv_scales and self.kv_cache_dtype not in ("fp8", "fp8_e4m3"):
            raise ValueError(f"calculate_kv_scales: only with kv_cache_dtype fp8 (the scales of an fp8 cache), got "
                             f"{self.kv_cache_dtype}")
        if self.calculate_kv_scales and self.pipeline_parallel_size > 1:
            raise ValueError("calculate_kv_scales: not yet with pipeline_parallel_size > 1")
        if self.batch_invariant:
            self._resolve_batch_invariant()
        if self.async_scheduling and self.async_scheduling_blocked:
            raise ValueError(f"async_scheduling: not with {self.async_scheduling_blocked}")

    # batch_invariant: what each option must be (its auto resolved so), and why
    _INVARIANT = {"dtype": ("float32", "the kernels' float32 sums"),
                  "activation_quantization": ("none", "float inputs, as a trainer's"),
                  "attention_backend": ("cpu", "the kernel's batch-invariant mode"),
                  "linear_backend": ("cpu", "the kernel's per-row sums at every step shape")}

    def _resolve_batch_invariant(self) -> None:
        """batch_invariant's autos resolved (the options above), and what it cannot run
        with refused, naming the option."""
        for name, (value, why) in self._INVARIANT.items():
            if getattr(self, name) not in ("auto", value):
                raise ValueError(f"{name}: batch_invariant needs {value} ({why}), got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        refused = {"enable_lora": (self.enable_lora, "adapters multiply through XLA's dot"),
                   "tensor_parallel_size": (self.tensor_parallel_size > 1, "sharded sums"),
                   "pipeline_parallel_size": (self.pipeline_parallel_size > 1, "not yet"),
                   "num_processes": (self.num_processes > 1, "not yet")}
        for name, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"{name}: not with batch_invariant ({why})")

    def runner_type(self, model: ModelConfig, embedder: bool = False) -> str:
        """The runner this engine serves `model` with: generate or pooling (`auto`: pooling
        for an encoder, or a model its folder says is an `embedder`: a
        sentence-transformers folder); ValueError where the model cannot be served so."""
        auto = "pooling" if model.is_encoder or (embedder and self.convert != "none") else "generate"
        runner = self.runner if self.runner != "auto" else auto
        if runner == "generate" and model.is_encoder:
            raise ValueError(f"runner: {model.architecture} is an encoder, which generates nothing; serve it with "
                             "--runner pooling (the default for it)")
        if runner == "pooling" and not model.is_encoder and self.convert == "none":
            raise ValueError(f"convert: none keeps {model.architecture} generative; the pooling runner serves it "
                             "with --convert embed")
        return runner

    @property
    def async_scheduling_blocked(self) -> str | None:
        """What in this configuration keeps steps from overlapping (None: nothing)."""
        if self.speculative_config is not None:
            return "speculative_config (a step's drafts depend on the tokens of the step before)"
        if self.num_processes > 1:
            return "num_processes > 1 (an engine over several hosts; not yet)"
        return None

    @property
    def decode_steps(self) -> int:
        """The decode steps one call may run: num_scheduler_steps, except with
        speculative decoding (each step verifies drafts proposed after the one before)."""
        return 1 if self.speculative_config is not None else self.num_scheduler_steps

    @property
    def runs_async(self) -> bool:
        """Whether steps overlap: async_scheduling, or by default where nothing blocks it."""
        return self.async_scheduling is not False and self.async_scheduling_blocked is None

    @property
    def devices_per_engine(self) -> int:
        """The devices one engine (one replica) runs on: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def images_per_prompt(self) -> int:
        """The most images a prompt may hold (limit_mm_per_prompt's)."""
        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGES_PER_PROMPT)

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The adapter limits where enable_lora is set."""
        limits = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        return limits if self.enable_lora else None


def _parse_mm_limits(value) -> dict | None:
    """limit_mm_per_prompt as a dict ({"image": n}, n >= 0), from its JSON text too."""
    if value is None or isinstance(value, dict):
        limits = value
    else:
        try:
            limits = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt: not JSON ({e}); e.g. '{{\"image\": 2}}'") from None
    if limits is None:
        return None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise ValueError(f"limit_mm_per_prompt: images are the only modality, as {{\"image\": n}}; got {limits!r}")
    n = limits.get("image", DEFAULT_IMAGES_PER_PROMPT)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"limit_mm_per_prompt: the image limit must be a non-negative integer, got {n!r}")
    return {"image": n}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`--max-num-seqs` for max_num_seqs, booleans as
    `--x/--no-x`), its default and help from the field: the CLI never restates them."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag, hint = "--" + f.name.replace("_", "-"), hints[f.name]
        kwargs = {"default": f.default, "help": f.metadata.get("help"), "choices": f.metadata.get("choices")}
        if hint in (bool, bool | None):
            kwargs["action"] = argparse.BooleanOptionalAction
            del kwargs["choices"]  # BooleanOptionalAction takes none (deprecated since Python 3.12)
        elif hint in (int, int | None):
            kwargs["type"] = int
        parser.add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)


def from_cli_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig a parsed command line gives (see add_cli_args)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
