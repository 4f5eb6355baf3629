"""Everything that differs between the JAX releases the kernels run on, in one place.

The kernels are written against the API common to jax 0.10.2 (Python 3.11, CPU machines,
``interpret=True``) and jax 0.11.2 (Python 3.12, GPU machines, compiled through the Pallas
Triton lowering). Both releases export ``jax.experimental.pallas.triton.CompilerParams``
(``num_warps``, ``num_stages``) and ``pl.no_block_spec``; neither kernel uses ``pl.load`` /
``pl.store`` (absent from ``pl`` in 0.10.2): refs are indexed directly, which both the Triton
lowering and the interpreter understand.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# A whole-array operand: the kernel gets a ref to all of it (a raw pointer under Triton) and
# indexes it itself, e.g. through the block table. `None` in `in_specs` is rejected by 0.11.
WHOLE_ARRAY = pl.no_block_spec


def compiler_params(*, num_warps: int, num_stages: int) -> Any:
    """Triton compiler parameters (ignored in interpret mode)."""
    try:
        from jax.experimental.pallas import triton as pl_triton

        return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):  # pragma: no cover - a release without the Triton backend
        try:
            from jax.experimental.pallas import gpu as pl_gpu  # older spelling

            return pl_gpu.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)
        except (ImportError, AttributeError):
            return None
