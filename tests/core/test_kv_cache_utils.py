"""Tests of jaxllm.core.kv_cache_utils: block hashing, KVCacheBlock, the free queue."""

import ast
import hashlib
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from jaxllm.core.kv_cache_utils import (
    NO_EXTRA_KEYS,
    ROOT_BLOCK_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    encode_extra_keys,
    hash_block_tokens,
    hash_token_blocks,
)
from jaxllm.core.request import Request

CORE_DIR = pathlib.Path(__file__).resolve().parents[2] / "jaxllm" / "core"

# ---- hashing -------------------------------------------------------------------------


def test_hash_follows_documented_encoding():
    tokens = [1, 2, 3, 2**40]
    extra = encode_extra_keys(lora_id=7, cache_salt="é")
    salt = "é".encode()
    body = b"L" + struct.pack("<q", 7) + b"S" + struct.pack("<I", len(salt)) + salt
    assert extra == struct.pack("<I", len(body)) + body
    payload = ROOT_BLOCK_HASH + extra + struct.pack("<I4q", 4, *tokens)
    assert hash_block_tokens(None, tokens, extra) == hashlib.sha256(payload).digest()
    parent = hash_block_tokens(None, tokens, extra)
    payload2 = parent + NO_EXTRA_KEYS + struct.pack("<I2q", 2, 5, 6)
    assert hash_block_tokens(parent, [5, 6]) == hashlib.sha256(payload2).digest()


def test_hash_golden_values():
    """Pinned digests: changing the scheme invalidates persisted/shared caches."""
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first.hex() == "0502310d5a11b9998e4610c3f6400c28e31ca1d10b9c65eab9e7bcba9e14f2d6"
    second = hash_block_tokens(first, [5, 6, 7, 8], encode_extra_keys(3, "salt"))
    assert second.hex() == "1c595ad098a777b136c8f41514743a42c31e64ead27c909dd63ab9baa22d2769"
    assert len(first) == 32


def test_hash_is_stable_across_processes():
    code = (
        "from jaxllm.core.kv_cache_utils import hash_block_tokens, encode_extra_keys;"
        "print(hash_block_tokens(None, [9, 8, 7], encode_extra_keys(1, 'x')).hex())"
    )
    outputs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outputs.add(out.stdout.strip())
    assert outputs == {hash_block_tokens(None, [9, 8, 7], encode_extra_keys(1, "x")).hex()}


def test_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    other_parent = hash_block_tokens(hash_block_tokens(None, [0, 0, 0, 0]), [1, 2, 3, 4])
    variants = {
        base,
        other_parent,
        hash_block_tokens(None, [1, 2, 3, 5]),
        hash_block_tokens(None, [1, 2, 3]),
        hash_block_tokens(None, [1, 2, 3, 4], encode_extra_keys(lora_id=1)),
        hash_block_tokens(None, [1, 2, 3, 4], encode_extra_keys(lora_id=2)),
        hash_block_tokens(None, [1, 2, 3, 4], encode_extra_keys(cache_salt="a")),
        hash_block_tokens(None, [1, 2, 3, 4], encode_extra_keys(lora_id=1, cache_salt="a")),
        hash_block_tokens(None, [1, 2, 3, 4], encode_extra_keys(cache_salt="")),
    }
    assert len(variants) == 9
    assert hash_block_tokens(None, [1, 2, 3, 4]) == base
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4]) == base


def test_extra_keys_encoding_is_unambiguous():
    encodings = [
        encode_extra_keys(),
        encode_extra_keys(lora_id=0),
        encode_extra_keys(cache_salt=""),
        encode_extra_keys(cache_salt="L"),
        encode_extra_keys(lora_id=0, cache_salt=""),
        encode_extra_keys(cache_salt="ab"),
        encode_extra_keys(cache_salt="a\x00"),
    ]
    assert len(set(encodings)) == len(encodings)
    assert encode_extra_keys() == NO_EXTRA_KEYS == b"\x00\x00\x00\x00"


def test_hash_token_blocks_chains_full_blocks_only():
    tokens = list(range(10))
    hashes = hash_token_blocks(tokens, block_size=4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    # A shared prefix gives shared leading hashes; a divergence changes all later ones.
    other = hash_token_blocks([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11], block_size=4)
    assert other[0] == hashes[0] and other[1] != hashes[1]


# ---- request ---------------------------------------------------------------------------


def test_request_token_views():
    req = Request("r", prompt_token_ids=[1, 2, 3])
    req.append_output_token_ids(4)
    req.append_output_token_ids([5, 6])
    assert req.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_cached_tokens) == (6, 3, -1)
    for start in range(7):
        for end in range(start, 7):
            assert req.get_token_ids(start, end) == req.all_token_ids[start:end]


