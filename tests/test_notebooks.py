"""The notebooks run top to bottom (small settings: SPECJAX_NOTEBOOK_SMALL=1), so they
cannot rot; their outputs are stripped in the repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_data import write_spec_bench

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_are_committed_without_outputs():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart_cpu.ipynb", "gpu.ipynb"}
  for path in NOTEBOOKS:
    for cell in json.loads(path.read_text())["cells"]:
      if cell["cell_type"] == "code":
        assert not cell["outputs"] and cell["execution_count"] is None, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
  import nbclient
  import nbformat
  data = write_spec_bench(tmp_path / "data")
  monkeypatch.setenv("SPECJAX_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("SPECJAX_NOTEBOOK_RUNS", str(tmp_path / "runs"))
  monkeypatch.setenv("SPECJAX_DATA_DIR", str(data))
  monkeypatch.setenv("SPECJAX_REPO", str(ROOT))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
