"""The layers hold: import-linter's contracts (pyproject.toml, `[tool.importlinter]`) pass on the
repository, and fail when a module breaks one (a deliberate forbidden import in a copy of the tree)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT_IMPORTS = pathlib.Path(sys.executable).parent / "lint-imports"


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: install the test extra (pip install -e '.[test]')")
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=root, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_contracts_hold():
    result = lint_imports(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize("module, source, contract", [
    ("jpaged/core/_probe.py", "import jax\n", "the host core imports neither JAX nor the device side"),
    ("jpaged/core/_probe.py", "from jpaged.device import runner\n", "jpaged's layers"),
    ("jpaged/device/_probe.py", "from jpaged.engine import LLMEngine\n", "jpaged's layers"),
    ("pallas_kernels/_probe.py", "import jpaged.core.scheduler\n", "the kernels import nothing of jpaged"),
    ("jpaged/engine/_probe.py", "from bench.baselines import orca\n", "nothing in the product imports the benchmarks"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, source, contract):
    for package in ("jpaged", "pallas_kernels", "bench"):
        shutil.copytree(REPO_ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "results", "data", "*.png", "*.json"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert lint_imports(tmp_path).returncode == 0  # the copy is as clean as the original
    (tmp_path / module).write_text(source)
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), result.stdout
