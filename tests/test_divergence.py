"""bfloat16 divergences accounted for: at the first position where greedy SSD leaves
greedy AR, a numerical tie (the reference's two tokens closer than bfloat16's rounding of
that row can move them) or a mismatch, which the benchmarks count as they always did."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from targets import PROMPT, target

from specjax.bench import metrics
from specjax.decode import divergence
from specjax.decode.generate import generate
from specjax.models.loader import at_precision


@pytest.fixture(scope="module")
def bf16_run():
  """A bfloat16 tiny llama, its greedy tokens, and per position the reference's (float32
  activations) logits and the row's rounding bound."""
  config, _, state = target("llama")
  c, g, s = at_precision(config, state, "bfloat16")
  ar = generate(g, s, c, PROMPT, max_new_tokens=6, eos_ids=()).tokens
  rc, rg, rs = at_precision(c, s, "mixed")
  rows = []
  for t in range(len(ar)):
    ids = jnp.asarray([PROMPT + ar[:t]], jnp.int32)
    low, ref = (divergence._last_logits(*m, ids) for m in ((g, s, c), (rg, rs, rc)))
    rows.append((ref, 2 * float(np.abs(low - ref).max())))
  return (g, s, c), ar, rows


def test_a_near_tie_is_a_tie_and_a_wrong_token_is_a_mismatch(bf16_run):
  model, ar, rows = bf16_run
  gaps = [np.sort(ref)[-1] - np.sort(ref)[-2] for ref, _ in rows]
  t = int(np.argmin([gap / bound for gap, (_, bound) in zip(gaps, rows)]))
  ref, bound = rows[t]
  assert gaps[t] <= bound, "no near tie in this run to account for"
  runner_up, last = (int(i) for i in np.argsort(ref)[[-2, 0]])
  assert int(np.argmax(ref)) == ar[t] and 0 < bound < 1  # bf16's rounding, not noise
  tie = divergence.account(*model, PROMPT, ar, ar[:t] + [runner_up] + ar[t + 1:])
  assert (tie.position, tie.ar_token, tie.ssd_token, tie.tie) == (t, ar[t], runner_up, True)
  assert 0 <= tie.gap <= tie.bound == pytest.approx(bound)
  wrong = divergence.account(*model, PROMPT, ar, ar[:t] + [last])
  assert not wrong.tie and wrong.gap > 10 * wrong.bound
  assert divergence.account(*model, PROMPT, ar, list(ar)) is None


def test_ties_are_counted_apart_from_mismatches():
  rec = lambda matches, tie=None: {
      "method": "8bit", "prompt_id": "p", "decode_tokens": 8, "decode_s": 1.0, "rounds": 4,
      "drafted": 8, "accepted": 4, "committed": 8, "matches_ar": matches,
      **({} if tie is None else {"divergence": {"tie": tie}})}
  rows = [rec(True), rec(False, tie=True), rec(False, tie=False), rec(False)]
  row = metrics.summarize(rows)["8bit"]
  assert (row["mismatches"], row["ties"]) == (2, 1)
  assert metrics.mismatch_text(row["mismatches"], row["ties"]) == "2 (+1 tied)"
  assert metrics.mismatch_text(0, 0) == "0" and metrics.mismatch_text(None) == "not compared"
