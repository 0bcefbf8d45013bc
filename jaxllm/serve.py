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
import os
import signal
import sys
import time

from jaxllm.engine.config import EngineConfig
from jaxllm.loaders.default_model import DEFAULT_MODEL_NAME
from jaxllm.logs import LEVELS, LOG_LEVEL_ENV, configure_logging, log_level


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxllm.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder, GGUF file or converted checkpoint (default: embedded SmolLM2)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: from --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"), help="required bearer token (or JAXLLM_API_KEY)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    p.add_argument("--kv-cache-memory", default=None, help="bytes, e.g. 4GiB, or a fraction of GPU memory")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "xla", "cpu", "pallas"])
    p.add_argument("--linear-backend", default="auto", choices=["auto", "xla", "cpu"])
    p.add_argument("--chat-template", default=None, help="a Jinja template or a file holding one")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait beyond --max-num-seqs before 503s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20)
    p.add_argument("--engine-hang-timeout", type=float, default=60.0,
                   help="seconds without a word from a busy engine core before /health says 503")
    p.add_argument("--shutdown-grace", type=float, default=5.0, help="seconds in-flight requests get at shutdown")
    p.add_argument("--log-level", default=None, choices=LEVELS,
                   help="jaxllm's log level (default: JAXLLM_LOG_LEVEL, else info); debug also shows the libraries'")
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
        chat_template=args.chat_template,
        compilation_cache_dir=args.compilation_cache_dir,
        served_model_name=args.served_model_name,
    )


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(args.model)).removesuffix(".gguf")


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import ServerSettings, build_app

    start = time.perf_counter()
    config = engine_config(args)
    name = served_model_name(args)
    engine = await AsyncLLM.start(config, name, hang_timeout=args.engine_hang_timeout)
    settings = ServerSettings(model_name=name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                              max_num_seqs=args.max_num_seqs, max_request_bytes=args.max_request_bytes)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, settings), host=args.host, port=args.port,
                                           log_level="warning", timeout_graceful_shutdown=args.shutdown_grace))

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        print(f"jaxllm ready in {time.perf_counter() - start:.1f} s: serving {name} at "
              f"http://{args.host}:{args.port}/v1", flush=True)

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


if __name__ == "__main__":
    main()
