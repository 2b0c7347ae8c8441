from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.plan import DraftPlan, PlanError


def test_constructors():
  full = DraftPlan.full(4)
  assert full.active_fraction == 1.0
  p = DraftPlan.from_skips(4, skip_attn=[0], skip_mlp=[1, 3])
  assert p.attn.tolist() == [False, True, True, True]
  assert p.mlp.tolist() == [True, False, True, False]
  assert p.active_fraction == pytest.approx(5 / 8)
  e = DraftPlan.first_layers(4, 2)
  assert e.attn.tolist() == e.mlp.tolist() == [True, True, False, False]


def test_json_round_trip():
  p = DraftPlan.from_skips(5, skip_attn=[2], skip_mlp=[4])
  q = DraftPlan.from_json(p.to_json())
  np.testing.assert_array_equal(p.attn, q.attn)
  np.testing.assert_array_equal(p.mlp, q.mlp)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DraftPlan.from_masks([True, False], [True]),
        lambda: DraftPlan.from_masks([1, 2], [1, 1]),
        lambda: DraftPlan.from_masks([[True]], [[True]]),
        lambda: DraftPlan.from_skips(3, skip_attn=[3]),
        lambda: DraftPlan.first_layers(3, 4),
        lambda: DraftPlan.from_json({"attn": [True]}),
    ],
)
def test_malformed_plans_are_refused(make):
  with pytest.raises(PlanError):
    make()


def test_check_against_model_size():
  with pytest.raises(PlanError, match="4 layers"):
    DraftPlan.full(3).check(4)
  bad = DraftPlan(attn=jnp.ones(4, jnp.int32), mlp=jnp.ones(4, jnp.int32))
  with pytest.raises(PlanError, match="bool"):
    bad.check(4)
  DraftPlan.full(4).check(4)


def test_a_dense_plan_that_skips_is_refused():
  """`dense` promises the forward every sub-layer (it traces no conditional): a plan
  that also skips one would silently run it."""
  skipping = DraftPlan.full(4).replace(attn=jnp.asarray([True, False, True, True]))
  with pytest.raises(PlanError, match="dense"):
    skipping.check(4)
  assert not DraftPlan.from_skips(4).dense


def test_freeze_makes_the_masks_static_and_is_checked():
  plan = DraftPlan.from_skips(4, skip_attn=[1], skip_mlp=[3]).freeze()
  assert plan.frozen == ((True, False, True, True), (True, True, True, False))
  assert plan.runs("attn", 0) is None and plan.runs("attn", 1) is False
  assert plan.runs("mlp", 3) is False
  assert DraftPlan.full(4).runs("mlp", 3) is None
  stale = plan.replace(attn=jnp.ones(4, jnp.bool_))  # arrays changed, static masks not
  with pytest.raises(PlanError, match="freeze"):
    stale.check(4)


def test_plan_bits_are_sub_layer_order_true_runs_and_bad_bits_are_refused():
  plan = DraftPlan.from_bits([True, False, False, True])  # attn_0, mlp_0, attn_1, mlp_1
  assert plan.to_json() == {"attn": [True, False], "mlp": [False, True]}
  assert plan.to_bits().tolist() == [True, False, False, True]
  with pytest.raises(PlanError, match="two per layer"):
    DraftPlan.from_bits([True, False, True])
  with pytest.raises(PlanError, match="booleans"):
    DraftPlan.from_bits([0, 2])
