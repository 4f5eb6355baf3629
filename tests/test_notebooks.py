"""Every notebook in notebooks/ runs top to bottom (its code cells, in order, in one namespace).

The cells carry their own assertions; a cell that raises fails the test. Executing the cells
directly keeps the test suite free of a Jupyter kernel dependency.
"""

from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, default_model, monkeypatch):
    from jpaged.engine import llm_engine

    # the notebook loads the default model; hand it the session's copy instead of reading the file again
    monkeypatch.setattr(llm_engine, "load_model", lambda path, dtype=None: default_model)
    namespace = {"__name__": "__notebook__"}
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells
    for number, cell in enumerate(cells):
        source = "".join(cell["source"])
        try:
            exec(compile(source, f"{path.name}[cell {number}]", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{path.name}, code cell {number} failed: {e!r}\n{source}") from e


def test_there_is_a_notebook():
    assert NOTEBOOKS
