"""Images through the server (issue 65): the openai client's chat completions with
`image_url` parts (base64 data URLs) and the Responses API's `input_image` answer as
the offline engine does for the same conversation, whose image is HF's (the engine
tests), for LLaVA and Gemma 3; every bad image is a 400 naming the part, and the
server goes on."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from jaxllm import LLM, SamplingParams
from tests.support.server import API_KEY, Server, offline_options


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (36, 44, 3), np.uint8))


@pytest.fixture(scope="module")
def server(vision_models_dir, tmp_path_factory, shared_cache_dir):
    media = tmp_path_factory.mktemp("media")
    picture(3).save(media / "cat.png")
    s = Server(vision_models_dir / "llava", shared_cache_dir, "--served-model-name", "llava",
               "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", str(media))
    s.media = media
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gemma_server(vision_models_dir, shared_cache_dir):
    s = Server(vision_models_dir / "gemma3_vlm", shared_cache_dir, "--served-model-name", "gemma")
    yield s
    s.stop()


def messages(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in these?"}, *parts]}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.slow  # a second server; the LLaVA server covers the path, the engine tests Gemma 3's logprobs
def test_gemma3_chat_with_images_answers_as_the_offline_engine(gemma_server, vision_models_dir):
    """Gemma 3 (its images attend both ways; the engine's logprobs are HF's: the engine
    tests) over the server as offline."""
    client, params = gemma_server.client(), dict(temperature=0, max_tokens=6)
    conversations = [messages(image_part(data_url(picture(1)))),
                     messages(image_part(data_url(picture(1))), image_part(data_url(picture(2), "JPEG")))]
    got = [client.chat.completions.create(model="gemma", messages=m, extra_body={"ignore_eos": True}, **params)
           for m in conversations]
    offline = LLM(str(vision_models_dir / "gemma3_vlm"), **offline_options(gemma_server))
    want = offline.chat(conversations, SamplingParams(ignore_eos=True, **params), use_tqdm=False)
    assert [g.choices[0].message.content for g in got] == [w.outputs[0].text for w in want]
    assert [g.usage.prompt_tokens for g in got] == [len(w.prompt_token_ids) for w in want]


def test_chat_with_images_answers_as_the_offline_engine(server, vision_models_dir):
    client = server.client()
    params = dict(temperature=0, max_tokens=6)
    conversations = [messages(image_part(data_url(picture(1)))),
                     messages(image_part(data_url(picture(1))), image_part(data_url(picture(2), "JPEG"))),
                     messages(image_part((server.media / "cat.png").as_uri()))]
    got = [client.chat.completions.create(model="llava", messages=m, extra_body={"ignore_eos": True}, **params)
           for m in conversations]
    offline = LLM(str(vision_models_dir / "llava"), **offline_options(server, limit_mm_per_prompt={"image": 2}))
    same = conversations[:2] + [messages({"type": "image_pil", "image_pil": Image.open(server.media / "cat.png")})]
    want = offline.chat(same, SamplingParams(ignore_eos=True, **params), use_tqdm=False)
    assert [g.choices[0].message.content for g in got] == [w.outputs[0].text for w in want]
    assert [g.usage.prompt_tokens for g in got] == [len(w.prompt_token_ids) for w in want]
    assert got[0].usage.prompt_tokens > 16  # the image's 16 tokens and the text
    response = client.responses.create(model="llava", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is in these?"},
                                     {"type": "input_image", "image_url": data_url(picture(1))}]}])
    assert response.usage.input_tokens == got[0].usage.prompt_tokens
    # picture 1 after other text (no prefix-cache hit reaches it): from the encoder cache
    client.chat.completions.create(model="llava", max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."}, *messages(image_part(data_url(picture(1))))])
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in
               httpx.get(f"{server.url}/metrics").text.splitlines() if line.startswith("jaxllm:")}
    assert metrics["jaxllm:images_encoded_total"] == 3  # pictures 1 and 2 and the file's, each once
    assert metrics["jaxllm:encoder_cache_hits_total"] >= 1


@pytest.mark.parametrize("part, message", [
    (image_part("data:text/plain;base64,aGVsbG8="), "not an image"),
    (image_part("data:image/png;base64,bm90IGFuIGltYWdl"), "not an image Pillow can read"),
    (image_part("data:image/png;base64,@@@"), "not valid base64"),
    (image_part(data_url(picture(4), "TIFF")), "image type TIFF is not supported"),
    (image_part(data_url(Image.new("RGB", (9000, 8000)))), "is 9000x8000, more than 64 Mpx"),
    (image_part("https://example.com/cat.png"), "fetches no images over the network"),
    (image_part("file:///etc/passwd"), "no such file under the allowed local media path"),
])
def test_a_bad_image_is_a_400_naming_the_part(server, part, message):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": "llava", "max_tokens": 2, "messages": messages(part)})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert "messages[0].content[1]" in r.json()["error"]["message"]


def test_too_many_images_is_a_400_and_the_server_goes_on(server):
    url = data_url(picture(5))
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": "llava", "max_tokens": 2, "messages": messages(*[image_part(url)] * 3)})
    assert r.status_code == 400 and "more than the 2 a prompt may have" in r.json()["error"]["message"], r.text
    ok = server.client().chat.completions.create(model="llava", max_tokens=2, messages=messages(image_part(url)))
    assert ok.choices[0].finish_reason == "length"
