"""update_weights of an engine over several processes (issue 64): process 0 checks the
weights first, then every worker reads the same path while process 0 places its own
share, and a worker's refusal reaches the caller. Here the workers are a stand-in that
records its calls (the real ones, on a local Ray cluster: tests/engine/test_ray_cluster.py,
slow); the oracle is an engine started from the other weights."""

from __future__ import annotations

import pytest

from tests.support.llm import SMALL, make_llm
from tests.support.ray_cluster import greedy_tokens


class StandInExecutor:
    """What EngineCore asks of a RayExecutor, recorded; `refuse`: the workers' reason."""

    def __init__(self, events: list, refuse: str = "") -> None:
        self.events, self.refuse = events, refuse

    def send(self, sched, bitmask) -> None:
        pass

    def update_weights_from_path(self, path: str):
        self.events.append(("workers read", path))
        return ["call"]

    def wait(self, calls) -> None:
        self.events.append(("workers done", calls))
        if self.refuse:
            raise ValueError(f"{self.refuse} (on a worker process)")

    def close(self) -> None:
        pass


@pytest.fixture
def engines(test_models_dir, tmp_path):
    import make_test_model

    other = make_test_model.write_model(tmp_path, "llama", seed=7)
    want = greedy_tokens(make_llm(other.parent, **SMALL))  # the folder's "llama": the other weights
    return make_llm(test_models_dir, **SMALL), str(other), want


def test_every_process_reads_the_path_and_process_0_places_its_share(engines, test_models_dir, monkeypatch):
    llm, other, want = engines
    core, events = llm.llm_engine.core, []
    before = greedy_tokens(llm)
    monkeypatch.setattr(core, "executor", StandInExecutor(events))
    with pytest.raises(ValueError, match="takes weights from a path every node reads"):
        core.update_weights(llm.llm_engine.core.model.params)  # arrays of this process alone
    with pytest.raises(ValueError, match="weights: "):  # another model's: refused before any worker reads it
        core.update_weights_from_path(str(test_models_dir / "qwen3"))
    assert events == [] and greedy_tokens(llm) == before
    core.update_weights_from_path(other)
    assert events == [("workers read", other), ("workers done", ["call"])]
    assert greedy_tokens(llm) == want
    monkeypatch.setattr(core, "executor", StandInExecutor(events, refuse="weights: no such file"))
    with pytest.raises(ValueError, match="on a worker process"):
        core.update_weights_from_path(other)
