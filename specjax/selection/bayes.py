"""Bayesian optimisation over plan bits (`plan.py`) with the `bayesian-optimization` package (as
Draft&Verify did): each sub-layer gets a coordinate in [0, 1], > 0.5 means skip."""

from __future__ import annotations

import warnings

import numpy as np


def _optimizer(dims: int, seed: int):
  from bayes_opt import BayesianOptimization, acquisition

  opt = BayesianOptimization(
      f=None,
      pbounds={f"x{i:03d}": (0.0, 1.0) for i in range(dims)},
      acquisition_function=acquisition.UpperConfidenceBound(kappa=2.5),
      random_state=seed,
      verbose=0,
      allow_duplicate_points=True,
  )
  return opt


def _to_vector(params: dict) -> np.ndarray:
  return np.asarray([params[k] for k in sorted(params)])


def _suggest(opt) -> np.ndarray:
  """The next point to probe: the acquisition maximum over 5000 random candidates.

  bayes_opt's default then polishes it with L-BFGS-B restarts, which in 2L dimensions
  cost seconds a step, a hundred times more than the step without them, and the point is
  rounded to skip bits anyway."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if len(opt.space) == 0:
      return _to_vector(opt.suggest())
    try:
      x = opt._acquisition_function.suggest(  # noqa: SLF001 (no public knob for this)
          gp=opt._gp, target_space=opt.space, n_random=5000, n_smart=0, fit_gp=True,
          random_state=opt._random_state)
      return np.asarray(x, dtype=float)
    except (AttributeError, TypeError):  # a bayes_opt without these internals
      return _to_vector(opt.suggest())


def suggest_bits(xs: np.ndarray, ys: np.ndarray, skippable: np.ndarray, budget: int,
                 seed: int = 0) -> np.ndarray:
  """Plan bits (`plan.py`) skipping exactly `budget` of the `skippable` sub-layers, from a
  GP fitted to plan bits xs[n, 2L] and their scores ys[n].

  The GP's variables are the skippable sub-layers' skip indicators; its suggestion is
  continuous, and the `budget` highest coordinates are skipped, so the proposal has the
  same cost as the random ones it competes with.
  """
  opt = _optimizer(skippable.size, seed)
  seen = set()
  for bits, y in zip(xs, ys):
    skips = ~bits[skippable]
    if skips.tobytes() in seen:
      continue
    seen.add(skips.tobytes())
    opt.register({f"x{i:03d}": float(b) for i, b in enumerate(skips)}, float(y))
  x = _suggest(opt)
  out = np.ones(xs.shape[1], bool)
  out[skippable[np.argsort(-x)[:budget]]] = False
  return out


class BitSearch:
  """Ask / tell BO over plan bits with no fixed budget: the GP's variables are skip
  indicators, and a coordinate above 0.5 skips that sub-layer."""

  def __init__(self, dims: int, seed: int = 0):
    self.dims = dims
    self._opt = _optimizer(dims, seed)
    self._seen: set[bytes] = set()

  def ask(self) -> np.ndarray:
    return ~(_suggest(self._opt) > 0.5)

  def tell(self, bits: np.ndarray, value: float) -> None:
    skips = ~np.asarray(bits, bool)
    if skips.tobytes() in self._seen:  # the GP gains nothing from a repeated point
      return
    self._seen.add(skips.tobytes())
    self._opt.register({f"x{i:03d}": float(b) for i, b in enumerate(skips)}, float(value))
