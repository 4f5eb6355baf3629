"""GPU-less checks of the kernels' Triton code: lower to Triton IR, compile to PTX, read ptxas stats.

A development aid for machines without a GPU (kept out of the shipped `pallas_kernels`: it uses
private JAX API, `jax._src`, and runs `ptxas`):

0. ``lower_for_cuda(fn, *args)`` lowers ``fn`` for CUDA on a GPU-less machine (``abstract_gpu``).
1. ``triton_modules(fn, *args)`` lowers ``fn`` for CUDA (as on a GPU machine, via an abstract H200
   device) and captures the Triton IR that the Pallas Triton lowering hands to XLA, with each
   kernel's ``num_warps`` / ``num_stages``.
2. ``compile_for_sm90(module)`` compiles that IR with the upstream ``triton`` package (if
   installed; not a project dependency) for ``sm_90a`` and runs its bundled ``ptxas -v``:
   registers per thread, spills, shared memory, whether dots became tensor-core MMAs, and how
   the loop's K/V loads were pipelined (``async_copies``: global->shared ``cp.async`` copies in
   the TTGIR; ``copy_buffers``: the fewest buffers any of them got, 1 meaning that the copy of
   the next iteration waits for this one's compute, >= 2 that copies are in flight during it).

XLA compiles the same IR with its own Triton fork, so this is strong evidence, not proof, that a
kernel compiles on the GPU, and the numbers are close to, not equal to, what the GPU run gets.
Uses private JAX API (``jax._src``); returns nothing where that API differs.

    python bench/triton_check.py      # a table for the default shapes (needs `pip install triton`)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp



@dataclasses.dataclass(frozen=True)
class TritonModule:
    name: str
    ir: str  # Triton IR (MLIR text)
    num_warps: int
    num_stages: int


def abstract_gpu(device_kind: str = "NVIDIA H200"):
    """Context in which a CPU-only process can *lower* a Triton ``pallas_call`` for CUDA.

    ``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs the Pallas Triton
    lowering (jaxpr -> Triton IR, with the MLIR verifier) without a GPU; the lowering asks for
    the GPU's compute capability, which an abstract mesh with an abstract device supplies.
    Uses private JAX API (present in 0.10.2 and 0.11.2); returns ``None`` where it is absent.
    Tests use it to check that the kernels are Triton-lowerable; compiling the Triton IR to PTX
    still needs a GPU.
    """
    try:
        from jax._src import mesh as mesh_lib

        device = mesh_lib.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
        mesh = mesh_lib.AbstractMesh((1,), ("x",), abstract_device=device)
        return jax.sharding.use_abstract_mesh(mesh)
    except Exception:  # noqa: BLE001 - any API drift means "not available here"
        return None


def lower_for_cuda(fn, *args, **kwargs) -> str | None:
    """StableHLO text of ``fn`` lowered for CUDA on this (possibly GPU-less) machine, or None."""
    ctx = abstract_gpu()
    if ctx is None:
        return None
    with ctx:
        lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def triton_modules(fn, *args, **kwargs) -> list[TritonModule]:
    """The Triton IR of every Pallas kernel in ``fn(*args, **kwargs)`` lowered for CUDA."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError:
        return []
    captured: list[str] = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def spy(*a, **k):
        result = original(*a, **k)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = spy
    try:
        text = lower_for_cuda(fn, *args, **kwargs)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
    if text is None:
        return []
    params = re.findall(r"name = \"(\w+)\", num_stages = (\d+) : i32, num_warps = (\d+) : i32", text)
    if len(params) != len(captured):  # unexpected custom-call syntax: fall back to defaults
        params = [("kernel", "3", "4")] * len(captured)
    return [
        TritonModule(name=n, ir=ir, num_warps=int(w), num_stages=int(s))
        for ir, (n, s, w) in zip(captured, params)
    ]


def _ptxas() -> str | None:
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads newer PTX versions
        path = os.path.join(bin_dir, name)
        if os.path.exists(path):
            return path
    return None


