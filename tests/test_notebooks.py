"""Every notebook in notebooks/ runs top to bottom (its code cells, in order, in one namespace) and
draws at least one matplotlib figure.

The cells carry their own assertions; a cell that raises fails the test. Executing the cells
directly keeps the test suite free of a Jupyter kernel dependency; matplotlib draws with the Agg
backend (no display). Cells run with the repository root as the working directory, as a notebook
opened there does (the notebooks that import `bench` also find it from `notebooks/`).

Time budget: the whole file within 3 minutes on the 2-core CPU machines with JAX's compilation
cache cold (`JPAGED_JAX_CACHE=0`), the default model loaded once for the session. Measured: 2 min
51 s (model load 13 s, finetune_then_serve 56 s, memory_and_throughput 41 s, sharing 32 s,
quickstart 14 s, paged_kv_cache 12 s) while other processes kept the load average near 3; with
the cache warm, 2 min 37 s (the steps themselves, not compilation, take most of the time).
Keep engines small (a few dozen blocks) and outputs short. `sharding.ipynb` forces 6 CPU devices
before JAX starts, so it runs in a fresh interpreter (loading the model itself): 77 s measured while
another job kept both cores busy.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


FORCED_DEVICES = "xla_force_host_platform_device_count"  # a notebook that sets it runs in a fresh process


def code_cells(path) -> list[str]:
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in cells), (
        f"{path.name} is saved with outputs: clear them")
    return ["".join(c["source"]) for c in cells]


# Runs a notebook's cells in a fresh interpreter (for notebooks that force CPU devices before JAX
# starts, which this test session's JAX has done already), with the same checks.
_RUNNER = """
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
namespace = {"__name__": "__notebook__"}
for number, source in enumerate(json.loads(sys.stdin.read())):
    exec(compile(source, f"cell {number}", "exec"), namespace)
assert plt.get_fignums(), "the notebook drew no figure"
"""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, default_model, monkeypatch):
    from jpaged.engine import llm_engine

    if FORCED_DEVICES in code_cells(path)[0]:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(code_cells(path)), text=True,
                              capture_output=True, cwd=REPO_ROOT, env=env, timeout=600)
        assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        return

    # the notebook loads the default model; hand it the session's copy instead of reading the file again
    monkeypatch.setattr(llm_engine, "load_model", lambda path, dtype=None: default_model)
    monkeypatch.chdir(REPO_ROOT)
    namespace = {"__name__": "__notebook__"}
    cells = code_cells(path)
    plt.close("all")
    try:
        for number, source in enumerate(cells):
            try:
                exec(compile(source, f"{path.name}[cell {number}]", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{path.name}, code cell {number} failed: {e!r}\n{source}") from e
        assert plt.get_fignums(), f"{path.name} drew no figure"
    finally:
        plt.close("all")


def test_there_is_a_notebook():
    assert NOTEBOOKS


def test_the_drawing_module_imports_without_matplotlib_or_jax():
    """matplotlib is an optional extra: `jpaged.entrypoints.viz` imports it only to draw."""
    import subprocess
    import sys

    code = ("import sys, jpaged.entrypoints.viz; "
            "assert not {'matplotlib', 'jax'} & set(sys.modules), sorted({'matplotlib', 'jax'} & set(sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                            env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
