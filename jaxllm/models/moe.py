"""Mixture-of-Experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's
top-k experts; the tokens are grouped by expert and every group multiplies only its
expert's weights (`grouped_linear`: the dense kernel per group on a CPU with packed
weights, `jax.lax.ragged_dot` otherwise), so the work follows the tokens routed, k per
token, not tokens x experts (except under ragged_dot on XLA:CPU, which computes them all).

Routing as HF computes it: softmax over the router's float32 logits, top-k, the k
probabilities renormalized to sum to 1 where the config says (Mixtral always; Qwen's
`norm_topk_prob`), each expert's output scaled by its token's probability and the k
outputs summed. Qwen2-MoE adds a shared expert (a dense gated MLP every token takes)
scaled by the sigmoid of its own gate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxllm.config import ModelConfig
from jaxllm.models.linear import all_reduce, grouped_linear, linear
from jaxllm.models.params import LayerParams, PackedWeight, QuantizedWeight


def route(logits: Float[Array, "T E"], k: int, normalize: bool
          ) -> tuple[Float[Array, "T k"], Int[Array, "T k"]]:
    """Each token's k experts (in descending probability) and their weights."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def gated(x: Float[Array, "T F2"], act: str) -> Float[Array, "T F"]:
    """act(gate) * up of a fused [gate | up] projection."""
    gate, up = jnp.split(x, 2, axis=-1)
    return (jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)) * up


def experts_mlp(h: Float[Array, "T D"], weights: Float[Array, "T k"], experts: Int[Array, "T k"],
                w_gate_up: Float[Array, "E D F2"] | PackedWeight | QuantizedWeight,
                w_down: Float[Array, "E F D"] | PackedWeight | QuantizedWeight, act: str) -> Float[Array, "T D"]:
    """sum over each token's k experts of weight * expert(h): the (token, expert) pairs
    sorted by expert, one grouped matmul per projection over the groups
    (jaxllm.models.linear.grouped_linear)."""
    t, k = experts.shape
    num_experts = w_gate_up.experts if isinstance(w_gate_up, PackedWeight) else w_gate_up.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = order // k  # the token of each sorted pair
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    up = grouped_linear(h[rows], w_gate_up, sizes)
    out = grouped_linear(gated(up, act), w_down, sizes)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, out.shape[-1]), jnp.float32).at[rows].add(out).astype(h.dtype)


def moe_mlp(lp: LayerParams, h: Float[Array, "T D"], cfg: ModelConfig, axis: str | None = None
            ) -> Float[Array, "T D"]:
    """The MoE layer's MLP of the normed hidden states `h` (no residual). Under tensor
    parallelism over `axis` every shard routes alike (the router is replicated) and
    holds a slice of each expert's MLP (as of a dense one): the shards' partial sums,
    shared expert included, are summed once."""
    logits = linear(h, lp.router, preferred_element_type=jnp.float32)
    weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out = experts_mlp(h, weights, experts, lp.w_gate_up, lp.w_down, cfg.hidden_act)
    if lp.shared_gate_up is not None:  # Qwen2-MoE: a shared expert, sigmoid-gated
        shared = linear(gated(linear(h, lp.shared_gate_up), cfg.hidden_act), lp.shared_down)
        out = out + jax.nn.sigmoid(linear(h, lp.shared_gate)) * shared
    return all_reduce(out, axis)
