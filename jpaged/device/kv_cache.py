"""The paged KV cache: one block pool, threaded through the jitted steps as a pytree.

Layout (every attention backend and the Pallas kernels agree on it):
  kv: dtype[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
  kv[l, b, 0] is block b's keys in layer l, kv[l, b, 1] its values.

A block's K and V lie side by side: attention reads each (layer, block) as one contiguous run
(24 KiB for SmolLM2 at 16 tokens of float32) instead of two runs far apart, and memory reads whole
runs faster than scattered ones (`bench/README.md`; FlashInfer's paged layout is the same idea).

Token `position` of a sequence lives at slot `block_table[position // block_size] * block_size
+ position % block_size`. Block 0 is the null block: padded block-table entries and padded
tokens' slots point into it, so an out-of-range index can never read or clobber a live block
(JAX clips out-of-bounds indices instead of failing). Nothing may read the null block unmasked.

The pool is large. Step functions take it donated and update it in place; nothing slices a layer
out of it (a slice is a copy). On CPUs a new pool lies on transparent huge pages
(`back_with_huge_pages`): attention reads its blocks scattered over all of it.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import re
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jpaged.device.config import ModelConfig


@struct.dataclass
class KVCache:
    kv: jax.Array  # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1]

    @classmethod
    def create(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32) -> "KVCache":
        return cls(kv=jnp.zeros(pool_shape(config, num_blocks, block_size), dtype))


def pool_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The shape of a pool of `num_blocks` blocks: [layers, blocks, 2 (K, V), block_size, kv_heads, head_dim]."""
    return (config.num_layers, num_blocks, 2, block_size, config.num_kv_heads, config.head_dim)


# Linux's madvise(2) advice numbers (asm-generic, the same on x86-64 and AArch64)
_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 4, 14, 23
HUGE_PAGE_BYTES = 2 << 20


def back_with_huge_pages(cache: KVCache) -> int:
    """Asks Linux to back a new pool's host memory with transparent huge pages (2 MiB); returns how
    many bytes were advised: 0 on devices that are not CPUs, off Linux, or if the kernel refuses.

    Why: attention reads a step's blocks scattered over the whole pool, a few KiB per (layer, block).
    With 4 KiB pages each of those runs crosses pages whose translations miss the TLB, and the
    hardware prefetchers stop at every page boundary. XLA allocates with malloc, which uses 4 KiB
    pages unless told otherwise (numpy, for one, asks for huge pages). See `bench/README.md` for
    what this buys the native CPU kernel.

    How: for each CPU buffer, madvise MADV_HUGEPAGE over its 2 MiB-aligned interior, then
    MADV_DONTNEED, which hands its zero-filled pages back, then faults every 2 MiB region back in as
    one zeroed huge page (MADV_POPULATE_WRITE, or a zero written into each region on kernels before
    5.14). The values are unchanged only because the pool is all zeros: call this on a freshly zeroed
    pool, never on one holding blocks. It waits for the pool's buffers to be ready, so no computation
    is writing them. Faulting the pool in here rather than at its first writes keeps the kernel's
    huge-page faults (zeroing, compaction) out of the steps: left to the steps, the KV write of a
    128-row bfloat16 decode step took 5.5 ms instead of 10 us each time it reached a fresh region
    (Intel Xeon, 2 cores).
    """
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for shard in cache.kv.addressable_shards:
        if shard.device.platform != "cpu":
            continue
        buffer = shard.data.block_until_ready()
        address = buffer.unsafe_buffer_pointer()
        start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (address + buffer.nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start and madvise(start, end - start, _MADV_HUGEPAGE) == 0:
            madvise(start, end - start, _MADV_DONTNEED)  # the pages hold zeros: nothing is lost
            if madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
                for page in range(start, end, HUGE_PAGE_BYTES):
                    ctypes.memset(page, 0, 1)
            advised += end - start
    return advised


def bytes_per_block(config: ModelConfig, block_size: int, dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    itemsize = np.dtype(dtype).itemsize
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def num_blocks_for_memory(config: ModelConfig, block_size: int, dtype, memory_bytes: int) -> int:
    """How many blocks (the null block included) fit in `memory_bytes` of KV cache."""
    return int(memory_bytes // bytes_per_block(config, block_size, dtype))


# Of the memory a device reports free, what the KV pool and parameters may take: the rest is left
# for the steps' activations, the compiled executables and the host process itself.
USABLE_FRACTION = 0.9


def host_available_bytes() -> Optional[int]:
    """The host memory the kernel could give this process now (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_available_bytes(device=None) -> Optional[int]:
    """The memory a JAX device can still allocate (a CPU device: the host's), or None when unknown."""
    device = device or jax.local_devices()[0]
    if device.platform == "cpu":
        return host_available_bytes()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def check_pool_fits(config: ModelConfig, block_size: int, dtype, num_blocks: int, num_cpu_blocks: int,
                    params_bytes: int) -> None:
    """Raises ValueError, saying how many blocks fit, when a KV pool of `num_blocks` blocks (with
    `params_bytes` of parameters still to be placed on the device) or a CPU swap pool of
    `num_cpu_blocks` blocks would not fit in `USABLE_FRACTION` of the memory available now. Checked
    before anything is allocated: the pool, and the host state that tracks it."""
    block = bytes_per_block(config, block_size, dtype)
    device = jax.local_devices()[0]  # this process's (several processes: each checks its own)
    on_host = device.platform == "cpu"  # the device pool, the parameters and the swap pool share host memory
    device_need = num_blocks * block + params_bytes + (num_cpu_blocks * block if on_host else 0)
    available = device_available_bytes(device)
    where = "this machine's memory" if on_host else f"{device.device_kind} memory"
    if available is not None and device_need > USABLE_FRACTION * available:
        room = USABLE_FRACTION * available - params_bytes - (num_cpu_blocks * block if on_host else 0)
        fits = max(int(room // block), 0)
        raise ValueError(
            f"a KV pool of {num_blocks:,} blocks of {block_size} tokens needs {format_bytes(num_blocks * block)}"
            f"{' (with the swap pool and the parameters' if on_host else ' (with the parameters'}: "
            f"{format_bytes(device_need)}), but {where} has {format_bytes(available)} available: at most "
            f"{fits:,} blocks ({format_bytes(fits * block)}) fit; lower num_blocks / --num-blocks or "
            "kv_cache_memory / --kv-cache-memory")
    host_available = host_available_bytes()
    if not on_host and host_available is not None and num_cpu_blocks * block > USABLE_FRACTION * host_available:
        fits = int(USABLE_FRACTION * host_available // block)
        raise ValueError(f"a CPU swap pool of {num_cpu_blocks:,} blocks needs {format_bytes(num_cpu_blocks * block)}, "
                         f"but the host has {format_bytes(host_available)} available: lower swap_space / "
                         f"--swap-space to at most {format_bytes(fits * block)}")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          **{p + "b": 1000 ** (i + 1) for i, p in enumerate("kmgt")},
          **{p + "ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")}}


def parse_memory_size(text: str | int | float) -> int:
    """'512MiB', '2GiB', '1.5GB', '1TB', '1e9' or a number of bytes -> bytes (a positive integer).
    Units: B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB and K, M, G, T (powers of 1024)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
        value, unit = (float(match[1]), match[2]) if match else (math.nan, "")
    if unit not in _UNITS or not value * _UNITS[unit] >= 1:
        raise ValueError(f"cannot read memory size {text!r}: write e.g. '512MiB', '2GiB', '1TB' or a number of bytes")
    return int(value * _UNITS[unit])