# ---- KVCacheBlock and the free queue ------------------------------------------------


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def test_block_repr_shows_neighbours_not_recursion():
    blocks, _ = make_queue(3)
    assert repr(blocks[1]) == "KVCacheBlock(block_id=1, ref_cnt=0, block_hash=None, prev_free=0, next_free=2)"


def test_free_queue_initial_order_and_popleft():
    blocks, queue = make_queue(4)
    assert ids(queue) == [0, 1, 2, 3] and len(queue) == 4
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    assert queue.popleft_n(2) == [blocks[1], blocks[2]]
    assert ids(queue) == [3] and queue.num_free_blocks == 1
    assert queue.popleft_n(0) == []


def test_free_queue_remove_from_middle_and_ends():
    blocks, queue = make_queue(5)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and len(queue) == 4
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3] and len(queue) == 2
    with pytest.raises(ValueError, match="block 2 is not in the free queue"):
        queue.remove(blocks[2])
    assert queue.popleft() is blocks[1]


def test_free_queue_append_goes_to_back():
    blocks, queue = make_queue(4)
    first = queue.popleft()
    queue.remove(blocks[2])
    queue.append(first)
    queue.append_n([blocks[2]])
    assert ids(queue) == [1, 3, 0, 2] and len(queue) == 4
    queue.append_n([])
    assert len(queue) == 4


def test_free_queue_empty_pop_raises_and_refills():
    blocks, queue = make_queue(2)
    queue.popleft_n(2)
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft_n(1)
    assert ids(queue) == [] and len(queue) == 0
    queue.append_n(blocks[::-1])
    assert ids(queue) == [1, 0]
    assert [queue.popleft().block_id, queue.popleft().block_id] == [1, 0]


def test_free_queue_popleft_n_too_many_takes_nothing():
    _, queue = make_queue(3)
    with pytest.raises(IndexError):
        queue.popleft_n(4)
    assert ids(queue) == [0, 1, 2] and len(queue) == 3


def test_empty_queue_from_no_blocks():
    queue = FreeKVCacheBlockQueue([])
    assert len(queue) == 0 and queue.get_all_free_blocks() == []
    with pytest.raises(IndexError):
        queue.popleft()


# ---- boundary: the core never imports jax ------------------------------------------------

STDLIB_OK = {"__future__", "collections", "dataclasses", "enum", "hashlib", "itertools", "logging", "struct", "time", "typing"}
# Plain-Python modules outside jaxllm.core that the core may use.
JAXLLM_PLAIN = ("jaxllm.core", "jaxllm.sampling_params", "jaxllm.messages", "jaxllm.structured_output.params", "jaxllm.stop_strings",
                "jaxllm.kv_cache_groups", "jaxllm.lora.request", "jaxllm.pooling_params", "jaxllm.reasoning")


@pytest.mark.parametrize("module", sorted(p.name for p in CORE_DIR.glob("*.py")))
def test_core_modules_import_only_stdlib_and_plain_jaxllm(module):
    tree = ast.parse((CORE_DIR / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            assert name.startswith(JAXLLM_PLAIN) or name.split(".")[0] in STDLIB_OK, (module, name)


def imported_modules(path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("package", ["core", "worker", "sample", "attention", "models", "loaders"])
def test_lower_layers_never_import_the_engine_or_the_server(package):
    """The frontend (engine/, entrypoints/) sits on the core and the worker, never the
    other way round; what they share lives in jaxllm.messages."""
    for path in sorted((CORE_DIR.parent / package).glob("*.py")):
        for name in imported_modules(path):
            assert not name.startswith(("jaxllm.engine", "jaxllm.entrypoints", "jaxllm.serve")), (path.name, name)


def test_importing_the_core_loads_no_jax_or_numpy():
    import subprocess
    import sys

    modules = [f"jaxllm.core.{p.stem}" for p in CORE_DIR.glob("*.py") if p.stem != "__init__"]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "bad = [m for m in ('jax', 'numpy') if m in sys.modules]\nassert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
