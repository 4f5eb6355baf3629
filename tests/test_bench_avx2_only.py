"""The benchmarks' AVX2 emulation (`bench.common.isa_env("avx2")`): a process started with it has YNNPACK, which
runs XLA's large dots, on the kernels of a CPU without AVX-512 for good (bench/avx2_only/sitecustomize.py), and
its dots still compute the right products."""

import os
import subprocess
import sys

import pytest

from bench.common import REPO_ROOT, isa_env

PROGRAM = """
import sitecustomize, jax, jax.numpy as jnp, numpy as np
x = np.arange(64 * 576, dtype=np.float32).reshape(64, 576) % 7 - 3
w = np.arange(576 * 1024, dtype=np.float32).reshape(576, 1024) % 5 - 2
for dtype in (jnp.float32, jnp.bfloat16):
    y = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))(x.astype(dtype), w.astype(dtype))
    assert np.array_equal(np.asarray(y), x @ w), dtype  # small integers: exact in both widths
print(hex(sitecustomize.ynnpack_flags() or 0))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_avx2_emulation_keeps_ynnpack_on_avx2_kernels():
    env = {**os.environ, **isa_env("avx2"), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    if "nothing to cap" in run.stderr:
        pytest.skip("this jaxlib has no YNNPACK")
    assert "YNNPACK's CPU features unread -> 0x7f" in run.stderr
    # read back after two dots have chosen their kernels: YNNPACK did not read the CPU's own features over it
    assert run.stdout.split()[-1] == "0x7f"


def test_native_isa_changes_nothing():
    assert isa_env("native") == {}
    env = isa_env("avx2")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT / "bench" / "avx2_only")
    assert "--xla_cpu_max_isa=AVX2" in env["XLA_FLAGS"] and env["JPAGED_NATIVE_VARIANT"] == "avx2"
    assert all(f"-{f}," in env["GLIBC_TUNABLES"] + "," for f in ("AVX512F", "AVX512VL", "AVX512BW"))
