"""Attention over the paged KV cache: step metadata, cache writes, backends."""

from jaxllm.attention.kv_cache import KVCache, allocate_kv_caches, write_kv_cache
from jaxllm.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "KVCache", "allocate_kv_caches", "write_kv_cache"]
