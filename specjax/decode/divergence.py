"""Where greedy SSD leaves greedy AR's tokens in bfloat16: a numerical tie, or a mismatch.

In float32 on a CPU a verification's rows are the AR steps' logits bit for bit, and any
divergence is a bug. In bfloat16 they are not: verification computes γ + 1 rows in one
set of dots, the AR step one row, and bfloat16 activations round the two differently at
every layer. Where the target's two best tokens are that close, the two paths may pick
different ones, and both picks are the model's. So each divergence is accounted for at
its first differing position t, where AR chose a and SSD chose b:

* the reference: the same weights computed with float32 activations (`--dtype mixed`'s
  arithmetic, the closest this model's weights get to exact), over the prompt and the
  tokens both paths share, read at t: its logits r;
* the rounding: e = max_v |l_v − r_v|, how far bfloat16 activations moved this row's
  logits from the reference (l: the same forward in bfloat16);
* the bound 2e: each path's logits lie within about e of r, so the gap between two
  tokens can move by up to 2e from the reference's, and the paths can order a and b
  differently only if |r_a − r_b| ≤ 2e.

A divergence within the bound is a numerical tie; beyond it, a mismatch: no rounding of
this size picks b over a, so something chose a token the target did not. The bound is the
rounding of this row as measured, not of the exact op sequence each path ran (those
logits never leave the device loops), which it approximates by the same arithmetic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Divergence:
  position: int  # index into the generated tokens of the first difference
  ar_token: int
  ssd_token: int
  gap: float  # the reference's logit of the AR token minus the SSD token's
  bound: float  # 2e: twice the row's largest |bfloat16 - reference| logit difference
  tie: bool  # |gap| <= bound

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
  """The first index where the token lists differ (a length counts), None if equal."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def account(graphdef, state, config, prompt: Sequence[int], ar: Sequence[int],
            ssd: Sequence[int]) -> Divergence | None:
  """The first divergence of `ssd` from `ar` (generated after `prompt` by a bfloat16
  model), accounted for as above; None when they agree or one stops early."""
  from specjax.models.loader import at_precision

  t = first_difference(ar, ssd)
  if t is None or t >= min(len(ar), len(ssd)):
    return None
  ids = jnp.asarray([list(prompt) + list(ar[:t])], jnp.int32)
  low = _last_logits(graphdef, state, config, ids)
  ref_config, ref_graphdef, ref_state = at_precision(config, state, "mixed")
  ref = _last_logits(ref_graphdef, ref_state, ref_config, ids)
  e = float(np.max(np.abs(low - ref)))
  a, b = int(ar[t]), int(ssd[t])
  gap = float(ref[a] - ref[b])
  return Divergence(t, a, b, gap, 2 * e, abs(gap) <= 2 * e)


def _last_logits(graphdef, state, config, ids) -> np.ndarray:
  """float32 logits of the token after ids[1, T] (one forward of the prompt)."""
  from specjax.decode.generate import compute_dtype, positions_for
  from specjax.kv_cache import KVCache
  from specjax.model import apply
  from specjax.plan import DraftPlan

  T = ids.shape[1]
  cache = KVCache.create(config, 1, T, compute_dtype(config, state))
  run = jax.jit(lambda s, c, i: apply(s, c, i, positions_for(c, T, 1),
                                      DraftPlan.full(config.num_layers), graphdef=graphdef,
                                      logits="last")[0].logits)
  return np.asarray(run(state, cache, ids)[0, -1], np.float32)
