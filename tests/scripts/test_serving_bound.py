"""scripts/serving_bound.py: the decode steps as closed-loop clients run them."""

import serving_bound
from bench_serving import BenchRequest


def test_each_client_takes_the_next_request_when_its_last_ends():
    """Two clients, outputs 3, 1, 2: client 0 runs request 0 in steps 0-2; client 1 runs
    request 1 in step 0, then request 2 in steps 1-2. Each step lists the decoding
    sequences' context lengths (prompt plus the tokens generated before it)."""
    reqs = [BenchRequest(prompt=[0] * p, output_len=n) for p, n in ((5, 3), (7, 1), (2, 2))]
    steps = serving_bound.decode_steps(reqs, clients=2)
    assert steps == [[5, 7], [6, 2], [7, 3]]
    assert sum(map(len, steps)) == sum(r.output_len for r in reqs)
