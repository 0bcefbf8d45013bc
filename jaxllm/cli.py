"""The `jaxllm` command, in vLLM's shape: `jaxllm serve [MODEL] [flags]` is
`python -m jaxllm.serve [MODEL] [flags]` (`vllm serve MODEL`)."""

from __future__ import annotations

import sys

COMMANDS = {"serve": "the OpenAI-compatible server (jaxllm serve --help lists its flags)"}
USAGE = "usage: jaxllm {serve} ...\n\ncommands:\n" + "".join(f"  {n:<8}{h}\n" for n, h in COMMANDS.items())


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    if args[0] not in COMMANDS:
        sys.exit(f"error: unknown command {args[0]!r}\n{USAGE}")
    from jaxllm import serve

    serve.main(args[1:])


if __name__ == "__main__":
    main()
