"""scripts/bench_embeddings.py's own logic (the benchmark itself is not run here): its
texts have the token lengths it says, and its client returns every vector in order."""

import asyncio

import bench_embeddings
import numpy as np
from tokenizers import Tokenizer

from jaxllm.loaders.default_model import all_minilm_l6_v2_path


def test_texts_have_the_lengths_asked():
    folder = all_minilm_l6_v2_path()
    texts = bench_embeddings.make_texts(folder, 50, 8, 40, seed=1)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    lengths = [len(e.ids) for e in tok.encode_batch(texts)]
    assert len(texts) == 50 and min(lengths) >= 8 and max(lengths) <= 40 and len(set(lengths)) > 10
    assert texts == bench_embeddings.make_texts(folder, 50, 8, 40, seed=1)  # seeded


def test_min_cosine():
    a = np.array([[1.0, 0.0], [0.0, 2.0]])
    assert bench_embeddings.min_cosine(a, a * 3) == 1.0
    assert abs(bench_embeddings.min_cosine(a, np.array([[1.0, 1.0], [0.0, 1.0]])) - 2 ** -0.5) < 1e-12


def test_drive_sends_each_text_alone_and_keeps_their_order(monkeypatch):
    sent = []

    class Response:
        def __init__(self, text):
            self.text = text

        def raise_for_status(self):
            pass

        def json(self):
            return {"data": [{"embedding": [float(len(self.text)), 1.0]}]}

    class Client:
        def __init__(self, **kw):
            pass

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            pass

        async def post(self, url, json):
            sent.append(json["input"])
            await asyncio.sleep(0)
            return Response(json["input"][0])

    monkeypatch.setattr(bench_embeddings.httpx, "AsyncClient", Client)
    texts = ["a" * n for n in range(1, 20)]
    seconds, vectors = asyncio.run(bench_embeddings.drive("http://x", "/v1/embeddings", "m", texts, clients=4))
    assert sorted(map(tuple, sent)) == sorted((t,) for t in texts)
    np.testing.assert_array_equal(vectors[:, 0], np.arange(1, 20))
