"""The `jaxllm` command, in vLLM's shape: `jaxllm serve [MODEL] [flags]` is
`python -m jaxllm.serve --model MODEL [flags]` (`vllm serve MODEL`)."""

from __future__ import annotations

import sys

COMMANDS = {"serve": "the OpenAI-compatible server (jaxllm serve --help lists its flags)"}
USAGE = "usage: jaxllm {serve} ...\n\ncommands:\n" + "".join(f"  {n:<8}{h}\n" for n, h in COMMANDS.items())


def serve_argv(args: list[str]) -> list[str]:
    """`serve`'s arguments as jaxllm.serve takes them: a leading model (vLLM's
    positional MODEL) becomes --model."""
    if args and not args[0].startswith("-"):
        if "--model" in args[1:]:
            raise SystemExit("error: give the model once: `jaxllm serve MODEL` or `--model MODEL`")
        return ["--model", args[0], *args[1:]]
    return args


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    if args[0] not in COMMANDS:
        sys.exit(f"error: unknown command {args[0]!r}\n{USAGE}")
    from jaxllm import serve

    serve.main(serve_argv(args[1:]))


if __name__ == "__main__":
    main()
