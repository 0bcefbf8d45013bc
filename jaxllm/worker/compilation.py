"""Every step shape's executable: compiled at start-up, two at a time, or loaded from
the executable store (jaxllm.worker.executable_cache), so a restart loads them without
tracing. After warm-up a step whose shape is missing would compile again: that is a
bug, counted in `num_compilations_after_warmup` and logged.

`CompilationManager` compiles for a ModelRunner (its plan, weights' layouts, caches'
shapes, mesh and input builder; vLLM's tpu-inference splits its runner the same way).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import time
import typing
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxllm.attention.backends import get_attention_fn
from jaxllm.attention.kv_cache import copy_blocks
from jaxllm.models import parallel, pipeline
from jaxllm.platform import CompileHook
from jaxllm.sample.sampler import argmax, argmax_cpu, compute_logprobs, token_scores_cpu
from jaxllm.worker.autotune import StepBackends
from jaxllm.worker.buckets import StepShape
from jaxllm.worker.decode_loop import packed_decode_loop
from jaxllm.worker.executable_cache import ExecutableStore, persistent_cache_hits, store_directory
from jaxllm.worker.input_builder import StepRows
from jaxllm.worker.packing import PackLayout
from jaxllm.worker.step import SEPARATE_INPUTS, packed_step

if typing.TYPE_CHECKING:
    from jaxllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def shapes_and_dtypes(tree):
    """(shape, dtype name) per leaf: what a compiled step depends on, for concrete and
    abstract (jax.ShapeDtypeStruct) arrays alike."""
    return jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)


def load_or_compile(store: ExecutableStore, name: str, lower):
    """The executable `store` keeps under `name`, else `lower()` compiled (and stored);
    and whether it was loaded."""
    compiled = store.load(name)
    if compiled is not None:
        return compiled, True
    with persistent_cache_hits() as hits:
        compiled = lower().compile()
    if not hits():  # JAX's cache returns executables that cannot be serialized again
        store.save(name, compiled)
    return compiled, False


def _digest(obj) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:12]


class CompilationManager:
    def __init__(self, runner: ModelRunner, cache_dir: Path | None) -> None:
        """The executables of `runner`'s step shapes, kept under `cache_dir` (None:
        compiled every start)."""
        self.runner = runner
        self._steps = self._step_functions()
        # entered around each compile at first use (an engine without warm-up): the engine
        # core's process says it is alive meanwhile (jaxllm.engine.core_proc)
        self.while_compiling: CompileHook = contextlib.nullcontext
        # a step's block copies (at most one per admitted request), padded to a bucket
        copies = (pipeline.staged_copy_blocks(runner.mesh, runner._abstract_caches)
                  if runner.pipeline_parallel_size > 1 else copy_blocks)  # a stage's block ids are its own
        self._copy_blocks = jax.jit(copies, donate_argnums=(0,),
                                    **({"out_shardings": runner._cache_shardings()} if runner.mesh else {}))
        self.copy_buckets = sorted({min(8, runner.max_num_seqs), runner.max_num_seqs})
        self._compiled_copies: dict[int, object] = {}
        self._compiled: dict[StepShape, object] = {}
        self.layouts: dict[StepShape, PackLayout] = {}  # each bucket's packed inputs
        directory = store_directory(cache_dir)
        self._stores = {choice: self._step_store(directory, choice) for choice in self._steps}
        self._copy_store = ExecutableStore(directory, "copy_blocks", runner._abstract_caches, self._mesh_key(),
                                           devices=self._devices())
        self.num_loaded_executables = 0
        self.warmed_up = False
        self.num_compilations_after_warmup = 0

    def _step_functions(self) -> dict[StepBackends, dict]:
        """The keyword arguments of the step of each pair of backends the plan uses
        (`packed_step`, or `packed_decode_loop` with its number of steps; jitted per
        bucket with its inputs' PackLayout). Where the C++ kernels run the step, they
        also take the sampler's greedy argmax and prompt-logprob scores."""
        r = self.runner
        kernels = "cpu" in r.plan.backends("linear") + r.plan.backends("attention") and r.mesh is None
        return {
            choice: dict(cfg=r.config, attention_fn=get_attention_fn(choice.attention,
                                                                     r.runner_config.batch_invariant,
                                                                     r.plan.bf16_products(r.param_dtype)),
                         argmax_fn=argmax_cpu if kernels else argmax,
                         scores_fn=token_scores_cpu if kernels else compute_logprobs, mesh=r.mesh,
                         lora_kernel="pallas" if choice.linear == "pallas" else "xla")
            for choice in dict.fromkeys(r.plan.choices)
        }

    def _step_function(self, shape: StepShape, layout: PackLayout):
        """The function a bucket's executable is compiled from."""
        kwargs = self._steps[self.runner.plan.for_bucket(shape.tokens)] | {"layout": layout}
        if shape.decode_steps > 1:
            return functools.partial(packed_decode_loop, max_steps=shape.decode_steps,
                                     block_size=self.runner.block_size, **kwargs)
        return functools.partial(packed_step, **kwargs)

    def _step_shardings(self) -> dict:
        """jit's in/out shardings of the step over the mesh: weights and caches
        sharded, the rest replicated (none on one device)."""
        r = self.runner
        if r.mesh is None:
            return {}
        rep, caches = parallel.replicated(r.mesh), r._cache_shardings()
        lora = () if r.lora is None else (r.lora.shardings,)
        return {"in_shardings": (r.param_shardings(), rep, caches, rep, rep, rep, *lora),
                "out_shardings": (caches, rep, rep)}

    def _step_store(self, directory: Path | None, choice: StepBackends) -> ExecutableStore:
        """Where the executables of one pair of backends are kept (keyed by what the
        step is compiled from)."""
        r = self.runner
        images = () if r.images is None else (jax.ShapeDtypeStruct(r.images.table.shape, r.images.table.dtype),)
        args = (r.weights_of(choice), r.rope, r._abstract_caches, r.history, *r._lora_args(abstract=True), *images)
        invariant = ("batch_invariant",) if r.runner_config.batch_invariant else ()
        rounded = ("bf16_products",) if r.plan.bf16_products(r.param_dtype) else ()  # the attention's attribute
        return ExecutableStore(directory, "model_step", r.config, r.kv_groups, choice.attention, *invariant, *rounded,
                               choice.linear,
                               shapes_and_dtypes(args), jax.tree.structure(args), self._mesh_key(),
                               devices=self._devices())

    def _devices(self) -> list:
        """The devices the step runs on, in the mesh's order."""
        return [jax.local_devices()[0]] if self.runner.mesh is None else list(self.runner.mesh.devices.flat)

    def _mesh_key(self) -> str:
        """What the executables depend on of the mesh (none: one device)."""
        r = self.runner
        stages = f"pp{r.pipeline_parallel_size}-" if r.pipeline_parallel_size > 1 else ""
        return "" if r.mesh is None else f"tp{r.tensor_parallel_size}-{stages}" + ",".join(map(str, self._devices()))

    def warm_up(self, progress: bool = True) -> float:
        """Load or compile every shape (two at a time) and the block copies; returns the
        seconds it took."""
        from tqdm import tqdm

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            shapes = self.runner.shapes
            futures = [pool.submit(self._compile, shape) for shape in shapes.single + shapes.loops]
            bar = tqdm(total=len(futures), desc="compiling buckets", disable=not progress, unit="shape")
            with bar:
                for future in concurrent.futures.as_completed(futures):
                    self.num_loaded_executables += future.result()[1]
                    bar.update(1)
        for c in self.copy_buckets:
            self.copy_executable(c)
        if self.runner.images is not None:
            self.runner.images.warm_up()
        self.warmed_up = True
        return time.perf_counter() - start

    def _compile(self, shape: StepShape):
        """The executable of bucket `shape`, and whether it came from the executable
        store (else it was compiled, and stored)."""
        runner, (t, s, r, k) = self.runner, shape
        inputs = runner.inputs.pad_inputs(shape, StepRows.empty(runner.kv_groups.num_groups))
        layout = PackLayout.of(inputs, SEPARATE_INPUTS)
        name = (f"loop{k}-" if k > 1 else "") + f"t{t}-s{s}-" + _digest((layout.slots, str(layout.treedef)))
        bitmask = jax.ShapeDtypeStruct((r, runner.bitmask_width), jnp.int32)
        choice = runner.plan.for_bucket(t)
        compiled, loaded = load_or_compile(
            self._stores[choice], name,
            lambda: jax.jit(self._step_function(shape, layout), donate_argnums=(2, 3),
                            **self._step_shardings()).lower(runner.weights_of(choice), runner.rope,
                                                            runner._abstract_caches, runner.history, layout.abstract(),
                                                            bitmask, *runner.step_extras(shape, abstract=True)))
        self.layouts[shape] = layout
        self._compiled[shape] = compiled
        return compiled, loaded

    def layout(self, shape: StepShape) -> PackLayout:
        """How `shape`'s inputs pack into one buffer (its executable compiled first where
        warm-up did not: an engine started with `warm_up=False` compiles on first use)."""
        if shape not in self.layouts:
            self.get(shape)
        return self.layouts[shape]

    def get(self, shape: StepShape):
        """The executable of `shape` (compiled now, and counted as a bug, if warm-up did not)."""
        compiled = self._compiled.get(shape)
        if compiled is None:
            if self.warmed_up:
                self.num_compilations_after_warmup += 1
                logger.error("compiling bucket %s after warm-up: a bug", shape)
            with self.while_compiling():
                compiled, _ = self._compile(shape)
        return compiled

    def copy_executable(self, c: int):
        """The executable copying up to `c` blocks (XLA's scatter on a CPU costs by the
        padded count: 1.1 ms for 8, 22 ms for 64 with SmolLM2's 30 layers)."""
        compiled = self._compiled_copies.get(c)
        if compiled is None:
            pairs = jax.ShapeDtypeStruct((c,), jnp.int32)
            with self.while_compiling():
                compiled, _ = load_or_compile(
                    self._copy_store, f"copy-c{c}",
                    lambda: self._copy_blocks.lower(self.runner._abstract_caches, pairs, pairs))
            self._compiled_copies[c] = compiled
        return compiled
