"""A pooling server for real: `python -m jaxllm.serve` serving all-MiniLM-L6-v2, driven
by the openai client, LangChain's OpenAIEmbeddings and httpx; sentence-transformers is
the oracle (embeddings to cosine >= 0.99999, a similarity search's ranking)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from jaxllm.loaders.default_model import all_minilm_l6_v2_path
from tests.support.server import API_KEY, Server

DOCS = ["The cat sits on the mat.", "Paris is the capital of France.", "JAX compiles numerical programs with XLA.",
        "A dog is running in the park.", "The Eiffel Tower is in Paris.", "Transformers use attention."]
QUERY = "Which city is France's capital?"


@pytest.fixture(scope="module")
def folder():
    return all_minilm_l6_v2_path()


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    s = Server(folder, tmp_path_factory.mktemp("embeddings"), "--served-model-name", "minilm",
               "--attention-backend", "cpu", "--linear-backend", "cpu")  # named: nothing measured at start-up
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oracle(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_startup_says_pooling(server):
    assert "runner pooling (MEAN, normalized); max_model_len=256" in server.output()
    assert "attention cpu, linear cpu;" in server.output()
    # a test server's --no-warm-up (tests/support/server.py)
    assert "; each step shape compiled at its first step (warm_up off)" in server.output()


def test_openai_client_embeddings_equal_sentence_transformers(server, oracle):
    client = server.client()
    texts = [*DOCS, "word " * 300]  # the last truncated to 256 tokens, as sentence-transformers does
    r = client.embeddings.create(model="minilm", input=texts, extra_body={"truncate_prompt_tokens": -1})
    got = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(len(texts))) and r.model == "minilm"
    assert cosines(got, oracle.encode(texts)).min() >= 0.99999
    want_tokens = sum(min(len(oracle.tokenizer(t)["input_ids"]), 256) for t in texts)
    assert r.usage.prompt_tokens == r.usage.total_tokens == want_tokens
    one = client.embeddings.create(model="minilm", input=DOCS[0])  # the client asks base64 by default
    np.testing.assert_allclose(one.data[0].embedding, got[0], atol=1e-6)
    ids = oracle.tokenizer(DOCS[1])["input_ids"]
    for value in (ids, [ids]):  # token ids, one list or a list of lists
        by_ids = client.embeddings.create(model="minilm", input=value, encoding_format="float")
        np.testing.assert_allclose(by_ids.data[0].embedding, got[1], atol=1e-6)
    b64 = post(server, "/v1/embeddings", {"input": DOCS[2], "encoding_format": "base64"}).json()
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4"), got[2], atol=1e-6)


def test_langchain_similarity_search_ranks_as_sentence_transformers(server, oracle):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model="minilm", base_url=f"{server.url}/v1", api_key=API_KEY,
                                  check_embedding_ctx_length=False)  # send text, not tiktoken's token ids
    docs = np.array(embeddings.embed_documents(DOCS))
    query = np.array(embeddings.embed_query(QUERY))
    want_docs, want_query = oracle.encode(DOCS), oracle.encode(QUERY)
    assert cosines(docs, want_docs).min() >= 0.99999
    assert list(np.argsort(-docs @ query)) == list(np.argsort(-want_docs @ want_query))


def test_score_and_rerank_in_vllms_shapes(server, oracle):
    want = oracle.similarity(oracle.encode([QUERY]), oracle.encode(DOCS)).numpy()[0]
    for path in ("/score", "/v1/score"):
        body = post(server, path, {"text_1": QUERY, "text_2": DOCS}).json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(DOCS)))
        np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    pairwise = post(server, "/score", {"text_1": DOCS[:2], "text_2": DOCS[2:4]}).json()["data"]
    assert len(pairwise) == 2
    order = list(np.argsort(-want))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(server, path, {"query": QUERY, "documents": DOCS, "top_n": 3}).json()
        assert [r["index"] for r in body["results"]] == order[:3]
        assert body["results"][0]["document"] == {"text": DOCS[order[0]]}
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], want[order[:3]], atol=1e-5)
        assert body["usage"]["total_tokens"] > 0
    bare = post(server, "/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False}).json()
    assert len(bare["results"]) == len(DOCS) and "document" not in bare["results"][0]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling", "/score", "/rerank", "/v2/rerank"])
def test_an_api_key_guards_every_pooling_endpoint(server, path):
    r = httpx.post(f"{server.url}{path}", json={"input": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_pooling_and_tokenize(server, oracle):
    body = post(server, "/pooling", {"input": [DOCS[0]]}).json()  # the pooled state as LLM.encode gives it
    assert body["data"][0]["object"] == "pooling"
    want = oracle.encode(DOCS[0], output_value="token_embeddings").numpy().mean(0)  # before Normalize
    assert cosines(body["data"][0]["data"], want) >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(body["data"][0]["data"]), np.linalg.norm(want), rtol=1e-5)
    tok = post(server, "/tokenize", {"prompt": DOCS[0]}).json()
    assert tok["tokens"] == oracle.tokenizer(DOCS[0])["input_ids"] and tok["max_model_len"] == 256


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": ["ok", ""]}, "input"),
    ("/v1/embeddings", {"input": "word " * 300}, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 128}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "colour": "red"}, "colour"),
    ("/v1/embeddings", {"input": [[1, 999999]]}, "input"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 300}, "truncate_prompt_tokens"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
])
def test_bad_requests_are_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert post(server, "/v1/embeddings", {"input": ["still", "serving"]}).status_code == 200
