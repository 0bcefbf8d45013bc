"""The `jaxllm` command, in vLLM's shape: `jaxllm serve [MODEL] [flags]` is
`python -m jaxllm.serve [MODEL] [flags]` (`vllm serve MODEL`); `jaxllm chat` and
`jaxllm complete` talk to a running server from the terminal (`vllm chat`, `vllm
complete`)."""

from __future__ import annotations

import sys

COMMANDS = {"serve": "the OpenAI-compatible server (jaxllm serve --help lists its flags)",
            "chat": "chat with a running server from the terminal (-q TEXT: one message)",
            "complete": "complete prompts with a running server from the terminal (-q TEXT: one prompt)"}
USAGE = ("usage: jaxllm {serve,chat,complete} ...\n\ncommands:\n"
         + "".join(f"  {n:<10}{h}\n" for n, h in COMMANDS.items()))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    if args[0] not in COMMANDS:
        sys.exit(f"error: unknown command {args[0]!r}\n{USAGE}")
    if args[0] == "serve":
        from jaxllm import serve

        serve.main(args[1:])
    else:
        from jaxllm.entrypoints import cli_client

        cli_client.main(args[0], args[1:])


if __name__ == "__main__":
    main()
