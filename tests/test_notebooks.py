"""Every notebook (jupytext percent .py, no stored outputs) runs top to bottom on records of tiny-model runs."""

import os
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

from selfspec.records.runs import latest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PLOTS = {"threshold_sweep": 1, "adaptive_trace": 2, "skip_ratio": 1, "search_history": 3, "strategies": 2,
         "sampling": 1, "batch": 2, "field": 1}


def with_records(notebook, path: Path):
    """The notebook with RECORDS set after its `parameters` cell (as papermill does)."""
    (index,) = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(f"RECORDS = {str(path)!r}"))
    return notebook


def test_notebooks_are_percent_scripts_without_outputs():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.py")) == sorted(PLOTS)
    assert not list(NOTEBOOKS.glob("*.ipynb"))
    for path in NOTEBOOKS.glob("*.py"):
        text = path.read_text()
        assert "format_name: percent" in text and "# %%" in text
        assert 'RECORDS = None' in text


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLOTS))
def test_notebook_runs_on_tiny_records(name, tiny_outputs, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    records = latest(tiny_outputs, name)
    notebook = with_records(jupytext.read(NOTEBOOKS / f"{name}.py"), records)
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=120,
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs_ = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs_) == PLOTS[name]
    printed = "".join(o.get("text", "") for o in outputs_ if o.get("output_type") == "stream")
    assert str(records) in printed  # the notebook says which records it read
