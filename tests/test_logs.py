"""The server's logging: jaxllm's records at --log-level / JAXLLM_LOG_LEVEL, other
libraries' (orbax's checkpoint chatter above all) only from WARNING up unless debug.
Each case runs in its own interpreter: logging is process-wide."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
import numpy as np
import orbax.checkpoint as ocp
from jaxllm.logs import configure_logging, log_level
configure_logging(log_level(sys.argv[1] or None), tag="engine core")
with ocp.StandardCheckpointer() as checkpointer:  # orbax logs at INFO while saving
    checkpointer.save(sys.argv[2], {"a": np.zeros(3)})
    checkpointer.wait_until_finished()
logging.getLogger("jaxllm.engine").info("model loaded")
logging.getLogger("jaxllm.engine").debug("step details")
logging.getLogger("some.library").warning("a library warning")
"""


def run(tmp_path, *args, env=None) -> str:
    argv = [sys.executable, "-c", SCRIPT, *args]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=os.environ | (env or {}))
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_info_shows_jaxllm_and_library_warnings_only(tmp_path):
    err = run(tmp_path, "info", str(tmp_path / "ckpt"))
    assert "INFO [engine core] jaxllm.engine: model loaded" in err
    assert "a library warning" in err
    assert "step details" not in err
    assert [line for line in err.splitlines() if " INFO " in line and "jaxllm." not in line] == []  # orbax's


def test_debug_shows_everything_and_the_environment_sets_the_level(tmp_path):
    err = run(tmp_path, "debug", str(tmp_path / "ckpt"))
    assert "step details" in err and any(" INFO " in line and "jaxllm." not in line for line in err.splitlines())
    err = run(tmp_path, "", str(tmp_path / "ckpt2"), env={"JAXLLM_LOG_LEVEL": "warning"})
    assert "model loaded" not in err and "a library warning" in err


def test_unknown_level_is_an_error():
    from jaxllm.logs import log_level

    with pytest.raises(ValueError, match="log level: must be one of"):
        log_level("verbose")
