"""Figures for reports: matplotlib without a display, saved and closed in one call."""

from __future__ import annotations

from pathlib import Path


def pyplot():
  """matplotlib.pyplot on the non-interactive Agg backend (benchmarks run headless)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def save(fig, path: str | Path, dpi: int = 110) -> Path:
  """Lay out, write and close `fig`; return its path."""
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)
  return Path(path)
