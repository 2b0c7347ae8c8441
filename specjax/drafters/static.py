"""`static`: one fixed plan for the whole generation (from a file, the CLI or a search)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specjax.drafters.base import Drafter
from specjax.plan import DraftPlan, PlanError


@dataclasses.dataclass(frozen=True)
class StaticDrafter(Drafter):
  name = "static"
  adaptive = False
  fixed: DraftPlan

  def init(self, session, prior=None) -> DraftPlan:
    return self.fixed.check(session.config.num_layers)

  def plan(self, state: DraftPlan) -> DraftPlan:
    return state


def save_plan(path: str | Path, plan: DraftPlan, *, model: str, **meta) -> None:
  """A plan file: the masks plus the model they were made for (checked on load)."""
  Path(path).write_text(json.dumps({"model": model, **plan.to_json(), **meta}, indent=1))


def load_plan(path: str | Path, *, model: str) -> DraftPlan:
  try:
    obj = json.loads(Path(path).read_text())
  except (OSError, ValueError) as err:
    raise PlanError(f"cannot read plan file {path}: {err}") from err
  if obj.get("model") not in (None, model):
    raise PlanError(f"plan file {path} was made for model {obj['model']!r}, not {model!r}")
  return DraftPlan.from_json(obj)