def compile_for_sm90(module: TritonModule) -> dict:
    """Compiles one module with upstream Triton for sm_90a; ptxas statistics as a dict."""
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{module.name}.ttir")
        with open(path, "w") as f:
            f.write(module.ir)
        kernel = triton.compile(
            path,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": module.num_warps, "num_stages": module.num_stages},
        )
        ptx = kernel.asm["ptx"]
        ttgir = kernel.asm["ttgir"]
        # Buffers of the pipelined global->shared copies (cp.async): Triton's pipeliner
        # allocates `[buffers, ...tile]` per load it pipelines. 1: the copy of iteration i + 1
        # is issued only after iteration i's compute (no overlap); >= 2: copies in flight
        # during the compute.
        buffers = [int(n) for n in re.findall(
            r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x[^>]*mutable", ttgir)]
        ptx_path = os.path.join(tmp, "k.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        stats = {
            "name": module.name,
            "num_warps": module.num_warps,
            "num_stages": module.num_stages,
            "shared_bytes": kernel.metadata.shared,
            "mma_instructions": ptx.count("mma.sync") + ptx.count("wgmma"),
            "async_copies": ttgir.count("ttg.async_copy_global_to_local"),
            "copy_buffers": min(buffers) if buffers else 0,
        }
        ptxas = _ptxas()
        if ptxas:
            out = subprocess.run(
                [ptxas, "-v", "--gpu-name", "sm_90a", ptx_path, "-o", os.devnull],
                capture_output=True, text=True, check=True,
            ).stderr
            regs = re.search(r"Used (\d+) registers", out)
            spill_st = re.search(r"(\d+) bytes spill stores", out)
            spill_ld = re.search(r"(\d+) bytes spill loads", out)
            stats["registers"] = int(regs.group(1)) if regs else None
            stats["spill_bytes"] = (int(spill_st.group(1)) if spill_st else 0) + (
                int(spill_ld.group(1)) if spill_ld else 0
            )
    return stats


def default_report() -> list[dict]:
    """ptxas statistics for the kernels at the bench's head configurations (the ragged kernel with and
    without a window and soft-cap: 512 packed tokens in 32 rows). Each row also gives ``ir_chars``, the
    size of the kernel's Triton IR."""
    from pallas_kernels import copy_blocks, paged_attention, ragged_paged_attention, write_kv

    spec = jax.ShapeDtypeStruct
    rows = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for heads, kv_heads, head_dim, block_size in [(9, 3, 64, 16), (32, 8, 128, 16)]:
            pool = spec((30, 4096, 2, block_size, kv_heads, head_dim), dtype)  # K, V side by side
            layer = spec((), jnp.int32)
            cases = {
                "paged_attention": (
                    functools.partial(paged_attention, scale=head_dim**-0.5),
                    (spec((32, heads, head_dim), dtype), pool, spec((32, 256), jnp.int32),
                     spec((32,), jnp.int32)),
                    {"layer": layer},
                ),
                "write_kv": (
                    write_kv,
                    (pool, spec((64, kv_heads, head_dim), dtype),
                     spec((64, kv_heads, head_dim), dtype), spec((64,), jnp.int32)),
                    {"layer": layer},
                ),
                "copy_blocks": (copy_blocks, (pool, spec((16, 2), jnp.int32)), {}),
            }
            ragged_args = (spec((512, heads, head_dim), dtype), pool, spec((33,), jnp.int32),
                           spec((32,), jnp.int32), spec((32, 256), jnp.int32))
            cases["ragged_paged_attention"] = (
                functools.partial(ragged_paged_attention, scale=head_dim**-0.5), ragged_args,
                {"layer": layer})
            cases["ragged_paged_attention (window, softcap)"] = (
                functools.partial(ragged_paged_attention, scale=head_dim**-0.5, softcap=50.0), ragged_args,
                {"layer": layer, "window": spec((), jnp.int32)})
            for case, (fn, args, kwargs) in cases.items():
                for module in triton_modules(fn, *args, **kwargs):
                    stats = compile_for_sm90(module)
                    stats.update(case=case, dtype=jnp.dtype(dtype).name, heads=f"{heads}/{kv_heads}",
                                 head_dim=head_dim, block_size=block_size, ir_chars=len(module.ir))
                    rows.append(stats)
    return rows


if __name__ == "__main__":
    for row in default_report():
        print(row)
