"""`python -m jaxllm.serve`: the OpenAI-compatible server.

The HTTP process (Starlette on uvicorn) parses, validates, tokenizes, detokenizes and
streams; the engine core runs in a child process. SIGINT/SIGTERM stop accepting, let
in-flight requests finish for a grace period, abort the rest and end the core process.
If the core process dies, in-flight requests get errors, /health says 503 and the
server exits with status 1 (as vLLM), so a supervisor can restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time

from jaxllm.engine.config import EngineConfig, add_cli_args, from_cli_args
from jaxllm.engine.protocol import EngineCoreStartError
from jaxllm.entrypoints.openai.tools import PARSERS
from jaxllm.loaders.default_model import DEFAULT_MODEL_NAME
from jaxllm.logs import LEVELS, LOG_LEVEL_ENV, configure_logging, log_level
from jaxllm.lora.request import LoRARequest

logger = logging.getLogger("jaxllm.serve")

API_KEY_ENV = "JAXLLM_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the same routes
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's switch for its development endpoints


def build_parser() -> argparse.ArgumentParser:
    """The server's flags: the engine's options (EngineConfig's fields), then its own."""
    p = argparse.ArgumentParser(prog="python -m jaxllm.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)  # the engine's options, from EngineConfig's fields
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM's `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--uds", default=None, metavar="PATH", help="listen on this Unix domain socket instead")
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under (ASGI root_path)")
    p.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, help="TLS: the CA certificates clients are checked against")
    p.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="TLS: whether a client certificate is required (Python's ssl.CERT_* value; 0 none)")
    p.add_argument("--api-key", action="append", default=None,
                   help=f"bearer token every request must carry; give it several times to accept any of several "
                        f"(default: ${API_KEY_ENV})")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait beyond --max-num-seqs before 503s")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20, help="the largest request body (413 beyond)")
    p.add_argument("--engine-hang-timeout", type=float, default=60.0,
                   help="seconds without a word from a busy engine core before /health says 503")
    p.add_argument("--shutdown-grace", type=float, default=5.0, help="seconds in-flight requests get at shutdown")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="how tool calls are found in outputs for tool_choice auto: hermes (<tool_call>...</tool_call>, "
                        "Qwen2.5/3, Hermes) or llama3_json; required and named tool choices need none")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines; --tool-call-parser alone enables tool_choice auto")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to load at start-up, as name=path or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ...}'; a request picks one by `model` (needs --enable-lora)")
    p.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help="chat template variables for every request, under its own chat_template_kwargs: e.g. "
                        "'{\"enable_thinking\": false}' for Qwen3")
    p.add_argument("--responses-store-size", type=int, default=1024, metavar="N",
                   help="responses kept for GET /v1/responses/{id} and previous_response_id (the oldest dropped "
                        "beyond it, counted in /metrics; 0 keeps none)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"),
                   help=f"serve /v1/load_lora_adapter and /v1/unload_lora_adapter (off: 404, as vLLM without "
                        f"${RUNTIME_LORA_ENV}); adapters load only from under --lora-allowed-roots")
    p.add_argument("--server-dev-mode", action="store_true",
                   default=os.environ.get(DEV_MODE_ENV, "").lower() in ("1", "true"),
                   help=f"serve the development endpoints an RL trainer drives between rollouts: POST /sleep, "
                        f"/wake_up, /reset_prefix_cache, /update_weights (a path on this machine), /pause, /resume, GET "
                        f"/is_sleeping, /is_paused "
                        f"(off: 404, as vLLM without ${DEV_MODE_ENV}; with --enable-sleep-mode for /sleep)")
    p.add_argument("--lora-allowed-roots", nargs="+", default=[], metavar="DIR",
                   help="folders runtime adapters may be loaded from (besides the --lora-modules folders); any "
                        "other path gets one answer that says nothing of the filesystem")
    p.add_argument("--allowed-origins", type=json_list, default=[], metavar="JSON",
                   help="CORS: origins a browser may call from, as vLLM's JSON list ('[\"https://app.example\"]', "
                        "'[\"*\"]'); empty (the default, unlike vLLM's [\"*\"]): no CORS headers")
    p.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON", help="CORS: allowed methods")
    p.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON", help="CORS: allowed headers")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt and parameters at info level")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's older command lines: requests are not logged unless "
                        "--enable-log-requests")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="characters (or token ids) of a logged prompt (default: all)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own chat_template (Jinja from the client; off: a 400, as vLLM)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="a vision-language model's image_url parts may be file:// URLs of images under DIR (off: only "
                        "base64 data URLs; nothing is fetched over the network)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="X-Request-Id on every response (the client's own, else a new one)")
    p.add_argument("--log-level", default=None, choices=LEVELS,
                   help=f"jaxllm's log level (default: ${LOG_LEVEL_ENV}, else info); debug also shows the libraries'")
    return p


def json_object(text: str) -> dict:
    """A flag's JSON object (argparse's type: a ValueError becomes its usage error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text}")
    return value


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (argparse's type)."""
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not a JSON list of strings: {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV)
    elif len(args.api_key) == 1:
        args.api_key = args.api_key[0]
    else:
        args.api_key = tuple(args.api_key)
    return args


def options_markdown() -> str:
    """README's options table, from the parser: each flag, the `LLM(...)` keyword it is
    (the engine's options), its default and its help."""
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    rows = ["| flag | `LLM(...)` | default | what |", "|---|---|---|---|"]
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings if flag != f"--no-{action.dest}")
        keyword = f"`{action.dest}`" if action.dest in engine else ""
        default = "" if action.default is None or action.default == [] else f"`{action.default}`"
        what = action.help or ""
        if action.choices:
            what += f"; one of {', '.join(f'`{c}`' for c in action.choices if c is not None)}"
        what = what.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        rows.append(f"| {flags} | {keyword} | {default} | {what} |")
    return "\n".join(rows) + "\n"


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return from_cli_args(args)


