"""Choosing the attention and linear backends by measurement, per step shape.

Which kernel is faster depends on the CPU, the build and the shape: on an AVX-512 Zen 4
the C++ dense kernel beat XLA's dot at every step size, built for AVX2 it won at 32
rows and lost at 512 (scripts/bench_linear.py); the C++ attention won everywhere on
both, by 1.3-7x. So where both backends of a kind can run (`auto` on the CPU platform,
float32), the runner times them at start-up on the shapes of the buckets it compiles
(every other bucket and the largest: `measured_buckets`) and gives each bucket the
faster:

- linear: one layer's projections at the bucket's T rows, the layer repeated over as
  many distinct copies of its weights as make 64 MiB below 64 rows (a small step
  streams its weights from memory; a layer that stayed in cache would flatter it),
  scaled to the model's layers; and, where the kernel runs some bucket, the output
  projection at the largest bucket's S and T rows, packed or left to XLA (one layout
  for all buckets);
- attention: one layer of a representative step of the bucket: min(T, S) sequences,
  decodes of ~min(512, max_model_len / 2) tokens of context, and the rest of the
  tokens as one prefill chunk, scaled to the model's layers;
- for a bfloat16 model where the kernels hold both bfloat16 paths (built with
  AVX512_BF16: `jaxllm.cpu_kernels.has_bf16_dot`), the kernel's projections by
  vdpbf16ps and by the float tiles (the same sums bit for bit) and, where the CPU has
  AMX (`jaxllm.cpu_kernels.has_amx`), by its tiles (float32 sums in another order), so
  each bucket may take the fastest (its step's weights carry the choice:
  `PackedWeight.bf16_tiles`, the same arrays); a float32 model's kept blocks that `auto`
  multiplies in bfloat16 may also multiply in float32 at a bucket (NO_BF16: `float_dtype`,
  the same arrays; the float path won at few rows on the AMX Xeon: docs/cpu_kernels.md).
  On an Intel Xeon (Emerald Rapids) the float tiles ran 1.3-1.75x vdpbf16ps
  at 32-128 rows and 0.67-0.98x at one row; on a Zen 4 EPYC vdpbf16ps ran 1.6-1.8x the
  float32 kernel's rate (the float tiles'), so there it should keep every bucket;
- for a float32 model's kept blocks that `auto` multiplies with int16 activations where
  the kernels also have vdpbf16ps (a Zen 4), int16 (INT16_STEP) or bfloat16 from the same
  dot-layout arrays (BF16_STEP: `PackedWeight.activations`), per bucket alike (int16 won
  up to ~32 rows there, bfloat16 from ~128: docs/bench-log/2026-12-04-zen4.md).

The plan (`BackendPlan`) is stored as JSON next to the compiled executables, keyed by
everything the times depend on (environment, model shapes, buckets, the kernels'
build), so a warm start reuses it; the engine's start-up line prints it, with the
times. A plan measured while other processes kept the CPU busy (their time would have
been charged to whichever candidate ran beside them) says so there, and is measured
again by the first later start that finds the CPU quiet (`OTHERS_BUSY`). Engines that
would measure the same plan at once (data-parallel replicas on one machine) take turns:
the others wait on a lock file beside it and take the stored plan. An explicit
`attention_backend` / `linear_backend` is never measured.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.attention.kv_cache import KVCacheFormat, cache_shapes, kv_cache_format
from jaxllm.config import ModelConfig
from jaxllm.models.linear import bf16_tiles as mark_bf16_tiles
from jaxllm.models.params import BF16_STEP, INT16_STEP, NO_BF16, PackedWeight, QuantizedWeight, abstract_params
from jaxllm.models.quant import activation_quantization_ready
from jaxllm.platform import busy_cpu_seconds, usable_cpus

logger = logging.getLogger(__name__)

TIE = 0.02  # within 2%, the first candidate (the kernel) is kept: no flapping on noise
# a choice off the default that wins by less is measured a second time: a shared host's busy
# moments made up such wins (docs/bench-log/2026-12-05-xeon-amx.md)
CONFIRM = 0.50
MIXED_GAIN = 0.05  # two weight layouts only for a 5% gain over the best single linear backend
WEIGHT_BYTES = 64 << 20  # distinct weights a linear measurement streams through
REPEATS = 3  # best of at least this many calls,
MIN_SECONDS = 0.1  # or of as many as take this long,
MAX_REPEATS = 50  # but no more than this many
COMPUTE_BOUND_ROWS = 64  # from here a projection is bound by FLOPs, not by reading its weights
# Other processes kept more than this many cores busy on average while a plan was measured:
# it is stored marked so, and a later start that finds them quiet (over QUIET_SAMPLE_S)
# measures again. A server started while another was still exiting once chose XLA's dot at
# 256-448 rows, 1.6-1.9x slower there, and each later start reused that plan
# (docs/bench-log/2026-12-07-zen3-avx2.md); under a test suite's parallel workers every start
# is busy, and reusing the stored plan there spares each one a measurement and its compiles.
OTHERS_BUSY = 0.25
QUIET_SAMPLE_S = 0.25


@dataclasses.dataclass(frozen=True)
class CpuClock:
    """A reading of the wall clock, the busy CPU seconds of the cores this process may
    run on (None where the OS does not say: jaxllm.platform.busy_cpu_seconds; a process
    pinned to other cores is not a neighbour) and this process's own."""

    wall: float
    machine: float | None
    own: float

    @classmethod
    def now(cls) -> CpuClock:
        own = os.times()
        return cls(time.perf_counter(), busy_cpu_seconds(usable_cpus()), own.user + own.system)

    def others_busy_since(self, start: CpuClock) -> float:
        """Cores other processes kept busy on average from `start` to this reading (0
        where the machine's busy time is unknown)."""
        wall = self.wall - start.wall
        if wall <= 0 or self.machine is None or start.machine is None:
            return 0.0
        return max(0.0, (self.machine - start.machine) - (self.own - start.own)) / wall


