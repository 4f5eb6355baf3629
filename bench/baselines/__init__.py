"""Baselines that jpaged is measured against, kept out of the product.

`reservation`: Orca-style contiguous KV reservation (a buddy allocator and the Max / Pow2 / Oracle
policies of the PagedAttention paper, section 6.1), simulated by `bench/memory_utilization.py`.
`orca`: the same reservations as a `jpaged.core.kv_cache_manager.KVCacheManager`, so the real
engine runs them (`LLMEngine(..., kv_cache_manager=orca("orca_max"))`).
"""
