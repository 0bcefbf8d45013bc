"""Logging for the server's processes, as vLLM shows it: jaxllm's own records (model,
KV pool, compilation, warnings) at the chosen level, other libraries' (orbax's
checkpoint chatter, JAX, transformers) only from WARNING up unless the level is DEBUG.

The level comes from `--log-level` or the JAXLLM_LOG_LEVEL environment variable (which
the server sets for its engine core process)."""

from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "JAXLLM_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(value: str | None = None) -> str:
    """The level to use: `value`, else JAXLLM_LOG_LEVEL, else info; ValueError if unknown."""
    level = (value or os.environ.get(LOG_LEVEL_ENV) or "info").lower()
    if level not in LEVELS:
        raise ValueError(f"log level: must be one of {', '.join(LEVELS)}, got {level!r}")
    return level


def configure_logging(level: str, tag: str = "") -> None:
    """Records of the `jaxllm` loggers at `level`; everything else at WARNING, or
    DEBUG when `level` is debug. `tag` marks the process ("engine core")."""
    numeric = getattr(logging, log_level(level).upper())
    prefix = f" [{tag}]" if tag else ""
    logging.basicConfig(format=f"%(asctime)s %(levelname)s{prefix} %(name)s: %(message)s", force=True)
    logging.getLogger().setLevel(logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING)
    logging.getLogger("jaxllm").setLevel(numeric)
    if numeric > logging.DEBUG:
        # transformers warns at import (e.g. that PyTorch is missing) through its own handler
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
