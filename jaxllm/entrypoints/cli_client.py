"""`jaxllm chat` and `jaxllm complete`: a terminal client of a running server, in the
shape of `vllm chat` / `vllm complete`. Each line typed is sent (chat keeps the
conversation), the answer streamed as it comes; `-q TEXT` sends one and exits. The
standard library's HTTP client: nothing to install beside the server."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator


def parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"jaxllm {command}", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://localhost:8000/v1", help="the server's API root")
    p.add_argument("--model-name", default=None, help="the model to ask (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="the server's key (default: $JAXLLM_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("-q", "--quick", metavar="TEXT", default=None, help="send TEXT, print the answer, exit")
    p.add_argument("--max-tokens", type=int, default=None, help="the answer's length limit")
    p.add_argument("--temperature", type=float, default=None, help="default: the server's")
    if command == "chat":
        p.add_argument("--system-prompt", default=None)
    return p


def _request(args: argparse.Namespace, path: str, body: dict | None = None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.Request(args.url.rstrip("/") + path, data=data, headers=headers)


def _model(args: argparse.Namespace) -> str:
    if args.model_name:
        return args.model_name
    with urllib.request.urlopen(_request(args, "/models"), timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def _stream(args: argparse.Namespace, path: str, body: dict) -> Iterator[str]:
    """The streamed answer's text pieces (SSE `data:` lines until [DONE])."""
    body = body | {"stream": True} | {k: v for k, v in (("max_tokens", args.max_tokens),
                                                         ("temperature", args.temperature)) if v is not None}
    with urllib.request.urlopen(_request(args, path, body), timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event.get("choices", []):
                yield choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _answer(args: argparse.Namespace, path: str, body: dict) -> str:
    pieces = []
    for piece in _stream(args, path, body):
        print(piece, end="", flush=True)
        pieces.append(piece)
    print(flush=True)
    return "".join(pieces)


def _lines(args: argparse.Namespace) -> Iterator[str]:
    if args.quick is not None:
        yield args.quick
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


def main(command: str, argv: list[str]) -> None:
    args = parser(command).parse_args(argv)
    try:
        model = _model(args)
        messages = [] if getattr(args, "system_prompt", None) is None else [
            {"role": "system", "content": args.system_prompt}]
        for line in _lines(args):
            if command == "complete":
                _answer(args, "/completions", {"model": model, "prompt": line})
                continue
            messages.append({"role": "user", "content": line})
            messages.append({"role": "assistant", "content": _answer(args, "/chat/completions",
                                                                      {"model": model, "messages": messages})})
    except urllib.error.HTTPError as e:
        sys.exit(f"error: {e.code} {e.read().decode(errors='replace')}")
    except (urllib.error.URLError, RuntimeError) as e:
        sys.exit(f"error: {getattr(e, 'reason', e)}")
    except KeyboardInterrupt:
        print()
