"""Runs at the start of every Python process whose PYTHONPATH names this folder (`bench.common.isa_env("avx2")`
puts it there for jpaged's processes): caps YNNPACK, the library that runs XLA's large dots on a CPU, to the
kernels it would choose on a CPU without AVX-512.

`--xla_cpu_max_isa=AVX2` caps the code XLA generates, not the kernels of the libraries it calls: on an AMD EPYC
Zen 4 under that flag a float32 dot of 64 rows ran `ynn::dot_fp32_5x64x1_1x16x1_avx512` and a bfloat16 one
`ynn::dot_bf16_bf16_fp32_12x32x2_1x16x2_avx512bf16` (perf). YNNPACK reads the CPU's features once, through
cpuinfo, into the function-local static `flags` of `ynn::get_supported_arch_flags()`; this hook writes the
flags of an AVX2 CPU with FMA3 and F16C into it and marks it initialized, before any dot is compiled, so that
YNNPACK picks the kernels it would pick on such a CPU (the same dots then ran `dot_fp32_6x16x1_1x8x1_fma3` and
`dot_bf16_bf16_fp32_5x16x2_1x8x2_avx2_fma3`). The flag bits below (sse2 .. fma3, the first seven of
`ynn::arch_flag`) are the same in every YNNPACK version seen; the symbols come from libjax_common.so's symbol
table (binutils' `nm`). A benchmark's tool, never the product's: it changes nothing in jpaged.

A jaxlib without YNNPACK has nothing to cap (a note says so); one whose symbols cannot be read stops the
process, so that no figure is recorded as AVX2's that is not.
"""

import ctypes
import importlib
import os
import subprocess
import sys

_FLAGS = "_ZZN3ynn24get_supported_arch_flagsEvE5flags"  # ynn::get_supported_arch_flags()::flags (uint64)
_GUARD = "_ZGVZN3ynn24get_supported_arch_flagsEvE5flags"  # its guard (first byte nonzero: initialized)
AVX2_CPU = 0x7F  # ynn::arch_flag: sse2 | ssse3 | sse41 | avx | f16c | avx2 | fma3


def _ynnpack_static() -> tuple:
    """(libjax_common.so's path, YNNPACK's flags as a ctypes uint64, their guard as a uint8), or (path, None,
    None) where that library has no YNNPACK."""
    importlib.import_module("jaxlib._jax")  # loads libjax_common.so
    path = base = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[-1].endswith("/libjax_common.so") and int(fields[2], 16) == 0:
                path, base = fields[-1], int(fields[0].split("-")[0], 16)
                break
    if path is None:
        raise RuntimeError("libjax_common.so is not mapped after importing jaxlib._jax")
    symbols = {}
    for line in subprocess.run(["nm", path], capture_output=True, text=True, check=True).stdout.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[2] in (_FLAGS, _GUARD):
            symbols[fields[2]] = int(fields[0], 16)
    if not symbols:
        return path, None, None
    if len(symbols) != 2:
        raise RuntimeError(f"found {sorted(symbols)} of {_FLAGS} and {_GUARD} in {path}")
    return (path, ctypes.c_uint64.from_address(base + symbols[_FLAGS]),
            ctypes.c_uint8.from_address(base + symbols[_GUARD]))


def ynnpack_flags() -> int | None:
    """The CPU features YNNPACK chooses its kernels by in this process (None: not read yet, or no YNNPACK)."""
    _, flags, guard = _ynnpack_static()
    return flags.value if flags is not None and guard.value else None


def _cap_ynnpack() -> str:
    path, flags, guard = _ynnpack_static()
    if flags is None:
        return f"no YNNPACK in {path}: nothing to cap"
    was = hex(flags.value) if guard.value else "unread"
    flags.value = AVX2_CPU
    guard.value = 1
    return f"YNNPACK's CPU features {was} -> {hex(AVX2_CPU)} (AVX2, FMA3, F16C)"


try:
    print(f"[avx2_only] pid {os.getpid()}: {_cap_ynnpack()}", file=sys.stderr, flush=True)
except Exception as e:  # noqa: BLE001 (any failure leaves the process on AVX-512 kernels: stop it)
    print(f"[avx2_only] cannot cap YNNPACK to AVX2 ({type(e).__name__}: {e}); stopping, so that no figure is "
          "recorded as AVX2's that is not (needs binutils' nm and a jaxlib with a symbol table)",
          file=sys.stderr, flush=True)
    os._exit(3)
