"""The KV pool is never copied by a step: the compiled decode and prefill steps alias the donated
pool to their output and contain no copy of it (a slice of a layer out of the stacked pool, or
the pool threaded through the layer scan as scanned input/output, would show up here)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jpaged.device.attention import native
from jpaged.device.attention.xla import XLABackend
from jpaged.device.config import ModelConfig
from jpaged.device.kv_cache import HUGE_PAGE_BYTES
from jpaged.device.params import init_params
from jpaged.device.runner import ModelRunner
from jpaged.core.scheduler import Row

CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=512)
NUM_BLOCKS, BLOCK_SIZE = 97, 8  # an odd count so the pool's shape is unmistakable in the HLO


BACKENDS = ["xla"] + (["native"] if native.available_variants() else [])  # the native kernel reads it in place too


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decode", [True, False])
def test_compiled_step_updates_the_pool_in_place(decode, backend):
    runner = ModelRunner(CONFIG, init_params(CONFIG, jax.random.key(0)), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         backend=XLABackend() if backend == "xla" else native.NativeBackend())
    rows = [Row([5] if decode else [5, 6, 7], 3 if decode else 0, [16 + 3] if decode else [16, 17, 18], [2, 9])]
    before = runner.cache.kv
    runner.execute(rows, decode=decode)
    assert before.is_deleted()  # the donated buffer was consumed, not kept alongside a copy
    (executable,) = runner.executables.values()
    hlo = executable.as_text()
    pool = f"f32[{CONFIG.num_layers},{NUM_BLOCKS},2,{BLOCK_SIZE},{CONFIG.num_kv_heads},{CONFIG.head_dim}]"
    assert "input_output_alias" in hlo
    copies = [line for line in hlo.splitlines() if re.search(rf"= {re.escape(pool)}\S* copy\(", line)]
    assert copies == [], copies
    layer_slices = [line for line in hlo.splitlines()
                    if re.search(rf"= f32\[{NUM_BLOCKS},2,{BLOCK_SIZE},{CONFIG.num_kv_heads},{CONFIG.head_dim}\]", line)]
    assert layer_slices == [], layer_slices  # no whole layer of the pool is ever materialised


def _present(address: int) -> bool:
    """Whether the 4 KiB page holding `address` is mapped (/proc/self/pagemap, bit 63)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // 4096 * 8)
        return bool(int.from_bytes(f.read(8), "little") >> 63)


def _huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _transparent_huge_pages() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _transparent_huge_pages(), reason="Linux with transparent huge pages")
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_lies_on_huge_pages_and_keeps_its_buffer(backend):
    """The runner asks for huge pages under its pool (`back_with_huge_pages`): its zero-filled pages are
    handed back and faulted in again as huge pages before any step (so no step pays for the faults): the
    2 MiB around a block are mapped before it is written, and its mapping holds huge pages; the step keeps
    the buffer, and every other value is zero."""
    num_blocks = 4001  # 24 MiB: several whole huge pages
    runner = ModelRunner(CONFIG, init_params(CONFIG, jax.random.key(0)), num_blocks=num_blocks, block_size=BLOCK_SIZE,
                         backend=XLABackend() if backend == "xla" else native.NativeBackend())
    address = runner.cache.kv.unsafe_buffer_pointer()
    block = 3000  # layer 0's copy lies ~6 MiB into the pool: its 2 MiB region is one the runner advised
    written = address + block * runner.cache.kv[0, 0].nbytes
    region = written // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    far_pages = [page for page in (region, region + HUGE_PAGE_BYTES - 4096)  # the region's first and last
                 if page // 4096 != written // 4096]  # 4 KiB pages, not the one written
    assert all(map(_present, far_pages))  # faulted in before any write
    assert _huge_kib(region) >= HUGE_PAGE_BYTES // 1024  # as huge pages
    runner.execute([Row([5, 6, 7], 0, [block * BLOCK_SIZE + i for i in range(3)], [block])], decode=False)
    kv = runner.cache.kv
    assert kv.unsafe_buffer_pointer() == address  # the donated buffer, updated in place
    kv = np.array(kv)
    assert np.abs(kv[:, block, 0, :3]).min() > 0  # the prompt's keys (RoPE'd projections: no exact zeros)
    kv[:, block, :, :3] = 0  # and their values
    kv[:, 0] = 0  # the null block: the padded tokens' slots
    assert not kv.any()  # everything else reads zero, as before the pages were handed back