@dataclasses.dataclass(frozen=True)
class StepBackends:
    """The backends one bucket's step is compiled with (and, for the `cpu` linear
    backend in a bfloat16 model, how the kernel sums: "dot", vdpbf16ps where the
    kernels have it, "float", the float tiles, or "amx", AMX's tiles)."""

    attention: str
    linear: str
    bf16_tiles: str = "dot"


@dataclasses.dataclass(frozen=True)
class BackendPlan:
    """Per token bucket, the backends its step uses; and the seconds per step each
    candidate measured at the buckets that were measured (kind -> backend -> {T: s};
    empty for a kind that was not measured)."""

    buckets: tuple[int, ...]
    choices: tuple[StepBackends, ...]
    seconds: dict[str, dict[str, dict[int, float]]] = dataclasses.field(default_factory=dict)
    source: str = "fixed"  # fixed (nothing measured) | measured | stored
    # the output projection's layout where the `cpu` linear backend runs: packed for the
    # kernel ("cpu"), or left to XLA ("xla": a tied one contracts with the embedding, no copy)
    head: str = "cpu"
    rounds: int = 1  # measured twice where the first round's choices were unsure
    others_busy: float = 0.0  # cores other processes kept busy, on average, while it was measured

    def for_bucket(self, t: int) -> StepBackends:
        return self.choices[self.buckets.index(t)]

    def backends(self, kind: str) -> list[str]:
        """The backends of `kind` some bucket uses, in bucket order."""
        return list(dict.fromkeys(getattr(c, kind) for c in self.choices))

    def describe(self, kind: str) -> str:
        """Which backend runs which buckets, and why: `cpu (1.10-1.40x xla)` or `cpu at
        T=4-64 (1.10-1.20x xla), xla at T=128-512 (1.05-1.30x cpu)`, the ratios being
        the other candidate's measured time over the chosen one's."""
        # the kernel's tiles only where the kernel runs the projections
        used = [getattr(c, kind) if kind != "bf16_tiles" or c.linear == "cpu" else None for c in self.choices]
        times = self.seconds.get(kind, {})
        parts = []
        for backend, lo, hi in _runs(used):
            if backend is None:
                continue
            where = "" if (lo, hi) == (0, len(used)) else f" at T={self.buckets[lo]}-{self.buckets[hi - 1]}"
            other = next((b for b in times if b != backend), None)
            measured = [t for t in self.buckets[lo:hi] if other and t in times[backend]]
            why = ""
            if measured:
                ratios = [times[other][t] / times[backend][t] for t in measured]
                why = f" ({min(ratios):.2f}-{max(ratios):.2f}x {other})"
            parts.append(f"{backend}{where}{why}")
        source = "measured twice" if self.source == "measured" and self.rounds == 2 else self.source
        if self.others_busy > OTHERS_BUSY:
            source += f" while others kept {self.others_busy:.2f} cores busy"
        return ", ".join(parts) + (f" [{source}]" if times else "")

    def bf16_products(self, param_dtype) -> bool:
        """Whether the cpu attention kernel multiplies a model's queries and probabilities
        as bfloat16 (ragged_paged_attention_cpu's `bf16_products`): a bfloat16 model's,
        unless this plan timed the kernel's projections at its largest measured bucket
        faster with the float tiles than with vdpbf16ps by more than TIE, with no AMX
        tiles among the candidates: the attention's paired path (vdpbf16ps) then ran
        slower than its float path too (an Intel Xeon without AMX for the process:
        docs/bench-log/2026-12-05-xeon-amx.md). Unmeasured, yes (the kernel rounds only
        where the library has vdpbf16ps)."""
        if jnp.dtype(param_dtype) != jnp.bfloat16:
            return False
        times = self.seconds.get("bf16_tiles", {})
        if "amx" in times or not {"dot", "float"} <= times.keys():
            return True
        t = max(times["dot"])
        return times["float"][t] * (1 + TIE) >= times["dot"][t]

    def unsure(self) -> list[str]:
        """The measured choices off their default (a kind's first candidate; for the
        output projection, XLA's layout) that win by less than CONFIRM, which a busy
        moment of a shared machine can make up: `linear xla at T=128 (1.04x cpu)`."""
        found = []
        for kind in ("attention", "linear", "bf16_tiles"):
            times = self.seconds.get(kind)
            if not times:
                continue
            first = next(iter(times))  # the candidates' order
            for t in times[first]:
                chosen = getattr(self.for_bucket(t), kind)
                if chosen != first and chosen in times and times[first][t] < times[chosen][t] * (1 + CONFIRM):
                    found.append(f"{kind} {chosen} at T={t} ({times[first][t] / times[chosen][t]:.2f}x {first})")
        head = self.seconds.get("head")
        if head and self.head == "cpu":
            rows = min(head["cpu"])  # the sampling rows
            if head["xla"][rows] < head["cpu"][rows] * (1 + CONFIRM):
                found.append(f"output projection cpu at {rows} rows ({head['xla'][rows] / head['cpu'][rows]:.2f}x xla)")
        return found

    def describe_tiles(self) -> str:
        """`; bfloat16 sums dot (1.10-1.30x float)` where the kernel's bfloat16 tiles were
        measured, `; kept blocks' activations int16 at T=1-64 (...), bfloat16 at T=128-512
        (...)` where int16 and bfloat16 were (INT16_STEP, BF16_STEP); else empty."""
        times = self.seconds.get("bf16_tiles")
        if not times:
            return ""
        what = "kept blocks' activations" if INT16_STEP in times else "bfloat16 sums"
        return f"; {what} {self.describe('bf16_tiles')}"

    def describe_head(self) -> str:
        """`xla (1.29x cpu at 512 rows, 0.98x at 64)`: the output projection's layout and
        the other's measured time over the chosen one's, per number of rows."""
        times = self.seconds.get("head")
        if not times:
            return self.head
        other = next(b for b in times if b != self.head)
        mine, theirs = times[self.head], times[other]
        parts = [f"{theirs[r] / mine[r]:.2f}x" + (f" {other} at {r} rows" if i == 0 else f" at {r}")
                 for i, r in enumerate(sorted(mine, reverse=True))]
        return f"{self.head} ({', '.join(parts)})"

    def to_json(self) -> str:
        return json.dumps({"buckets": self.buckets, "choices": [dataclasses.asdict(c) for c in self.choices],
                           "seconds": self.seconds, "head": self.head, "rounds": self.rounds,
                           "others_busy": self.others_busy})

    @classmethod
    def from_json(cls, text: str) -> BackendPlan:
        d = json.loads(text)
        seconds = {kind: {b: {int(t): v for t, v in per.items()} for b, per in by.items()}
                   for kind, by in d["seconds"].items()}
        return cls(tuple(d["buckets"]), tuple(StepBackends(**c) for c in d["choices"]), seconds, "stored",
                   d.get("head", "cpu"), d.get("rounds", 1), d.get("others_busy", 0.0))


