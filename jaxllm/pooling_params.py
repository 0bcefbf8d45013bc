"""What a pooling request asks (embeddings, raw pooled states) and how a pooling model
pools: plain data, vLLM's names.

`PoolerConfig` is the model's pooler (one per engine: `--pooler-config`, else read from a
sentence-transformers folder, else the family's default); `PoolingParams` is one
request's: its task, `dimensions` (matryoshka truncation), `normalize` and
`truncate_prompt_tokens`.
"""

from __future__ import annotations

import dataclasses

from jaxllm.json_options import json_object

# How a sequence's hidden states become its vector: the last token's (decoders), their
# mean, the first token's ([CLS]), or every token's (ALL: one vector per token).
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# embed: one vector per input, normalized as the model says; token_embed: one per token
# (ALL pooling); encode: the pooled hidden state, never normalized (LLM.encode's default).
POOLING_TASKS = ("embed", "token_embed", "encode")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """A pooling model's pooler: `pooling_type` (POOLING_TYPES) and whether embeddings
    are L2-normalized by default; `dimensions`: the matryoshka sizes it was trained for
    (empty: `dimensions` is refused; (0,): any size up to its hidden size). A field left
    None (a user's `pooler_config` that does not set it) is the model's (`over`)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config: unknown pooling_type {self.pooling_type!r}; choose one of "
                             f"{', '.join(POOLING_TYPES)}")

    @classmethod
    def parse(cls, value: PoolerConfig | str | dict | None) -> PoolerConfig | None:
        """From vLLM's JSON (`{"pooling_type": "MEAN", "normalize": true}`), a dict, or
        itself; None stays None (the model's own)."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        value = json_object(value, "pooler_config", (f.name for f in dataclasses.fields(cls)))
        kind, normalize, dims = value.get("pooling_type"), value.get("normalize"), value.get("dimensions")
        return cls(None if kind is None else str(kind).upper(), None if normalize is None else bool(normalize),
                   None if dims is None else tuple(int(d) for d in dims))

    def over(self, model: PoolerConfig) -> PoolerConfig:
        """The model's pooler with the fields this one sets."""
        return PoolerConfig(*(mine if mine is not None else theirs for mine, theirs in
                              zip(dataclasses.astuple(self), dataclasses.astuple(model), strict=True)))


@dataclasses.dataclass
class PoolingParams:
    """One pooling request's parameters (vLLM's `PoolingParams`).

    task: a POOLING_TASKS name. dimensions: keep the first `dimensions` values of the
    embedding (before normalizing: matryoshka), where the model supports it.
    normalize: L2-normalize the embedding (None: as the model's pooler says; `encode`
    never). truncate_prompt_tokens: a prompt longer than this keeps its first tokens (a
    text's through the tokenizer, its special tokens kept, as sentence-transformers
    truncates); -1: the model's length; None: a prompt past the model's length is an error.
    """

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task: unknown {self.task!r}; choose one of {', '.join(POOLING_TASKS)}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions: must be a positive integer, got {self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens: must be a positive integer or -1, got {t!r}")

    def check_for_model(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """ValueError (naming the field) where the model cannot serve these parameters."""
        if self.task == "token_embed" and pooler.pooling_type != "ALL":
            raise ValueError(f"task: token_embed needs a model served with pooling_type ALL, this one pools "
                             f"{pooler.pooling_type} (--pooler-config '{{\"pooling_type\": \"ALL\"}}')")
        if self.task != "token_embed" and pooler.pooling_type == "ALL":
            raise ValueError(f"task: {self.task} needs one vector per input; this model is served with pooling_type "
                             "ALL (one per token): use token_embed")
        if self.dimensions is None:
            return
        if not pooler.dimensions:  # None or ()
            raise ValueError("dimensions: this model does not support matryoshka representations")
        if self.dimensions > hidden_size or (pooler.dimensions != (0,) and self.dimensions not in pooler.dimensions):
            sizes = f"1..{hidden_size}" if pooler.dimensions == (0,) else ", ".join(map(str, pooler.dimensions))
            raise ValueError(f"dimensions: {self.dimensions} is not one this model supports ({sizes})")

    def normalizes(self, pooler: PoolerConfig) -> bool:
        """Whether the vector is L2-normalized: the request's choice, else the model's
        for embeddings; `encode` returns the pooled state as it is."""
        if self.normalize is not None:
            return self.normalize
        return bool(pooler.normalize) and self.task != "encode"
