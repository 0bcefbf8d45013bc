"""What LLM.score and the server's /score and /rerank share: how texts pair up and the
score of a pair of embeddings (vLLM's for an embedding model: their cosine)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def score_pairs(first: str | Sequence[str], second: str | Sequence[str], names: tuple[str, str] = ("text_1", "text_2")
                ) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one text against each of the second, or the i-th against the
    i-th; ValueError naming the field (`names`: how the caller calls the two)."""
    a = [first] if isinstance(first, str) else list(first)
    b = [second] if isinstance(second, str) else list(second)
    for name, texts in zip(names, (a, b), strict=True):
        if not texts:
            raise ValueError(f"{name}: must not be empty")
        if not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name}: texts (strings) only")
    if len(a) == 1:
        a = a * len(b)
    if len(a) != len(b):
        raise ValueError(f"{names[1]}: {len(b)} texts against {len(a)} in {names[0]}; give {names[0]} one text, or "
                         f"as many as {names[1]}")
    return a, b


def cosine(u: np.ndarray, v: np.ndarray) -> float:
    """The cosine similarity of two embeddings (their norms' product floored at 1e-12)."""
    return float(np.dot(u, v) / max(float(np.linalg.norm(u) * np.linalg.norm(v)), 1e-12))
