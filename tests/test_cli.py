"""The `jaxllm` command (jaxllm.cli): vLLM's `serve MODEL` shape over jaxllm.serve."""

import os
import subprocess
import sys

import pytest

from jaxllm import cli


def test_the_model_may_be_given_as_vllm_takes_it():
    from jaxllm.serve import parse_args

    assert parse_args(["/models/m", "--port", "9000"]).model == "/models/m"
    assert parse_args(["--host", "0.0.0.0", "/models/m"]).model == "/models/m"  # after the image's own flags
    assert parse_args(["--model", "m"]).model == "m" and parse_args([]).model is None
    with pytest.raises(SystemExit):
        parse_args(["a", "--model", "b"])


def test_help_lists_the_commands_and_an_unknown_one_is_refused(capsys):
    cli.main(["--help"])
    assert "serve" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown command 'srve'"):
        cli.main(["srve"])


def test_jaxllm_serve_model_reaches_the_server(tmp_path):
    """`jaxllm serve MODEL`: the server starts on that model (here one that is not
    there: its start-up error names it, as `python -m jaxllm.serve --model` does)."""
    missing = tmp_path / "no-such-model"
    run = subprocess.run([sys.executable, "-m", "jaxllm.cli", "serve", str(missing), "--port", "0"],
                         capture_output=True, text=True, timeout=120, env=os.environ | {"JAXLLM_API_KEY": ""})
    assert run.returncode == 1 and f"{missing}: no such model file or folder" in run.stderr, run.stderr
