"""The host core: what runs where in KV memory, decided in plain Python (never imports JAX).

`kv_cache_manager`: the scheduler's view of KV memory as written protocols (`KVCacheManager`,
with the `ForkingKVCacheManager` and `SwappingKVCacheManager` capabilities), `DeviceOps`,
`KVCacheSpec`. `block_manager`: paging (PagedAttention's manager) as an immutable snapshot, built
on `persistent` tables; `partitioned`: one such manager per data-parallel partition of the pool
(global block ids). `scheduler`: FCFS iteration-level batching, preemption, and the owner of
every request's lifecycle. `sequence`: the host records of requests. `beam_search`: beam-search
decisions as a pure function. `sampling_params`, `detokenizer`: what to generate and how text
grows. Imports nothing of jpaged outside this package; hands the device side lists and numpy-
friendly records (`scheduler.Row`, `DeviceOps`).
"""