def _runs(values: list[str | None]) -> list[tuple[str | None, int, int]]:
    """Maximal runs of equal values: (value, start, end)."""
    runs: list[tuple[str | None, int, int]] = []
    for i, v in enumerate(values):
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1], i + 1)
        else:
            runs.append((v, i, i + 1))
    return runs


def measured_buckets(buckets: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The buckets timed: every other one and the largest (each compile of a
    measurement costs ~0.1-1 s; neighbours differ by at most 2x in T). The others take
    the choice of the nearest smaller measured bucket."""
    return sorted(set(buckets[::2]) | {buckets[-1]})


def plan_backends(
    buckets: Sequence[tuple[int, int]],
    attention: Sequence[str],
    linear: Sequence[str],
    measure: Callable[[str, str, int, int], float] | None,
    bf16_tiles: Sequence[str] = ("dot",),
) -> BackendPlan:
    """Each bucket (T, S) gets, per kind, the candidate `measure(kind, backend, T, S)`
    (seconds per step) finds fastest at it or at the nearest smaller measured bucket; a
    kind with one candidate is not measured. The first candidate wins a tie within TIE.
    Linear backends mix across buckets only where that gains MIXED_GAIN (a second copy
    of the weights). With several `bf16_tiles` and the kernel a linear candidate, the
    kernel's tiles are chosen first, per bucket alike, and the kernel's time is that of
    the tiles chosen, timed once more beside the other linear candidates (the faster of
    its two times; `measure` names the kernel with float tiles `cpu/float`, with AMX's
    `cpu/amx`). Where a choice off the default wins by less than CONFIRM
    (`BackendPlan.unsure`), everything is measured once more and chosen again on each
    call's faster time of the two rounds: load only slows a call, and a plan measured
    in a busy moment is stored and reused (docs/bench-log/2026-12-03-xeon-amx.md)."""
    if measure is None:
        return _plan_round(buckets, attention, linear, None, bf16_tiles)
    fastest = _FastestOfRounds(measure)
    plan = _plan_round(buckets, attention, linear, fastest, bf16_tiles)
    unsure = plan.unsure()
    if not unsure:
        return plan
    logger.info("measuring the backends again: %s won by under %.0f%%", "; ".join(unsure), 100 * CONFIRM)
    return dataclasses.replace(_plan_round(buckets, attention, linear, fastest, bf16_tiles), rounds=2)


class _FastestOfRounds:
    """`measure`, each call's result the fastest time it has given for those arguments."""

    def __init__(self, measure: Callable[[str, str, int, int], float]):
        self.measure = measure
        self.best: dict[tuple[str, str, int, int], float] = {}

    def __call__(self, kind: str, backend: str, t: int, s: int) -> float:
        key = (kind, backend, t, s)
        self.best[key] = min(self.best.get(key, float("inf")), self.measure(*key))
        return self.best[key]


def _plan_round(buckets, attention, linear, measure, bf16_tiles) -> BackendPlan:
    """plan_backends' choice from one round of measurements."""
    sample = measured_buckets(buckets)
    seconds: dict[str, dict[str, dict[int, float]]] = {}
    picks: dict[str, list[str]] = {"bf16_tiles": [bf16_tiles[0]] * len(buckets)}
    tiles_at = dict.fromkeys((t for t, _ in sample), bf16_tiles[0])
    if measure is not None and len(bf16_tiles) > 1 and "cpu" in linear:
        seconds["bf16_tiles"] = {tile: {t: 0.0 for t, _ in sample} for tile in bf16_tiles}
        for t, s in sample:
            for tile in bf16_tiles:
                seconds["bf16_tiles"][tile][t] = measure("linear", _kernel(tile), t, s)
        tiles_at = _fastest_at(sample, bf16_tiles, seconds["bf16_tiles"])
        picks["bf16_tiles"] = [tiles_at[max(m for m, _ in sample if m <= t)] for t, _ in buckets]
    for kind, candidates in (("attention", attention), ("linear", linear)):
        if len(candidates) == 1:
            picks[kind] = [candidates[0]] * len(buckets)
            continue
        seconds[kind] = {b: {} for b in candidates}
        for t, s in sample:  # candidates alternate: a busy moment of a shared machine hits both
            for b in candidates:
                # the kernel with its tiles, timed again beside the others (measure keeps each
                # call's faster time): from the tiles' pass alone, a busy moment between the two
                # passes flipped prefill buckets to XLA (docs/bench-log/2026-12-05-xeon-amx.md)
                tiles = "bf16_tiles" in seconds and kind == "linear" and b == "cpu"
                seconds[kind][b][t] = measure(kind, _kernel(tiles_at[t]) if tiles else b, t, s)
        best_at = _fastest_at(sample, candidates, seconds[kind])
        if kind == "linear":
            best_at = _one_layout_unless_worth_two(best_at, seconds[kind], candidates)
        picks[kind] = [best_at[max(m for m, _ in sample if m <= t)] for t, _ in buckets]
    choices = tuple(StepBackends(a, lin, tiles if lin == "cpu" else "dot")
                    for a, lin, tiles in zip(picks["attention"], picks["linear"], picks["bf16_tiles"]))
    head = _head_layout(buckets, picks["linear"], linear, measure, seconds, _kernel(picks["bf16_tiles"][-1]))
    return BackendPlan(tuple(t for t, _ in buckets), choices, seconds, "measured" if seconds else "fixed", head)


def _kernel(tiles: str) -> str:
    """The `cpu` linear backend summing bfloat16 with `tiles`, as `measure` names it."""
    return "cpu" if tiles == "dot" else f"cpu/{tiles}"


def _fastest_at(sample, candidates: Sequence[str], times: dict[str, dict[int, float]]) -> dict[int, str]:
    """Per sampled bucket, the candidate with the least time; the first one unless
    another beats it by more than TIE."""
    best_at = {}
    for t, _ in sample:
        best = min(candidates, key=lambda b: times[b][t])
        best_at[t] = candidates[0] if times[candidates[0]][t] <= times[best][t] * (1 + TIE) else best
    return best_at


def _head_layout(buckets, picked: list[str], linear: Sequence[str], measure, seconds, kernel: str = "cpu") -> str:
    """Where buckets run the `cpu` linear backend and XLA's dot is a candidate too: the
    output projection's layout, measured on its own at the largest bucket's sequence
    rows (the logits every step samples from) and token rows (a step scoring its
    prompt takes logits of every token). XLA's unless it loses the sampling rows by
    more than MIXED_GAIN or both together (leaving it to XLA also drops the packed
    copy of a tied embedding). On an AVX-512 Xeon (native build; the AVX2 build not
    measured for it) the dense kernel tied XLA at 64 rows and lost at 512, 152 against
    118 ms."""
    if measure is None or "cpu" not in picked or "xla" not in linear:
        return "cpu"
    t, s = buckets[-1]
    seconds["head"] = {b: {rows: measure("head", kernel if b == "cpu" else b, t, rows) for rows in sorted({s, t})}
                       for b in ("cpu", "xla")}
    cpu, xla = seconds["head"]["cpu"], seconds["head"]["xla"]
    if xla[s] > cpu[s] * (1 + MIXED_GAIN) or sum(xla.values()) > sum(cpu.values()):
        return "cpu"
    return "xla"


def _one_layout_unless_worth_two(best_at: dict[int, str], seconds: dict[str, dict[int, float]],
                                 candidates: Sequence[str]) -> dict[int, str]:
    """Linear backends differ in weight layout: buckets that disagree cost a second copy
    of the projection weights. Keep the per-bucket mix only if its summed time beats
    the best single backend's by MIXED_GAIN; else that backend everywhere (the first
    candidate within TIE). On a shared machine, ratios near 1 flip between neighbouring
    buckets on noise (seen: 1.01-1.15x either way); that is not worth the memory."""
    if len(set(best_at.values())) == 1:
        return best_at
    total = {b: sum(seconds[b].values()) for b in candidates}
    mixed = sum(seconds[b][t] for t, b in best_at.items())
    single = min(candidates, key=total.get)
    if total[candidates[0]] <= total[single] * (1 + TIE):
        single = candidates[0]
    if mixed < total[single] * (1 - MIXED_GAIN):
        return best_at
    return dict.fromkeys(best_at, single)


# ------------------------------------------------------------ measurements


def _best_of(fn, *args) -> float:
    """The fastest of at least REPEATS calls and of as many as fit MIN_SECONDS (at
    most MAX_REPEATS), after a warm one: a small step takes ~1 ms, where one
    interruption of a shared machine is several."""
    jax.block_until_ready(fn(*args))  # compile and warm
    best, spent, n = float("inf"), 0.0, 0
    while n < REPEATS or (spent < MIN_SECONDS and n < MAX_REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        elapsed = time.perf_counter() - start
        best, spent, n = min(best, elapsed), spent + elapsed, n + 1
    return best


class StepTimer:
    """`measure(kind, backend, T, S)` for plan_backends: seconds one step of bucket
    (T, S) spends in the projections (linear) or attention of a model of `cfg`'s
    shapes, on random data (the times do not depend on the values). Weights are of
    `dtype`, hidden states of `activation_dtype` (default: `dtype`), the KV cache in
    `kv_format` (default: `dtype`'s, as `auto`); kept blocks in bfloat16 where `dtype` is
    or `blocks_in_bf16` says so, or multiplying int16 activations where `blocks_in_int16`
    does (those of 32 inputs or a multiple: as the engine marks them)."""

    def __init__(self, cfg: ModelConfig, dtype, *, block_size: int, max_model_len: int,
                 activation_dtype=None, kv_format: KVCacheFormat | None = None, blocks_in_bf16: bool = False,
                 blocks_in_int16: bool = False) -> None:
        self.cfg, self.dtype = cfg, jnp.dtype(dtype)
        self.blocks_in_bf16 = blocks_in_bf16 or self.dtype == jnp.bfloat16
        self.blocks_in_int16 = blocks_in_int16
        self.activation_dtype = jnp.dtype(activation_dtype or dtype)
        self.kv_format = kv_format or kv_cache_format("auto", self.dtype)
        self.block_size, self.context = block_size, max(1, min(512, max_model_len // 2))
        self.rng = np.random.default_rng(0)
        self._weights: dict[str, tuple] = {}  # linear backend -> (layers, head), in its layout
        self._fns = self._linear_fns()

    def __call__(self, kind: str, backend: str, t: int, s: int) -> float:
        backend, _, tiles = backend.partition("/")  # cpu/float, cpu/amx: the kernel's tiles for bfloat16
        if kind == "head":  # `s`: the rows of the output projection
            return self.head(backend, s, tiles=tiles or "dot")
        if kind == "linear":
            return self.linear(backend, t, s, tiles=tiles or "dot")
        return self.attention(backend, t, s)

    def _filled(self, shape, dtype=None) -> jax.Array:
        """An array of `shape` (the values do not change the times; filling is cheap),
        of the activations' dtype unless given (integer values: ones)."""
        dtype = jnp.dtype(dtype or self.activation_dtype)
        return jnp.full(shape, 1 if jnp.issubdtype(dtype, jnp.integer) else 0.01, dtype)

    def _linear_weights(self, backend: str):
        if backend not in self._weights:
            self._weights[backend] = self._make_linear_weights(backend)
        return self._weights[backend]

    def _make_linear_weights(self, backend: str):
        from jaxllm.models.linear import pack_weight, pallas_weight

        p = abstract_params(self.cfg, self.dtype)
        layer = p.layers[0]
        # a MoE layer's experts: [E, in, out] each, grouped matmuls (uniform routing);
        # a quantized model's projections as it holds them (values, scales, mins)
        weights = [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
        per_layer = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(weights))
        copies = max(1, min(self.cfg.num_layers, -(-WEIGHT_BYTES // per_layer)))
        def filled(w):  # kept blocks multiplying in bfloat16 (linear.in_dtype) or int16 as the engine marks them
            w = jax.tree.map(lambda a: self._filled(a.shape, a.dtype), w)
            if not isinstance(w, QuantizedWeight):
                return w
            if self.blocks_in_bf16 and w.group:
                return w.replace(float_dtype="bfloat16")
            return w.replace(activations="int16") if self.blocks_in_int16 and activation_quantization_ready(w) else w

        layout = {"cpu": pack_weight, "pallas": lambda w: pallas_weight(w, self.activation_dtype)
                  if isinstance(w, QuantizedWeight) else w}.get(backend, lambda w: w)
        layers = [[layout(filled(w)) for w in weights] for _ in range(copies)]
        d, v = self.cfg.hidden_size, self.cfg.vocab_size
        if backend == "cpu":
            head = pack_weight(self._filled((d, v), self.dtype))
        else:  # as compute_logits runs it: against the embedding when tied
            head = self._filled((v, d) if self.cfg.tie_word_embeddings else (d, v), self.dtype)
        return layers, head

    def _linear_fns(self):
        from jaxllm.models.linear import grouped_linear, linear

        q, moe = self.cfg.q_size, self.cfg.is_moe(0)
        f, fe = self.cfg.intermediate_size, self.cfg.moe_intermediate_size

        def layers_fn(x, layers):
            for wqkv, wo, w_gate_up, w_down in layers:
                qkv = linear(x, wqkv)
                x = x + linear(qkv[:, :q], wo)
                x = x + (experts(x, w_gate_up, w_down) if moe else linear(linear(x, w_gate_up)[:, :f], w_down))
            return x

        def experts(x, w_gate_up, w_down):  # each token's k rows, spread evenly over the experts
            t, e, k = x.shape[0], self.cfg.num_experts, self.cfg.num_experts_per_tok
            sizes = jnp.asarray(np.bincount(np.arange(t * k) % e, minlength=e), jnp.int32)
            up = grouped_linear(jnp.repeat(x, k, axis=0), w_gate_up, sizes)
            return grouped_linear(up[:, :fe], w_down, sizes).reshape(t, k, -1).sum(axis=1)

        def head_fn(x, head):
            if not isinstance(head, PackedWeight) and head.shape[0] != x.shape[1]:  # tied: [V, D]
                return jnp.einsum("sd,vd->sv", x.astype(head.dtype), head, preferred_element_type=jnp.float32)
            return linear(x, head, preferred_element_type=jnp.float32)

        return jax.jit(layers_fn), jax.jit(head_fn)

    def linear(self, backend: str, t: int, s: int, tiles: str = "dot") -> float:
        layers = mark_bf16_tiles(self._linear_weights(backend)[0], tiles)
        layers_fn = self._fns[0]
        x = self._filled((t, self.cfg.hidden_size))
        if t >= COMPUTE_BOUND_ROWS:  # the weights' streaming no longer decides: fewer copies, quicker
            layers = layers[:2]
        return _best_of(layers_fn, x, layers) / len(layers) * self.cfg.num_layers

    def head(self, backend: str, rows: int, tiles: str = "dot") -> float:
        """The output projection of `rows` rows in `backend`'s layout."""
        head = mark_bf16_tiles(self._linear_weights(backend)[1], tiles)
        return _best_of(self._fns[1], self._filled((rows, self.cfg.hidden_size)), head)

    def attention(self, backend: str, t: int, s: int) -> float:
        from jaxllm.attention.backends import get_attention_fn

        cfg, bs = self.cfg, self.block_size
        n = min(t, s)
        q_lens = np.ones(n, np.int32)
        q_lens[-1] += t - n  # the rest of the tokens: one prefill chunk
        ctx = self.rng.integers(self.context * 3 // 4, self.context * 5 // 4 + 1, n).astype(np.int32)
        ctx[-1] = 0 if t > n else ctx[-1]
        kv_lens = ctx + q_lens
        blocks = -(-kv_lens // bs)
        tables = np.zeros((n, int(blocks.max())), np.int32)
        ids = self.rng.permutation(np.arange(1, int(blocks.sum()) + 1)).astype(np.int32)  # scattered, as in use
        starts = np.concatenate([[0], np.cumsum(blocks)])
        for i in range(n):
            tables[i, : blocks[i]] = ids[starts[i]:starts[i + 1]]
        (cache,) = cache_shapes(self.kv_format, 1, int(blocks.sum()) + 1, bs, cfg.num_kv_heads, cfg.head_dim)
        cache = jax.tree.map(lambda a: self._filled(a.shape, a.dtype), cache)
        args = (self._filled((t, cfg.num_heads, cfg.head_dim)), cache.k, cache.v,
                jnp.asarray(kv_lens), jnp.asarray(tables),
                jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)), jnp.asarray(np.int32(n)))
        fn = jax.jit(functools.partial(get_attention_fn(backend, bf16_products=self.dtype == jnp.bfloat16),
                                       sm_scale=cfg.head_dim ** -0.5,
                                       cache_dtype=cache.dtype))
        return _best_of(lambda *a: fn(*a, k_scale=cache.k_scale, v_scale=cache.v_scale), *args) * cfg.num_layers


def bf16_tile_candidates(dtype, linear: Sequence[str], float32_steps: bool = False,
                         int16_steps: bool = False) -> list[str]:
    """The kernel's ways to sum a bfloat16 model's projections: vdpbf16ps and the float
    tiles where the library holds both (built with AVX512_BF16), and AMX's tiles where
    the CPU has them, when the kernel is a linear candidate; else the one it has. With
    `float32_steps` (a float32 model's kept blocks that multiply in bfloat16 because
    activation_quantization `auto` chose it) they may also multiply in float32 at a step
    (NO_BF16, last: it wins only by more than TIE). With `int16_steps` (a float32
    model's kept blocks that `auto` multiplies with int16 activations), int16 or, where
    the library has vdpbf16ps, bfloat16 from the same arrays (INT16_STEP, BF16_STEP)."""
    from jaxllm import cpu_kernels

    if "cpu" not in linear or not cpu_kernels.has_bf16_dot():
        return [INT16_STEP] if int16_steps else ["dot"]
    if int16_steps:
        return [INT16_STEP, BF16_STEP]
    if jnp.dtype(dtype) != jnp.bfloat16:
        return ["dot"]
    tiles = ["dot", "float", "amx"] if cpu_kernels.has_amx() else ["dot", "float"]
    return [*tiles, NO_BF16] if float32_steps else tiles


def backend_plan(
    cfg: ModelConfig,
    dtype,
    buckets: Sequence[tuple[int, int]],
    attention: Sequence[str],
    linear: Sequence[str],
    *,
    block_size: int,
    max_model_len: int,
    store_dir=None,
    activation_dtype=None,
    kv_format: KVCacheFormat | None = None,
    bf16_tiles: Sequence[str] | None = None,
    before_measuring: Callable[[], object] | None = None,
    blocks_in_bf16: bool = False,
    float32_steps: bool = False,
    blocks_in_int16: bool = False,
) -> BackendPlan:
    """The plan for these buckets and candidates: fixed where each kind has one
    candidate; else the one stored under `store_dir` for the same environment, model
    shapes and dtypes (`dtype`: the weights'; `activation_dtype`, default `dtype`),
    buckets and kernel build, or measured now (and stored). `bf16_tiles`: the kernel's
    bfloat16 tiles to choose from (default: `bf16_tile_candidates`); `blocks_in_bf16`: a
    float32 model's kept blocks multiply in bfloat16 (activation_quantization bfloat16),
    timed so, with the tiles a bfloat16 model has, and with `float32_steps` (auto chose
    bfloat16 for them) in float32 too (NO_BF16); `blocks_in_int16`: its kept blocks
    multiply int16 activations (auto chose it), timed so, and in bfloat16 from the same
    arrays where the library has vdpbf16ps (BF16_STEP). `before_measuring`
    is called first when it measures: the engine waits there for its weights' loading
    thread, which would otherwise share the cores with the timed calls and could store
    a plan of the wrong backends (docs/bench-log/2026-11-29-against-vllm.md)."""
    tiles = list(bf16_tiles) if bf16_tiles is not None else bf16_tile_candidates(
        jnp.bfloat16 if blocks_in_bf16 else dtype, linear, blocks_in_bf16 and float32_steps, blocks_in_int16)
    if len(attention) == 1 and len(linear) == 1 and len(tiles) == 1:
        return plan_backends(buckets, attention, linear, measure=None)
    from jaxllm.cpu_kernels.build import library_path
    from jaxllm.worker.executable_cache import ExecutableStore

    activation_dtype = jnp.dtype(activation_dtype or dtype)
    kv_format = kv_format or kv_cache_format("auto", dtype)
    store = ExecutableStore(store_dir, "backend-plan", cfg, jnp.dtype(dtype).name, activation_dtype.name, kv_format.name,
                            tuple(buckets), tuple(attention),
                            tuple(linear), tuple(tiles), block_size, max_model_len, library_path().name,
                            blocks_in_bf16, blocks_in_int16)
    with store.lock("backends.json", on_wait=lambda: logger.info(
            "another process is measuring the backends of this model and these buckets: waiting for its plan")):
        stored = _stored_plan(store, buckets)
        if stored is not None and not _measure_again(stored):
            return stored
        if before_measuring is not None:
            before_measuring()
        timer = StepTimer(cfg, dtype, block_size=block_size, max_model_len=max_model_len,
                          activation_dtype=activation_dtype, kv_format=kv_format, blocks_in_bf16=blocks_in_bf16,
                          blocks_in_int16=blocks_in_int16)
        return _measured_plan(store, buckets, attention, linear, timer, tiles)


def _measured_plan(store, buckets, attention, linear, timer, tiles) -> BackendPlan:
    """The plan measured now with `timer`, logged and stored (marked with the cores other
    processes kept busy meanwhile)."""
    start = CpuClock.now()
    plan = plan_backends(buckets, attention, linear, timer, tiles)
    end = CpuClock.now()
    plan = dataclasses.replace(plan, others_busy=round(end.others_busy_since(start), 2))
    logger.info("measured the backends in %.1f s: attention %s; linear %s; output projection %s%s",
                end.wall - start.wall, plan.describe("attention"), plan.describe("linear"),
                plan.describe_head(), plan.describe_tiles())
    if plan.others_busy > OTHERS_BUSY:
        logger.warning("other processes kept %.2f cores busy while the backends were measured: the plan is "
                       "stored, and a later start that finds the CPU quiet measures them again", plan.others_busy)
    store.save_text("backends.json", plan.to_json())
    return plan


def _stored_plan(store, buckets: Sequence[tuple[int, int]]) -> BackendPlan | None:
    """The plan stored for these buckets, if any (an unreadable one is ignored, saying so)."""
    stored = store.load_text("backends.json")
    if stored is None:
        return None
    try:
        plan = BackendPlan.from_json(stored)
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring an unreadable stored backend plan (%s)", e)
        return None
    return plan if plan.buckets == tuple(t for t, _ in buckets) else None


def _measure_again(stored: BackendPlan) -> bool:
    """Whether a stored plan is measured again: only one measured while other processes
    kept the CPU busy, and only if they are quiet now (QUIET_SAMPLE_S of this process
    waiting)."""
    if stored.others_busy <= OTHERS_BUSY:
        return False
    start = CpuClock.now()
    time.sleep(QUIET_SAMPLE_S)
    now = CpuClock.now().others_busy_since(start)
    if now > OTHERS_BUSY:
        logger.info("the stored backend plan was measured while other processes kept %.2f cores busy; they keep "
                    "%.2f busy now: using it", stored.others_busy, now)
        return False
    logger.info("the stored backend plan was measured while other processes kept %.2f cores busy; the CPU is "
                "quiet now: measuring again", stored.others_busy)
    return True