def lora_modules(args: argparse.Namespace) -> tuple[LoRARequest, ...]:
    """--lora-modules as LoRARequests (ids 1, 2, ...); ValueError for a malformed one."""
    modules = []
    for i, item in enumerate(args.lora_modules, start=1):
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {item!r} is not {{\"name\": ..., \"path\": ...}}") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is not name=path")
        if any(m.lora_name == name for m in modules):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules.append(LoRARequest(name, i, path))
    if modules and not args.enable_lora:
        raise ValueError("--lora-modules: needs --enable-lora")
    return tuple(modules)


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(args.model)).removesuffix(".gguf")


def uvicorn_config(app, args: argparse.Namespace):
    """uvicorn's config of the server's flags: address (or Unix socket), TLS, root path."""
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds, root_path=args.root_path,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                          ssl_cert_reqs=args.ssl_cert_reqs, log_level="warning",
                          timeout_graceful_shutdown=args.shutdown_grace)


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import CORS, ServerSettings, build_app

    start = time.perf_counter()
    config = engine_config(args)
    name = served_model_name(args)
    engine = await AsyncLLM.start(config, name, hang_timeout=args.engine_hang_timeout)
    adapters = lora_modules(args)
    try:
        for lora in adapters:
            await engine.add_lora(lora)
    except ValueError as e:
        await engine.shutdown()
        raise SystemExit(f"error: --lora-modules {lora.lora_name}: {e}") from None
    settings = ServerSettings(model_name=name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                              max_num_seqs=args.max_num_seqs, max_request_bytes=args.max_request_bytes,
                              tool_call_parser=args.tool_call_parser, lora_modules=adapters,
                              reasoning_parser=config.reasoning_parser,
                              default_chat_template_kwargs=args.default_chat_template_kwargs,
                              responses_store_size=args.responses_store_size,
                              runtime_lora_updating=args.allow_runtime_lora_updating,
                              lora_allowed_roots=tuple(args.lora_allowed_roots),
                              cors=CORS(tuple(args.allowed_origins), tuple(args.allowed_methods),
                                        tuple(args.allowed_headers), args.allow_credentials),
                              log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                              request_id_headers=args.enable_request_id_headers,
                              trust_request_chat_template=args.trust_request_chat_template,
                              allowed_local_media_path=args.allowed_local_media_path,
                              dev_mode=args.server_dev_mode)
    if settings.dev_mode and not settings.api_keys():
        logger.warning("development endpoints are on without an API key: anyone who reaches the port can put the "
                       "engine to sleep or load weights from any path this process can read")
    if settings.runtime_lora_updating and not settings.api_key:
        logger.warning("runtime LoRA updating is on without an API key: anyone who reaches the port can load "
                       "adapters from under %s", ", ".join(settings.lora_roots()) or "(no allowed root)")
    server = uvicorn.Server(uvicorn_config(build_app(engine, settings), args))

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        where = (f"unix:{args.uds}" if args.uds else
                 f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}{args.root_path}")
        print(f"jaxllm ready in {time.perf_counter() - start:.1f} s: serving {name} at {where}/v1", flush=True)

    async def stop_when_the_core_dies() -> None:
        await engine.core_died.wait()
        print(f"error: {engine.dead_reason}; the server exits so that a supervisor can restart it",
              file=sys.stderr, flush=True)
        await asyncio.sleep(1.0)  # in-flight requests get their errors; health probes see the 503
        server.should_exit = True

    announcer = asyncio.create_task(announce())
    watcher = asyncio.create_task(stop_when_the_core_dies())
    try:
        await server.serve()
    finally:
        announcer.cancel()
        watcher.cancel()
        await engine.shutdown()
    if engine.core_died.is_set():
        raise SystemExit(1)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds start-up, so the core process is stopped too


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        engine_config(args)  # option errors before anything starts
        lora_modules(args)
        level = log_level(args.log_level)
    except ValueError as e:
        sys.exit(f"error: {e}")
    os.environ[LOG_LEVEL_ENV] = level  # the engine core process reads it
    configure_logging(level)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # uvicorn installs its own once serving
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    except EngineCoreStartError as e:  # its message (a bad model or checkpoint: no traceback), once
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
