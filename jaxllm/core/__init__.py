"""Host-side engine core: requests and the paged KV cache manager.

Everything in this package is plain Python (standard library only). It never imports
jax: the model runner turns the decisions made here into device arrays.
"""
