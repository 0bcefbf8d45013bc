"""Finding stop strings in generated text: shared by the frontend's detokenizer (every
request's text) and the core's beam search (a beam ends on one)."""

from __future__ import annotations


def find_stop(text: str, check_from: int, stops: list[str]) -> tuple[str, int] | None:
    """The stop string occurrence that ends first among those ending after index
    `check_from` of text (earlier text was searched before), as (stop, start)."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop, max(0, check_from - len(stop) + 1))
        if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[2], best[1])


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
