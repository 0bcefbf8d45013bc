#!/usr/bin/env sh
# Prints the first Python 3.12+ interpreter found (jax 0.11 and later need 3.12; the GPU
# machines run 3.12): python3, python3.12, python3.13, python3.14 on
# PATH, then pyenv's installed versions (3.12 first). Exits 1 with a message if none runs.
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
for p in python3 python3.12 python3.13 python3.14; do
  if ok "$p"; then command -v "$p"; exit 0; fi
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for p in "$root"/versions/3.1[2-9]*/bin/python3; do
  if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
done
echo "error: jaxllm needs Python 3.12 or newer (python3, python3.12/13/14 or pyenv); or name one: make PYTHON=/path/to/python3.12" >&2
exit 1
