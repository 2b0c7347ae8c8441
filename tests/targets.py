"""What the lossless and sampling tests run against, and the checks that keep them honest.

* `target(...)`: a trained tiny model (`specjax.models.tiny`), refused unless its greedy output
  varies (>= 8 distinct tokens in 48): against a constant target a cache, position or
  rollback bug still yields the right tokens.
* `assert_exercised(out)`: the run rejected some drafts and kept others (0 < α < 1) and,
  with `deep=True`, drafted past one token and accepted part of a long draft.
* `chi2_matches(counts, p)` and `assert_powered(p, q, n)`: a χ² goodness-of-fit test that
  fails on a sample outside the target's support, and a check that the test can see the
  three classic acceptance bugs with n samples (power from the noncentral χ²).
* `sample_rounds(one_round)`: 40 000 independent rounds from one state in one vmapped
  program, compiled with XLA's optimisations (the samples those χ² tests count), and
  `target_probs(...)`: the target's distributions they are tested against.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy import stats

from specjax.decode.generate import generate
from specjax.models.tiny import optimised, tiny_model

PROMPT = list(range(3, 40))  # long enough for SWIFT's scoring window
MIN_DISTINCT = 8  # of 48 greedy tokens


@functools.cache
def target(arch: str = "llama", layers: int = 4, vocab: int = 97, **overrides):
  """(config, graphdef, state) of a trained tiny model whose greedy output varies. Four
  layers unless asked: the depth every drafter test shares, so each family is trained once
  per suite (a 6-layer default trained four more, and its SSD loop compiled in 3.1 s
  against 2.2 s)."""
  config, graphdef, state = tiny_model(arch, num_layers=layers, vocab_size=vocab, **overrides)
  prompt = [t % vocab for t in PROMPT]
  toks = generate(graphdef, state, config, prompt, max_new_tokens=48, eos_ids=()).tokens
  assert len(set(toks)) >= MIN_DISTINCT, (
      f"tiny {arch} (L={layers}, V={vocab}) is a degenerate target: {len(set(toks))} distinct "
      f"tokens in 48 greedy tokens ({toks})")
  return config, graphdef, state


@functools.cache
def ar_tokens(arch: str = "llama", layers: int = 4, vocab: int = 97, n: int = 48,
              prompt: tuple[int, ...] = tuple(PROMPT)) -> list[int]:
  config, graphdef, state = target(arch, layers, vocab)
  return generate(graphdef, state, config, list(prompt), max_new_tokens=n, eos_ids=()).tokens


def model_of(arch: str = "llama", layers: int = 4, vocab: int = 97):
  """`target(...)` as a loaded model (name, graphdef, state, config): what drafters'
  `for_model`, the factory and the profiler take."""
  import types

  config, graphdef, state = target(arch, layers, vocab)
  return types.SimpleNamespace(name=f"tiny-{arch}", graphdef=graphdef, state=state,
                               config=config)


def assert_weights_overlay_is_lossless(overlay, arch: str, base: str) -> None:
  """A weights overlay's class (`Int8WeightsDrafter`, `Q4WeightsDrafter`) built for a tiny
  `arch` over a layer drafter (`base`: none, static, early_exit), decoded on both loops:
  AR's tokens, the same acceptance, the plan reading its weights; a layer-skipping base's
  drafts rejected in part."""
  from specjax.decode.engine import speculative_generate
  from specjax.drafters import EarlyExitDrafter, StaticDrafter
  from specjax.plan import DraftPlan

  model = model_of(arch)
  layer = {"none": None, "early_exit": EarlyExitDrafter(k=2),
           # weak enough that every tiny target rejects some of its drafts
           "static": StaticDrafter(DraftPlan.from_skips(4, [1, 2], [1, 2]))}
  drafter = overlay.for_model(model, base=layer[base])
  outs = [speculative_generate(model.graphdef, model.state, model.config, PROMPT, drafter,
                               max_new_tokens=48, gamma=4, threshold=0.0, eos_ids=(),
                               loop=loop, record_rounds=loop == "host")
          for loop in ("host", "device")]
  for out in outs:
    assert out.tokens == ar_tokens(arch)
  assert outs[0].plans[0].weight_bits == drafter.weights.bits
  if base != "none":  # alone, a quantised draft may agree with a tiny target on every token
    assert_exercised(outs[1], deep=True)
  assert outs[0].acceptance_rate == outs[1].acceptance_rate


def assert_exercised(out, *, deep: bool = False) -> None:
  """The SSD run `out` tested acceptance for real: some drafts were rejected and some kept;
  with `deep`, some round drafted >= 2 tokens and kept part (not all, not none) of them."""
  assert 0.0 < out.acceptance_rate < 1.0, f"α = {out.acceptance_rate}: nothing was tested"
  if deep:
    rounds = list(zip(out.round_drafted, out.round_accepted))
    assert any(d >= 2 for d, _ in rounds), f"no draft went past one token: {rounds}"
    assert any(0 < a < d for d, a in rounds), f"no long draft was partly accepted: {rounds}"


# --- sampling ---------------------------------------------------------------------------------

ALPHA = 1e-3  # the χ² tests' significance level
MIN_POWER = 0.99


def _cells(p: np.ndarray, n: int) -> np.ndarray:
  """Each outcome's χ² cell: alone with >= 5 expected samples, else pooled with the other
  rare ones; -1 outside the support (p = 0)."""
  keep = p * n >= 5
  return np.where(p > 0, np.where(keep, np.cumsum(keep) - 1, keep.sum()), -1)


def _pooled(x: np.ndarray, cells: np.ndarray) -> np.ndarray:
  m = cells >= 0
  return np.bincount(cells[m], weights=x[m], minlength=cells.max() + 1)


def chi2_matches(counts: np.ndarray, p: np.ndarray) -> None:
  """counts ~ Multinomial(n, p), by Pearson's χ² at level ALPHA; no sample may fall where
  p is 0 (a top-p or shortlist bug would land there)."""
  counts, p = np.asarray(counts, np.float64), np.asarray(p, np.float64)
  p = p / p.sum()
  outside = counts[p == 0].sum()
  assert outside == 0, f"{int(outside)} samples outside the target's support"
  cells = _cells(p, counts.sum())
  obs, exp = _pooled(counts, cells), _pooled(p, cells) * counts.sum()
  if len(obs) == 1:  # a certain outcome: the support check above was the whole test
    return
  assert stats.chisquare(obs, exp).pvalue > ALPHA, (obs, exp)


def chi2_power(p: np.ndarray, r: np.ndarray, n: int) -> float:
  """Power of `chi2_matches(·, p)` with n samples drawn from r instead."""
  p, r = np.asarray(p, np.float64) / np.sum(p), np.asarray(r, np.float64) / np.sum(r)
  if (r[p == 0] > 0).any():  # the support check alone catches it, almost surely
    return 1.0 - (1.0 - r[p == 0].sum()) ** n
  cells = _cells(p, n)
  pp, rr = _pooled(p, cells), _pooled(r, cells)
  df = len(pp) - 1
  lam = n * np.sum((rr - pp) ** 2 / pp)
  return float(stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, lam))


def bug_distributions(p: np.ndarray, q: np.ndarray) -> dict[str, np.ndarray]:
  """The first committed token's distribution under the three classic bugs, for a draft
  with distribution q against a target p (correct: p itself)."""
  overlap = np.minimum(p, q)
  beta = overlap.sum()  # probability the first draft is accepted
  return {
      "accept every draft": q,
      "correction token from p": overlap + (1 - beta) * p,
      "correction token from q": overlap + (1 - beta) * q,
  }


def assert_powered(p: np.ndarray, q: np.ndarray, n: int) -> dict[str, float]:
  """The χ² test on n first tokens detects each classic bug with power >= MIN_POWER."""
  power = {bug: chi2_power(p, r, n) for bug, r in bug_distributions(p, q).items()}
  weak = {b: w for b, w in power.items() if w < MIN_POWER}
  tv = 0.5 * np.abs(p - q).sum()
  assert not weak, f"the χ² test is too weak here (TV(p, q) = {tv:.3f}): {weak}"
  return power


def assert_round_distribution(out, p_first, q_first, p_after, *, gamma: int) -> dict:
  """Rounds `out` (a RoundOut batched over independent keys, one state) keep the target:
  the first committed token ~ p_first, and the second (rounds committing two) ~
  p_after(first) for the most frequent first token. `q_first` is the draft's distribution
  at the first position: the test must be able to tell it (and the bugs) from p."""
  tokens, n_commit = np.asarray(out.tokens), np.asarray(out.n_commit)
  n, V = len(tokens), len(p_first)
  power = assert_powered(p_first, q_first, n)
  counts = np.bincount(tokens[:, 0], minlength=V)
  chi2_matches(counts, p_first)
  top = int(np.argmax(counts))
  second = tokens[(tokens[:, 0] == top) & (n_commit >= 2)][:, 1]
  assert len(second) >= 1000, "too few rounds commit two tokens to test the second"
  chi2_matches(np.bincount(second, minlength=V), p_after(top))
  assert 0.0 < float(np.mean(n_commit - 1)) < gamma  # drafts were both kept and rejected
  return power


def sample_rounds(one_round, rounds: int = 40_000, seed: int = 1):
  """`one_round(key)` for `rounds` independent keys, vmapped into one program. Compiled with
  XLA's optimisations (the suite turns most of them off: its programs are small and run
  once), as this one runs 40 000 rounds: a DynaSpec test's took 4.0 s optimised, 16-18 s
  not."""
  import jax

  with optimised():
    run = jax.jit(jax.vmap(one_round))
    return jax.block_until_ready(run(jax.random.split(jax.random.key(seed), rounds)))


def target_probs(state, graphdef, config, cache, sampling):
  """p(tokens): the target's sampling distribution after `tokens` read from `cache` (float64
  numpy), one jitted forward per length of `tokens` rather than op by op."""
  import jax
  import jax.numpy as jnp

  from specjax.decode.generate import positions_for
  from specjax.model import apply
  from specjax.plan import DraftPlan
  from specjax.sampling import probs

  full = DraftPlan.full(config.num_layers)

  @jax.jit
  def next_probs(tokens):
    o, _ = apply(state, cache, tokens[None], positions_for(cache, len(tokens), 1), full,
                 graphdef=graphdef, write_cache=False)
    return probs(o.logits[0, -1], sampling)

  return lambda tokens: np.asarray(next_probs(jnp.asarray(tokens, jnp.int32)), np.float64)


def assert_plan_keeps_the_target_distribution(state, graphdef, config, cache, first, plan,
                                              sampling, *, target_cache=None, vocab: int,
                                              gamma: int = 3, rounds: int = 40_000) -> dict:
  """Sample `rounds` rounds drafted under `plan` from one state (`cache` after a prefill
  that sampled `first`) and check them with `assert_round_distribution` against the
  target as verification reads it (`target_cache`, default `cache`)."""
  import jax
  import jax.numpy as jnp

  from specjax.decode.round import draft_step, round_fn

  out = sample_rounds(lambda k: round_fn(
      state, cache, first, plan, k, graphdef=graphdef, vocab=vocab, gamma=gamma,
      threshold=0.0, sampling=sampling)[0], rounds)
  p = target_probs(state, graphdef, config, cache if target_cache is None else target_cache,
                   sampling)
  q1 = draft_step(state, cache, first, plan, jax.random.key(2), jnp.int32(1),
                  graphdef=graphdef, vocab=vocab, gamma=1,
                  threshold=0.0, sampling=sampling).q_rows[0]
  f = int(first)
  return assert_round_distribution(out, p([f]), np.asarray(q1, np.float64),
                                   lambda t: p([f, t]), gamma=gamma)


def assert_quantised_draft_keeps_the_target_distribution(quantize) -> dict:
  """Rounds drafted from `quantize(state, L)`'s weights (a `quant.DraftWeights`):
  `assert_skip_draft_keeps_the_target_distribution`."""
  return assert_skip_draft_keeps_the_target_distribution(
      lambda state, L, cache: {"weights": quantize(state, L)})


# The prompt the skip draft's sampled rounds follow (tiny llama, vocabulary 12).
SAMPLED_PROMPT = [9, 8, 10, 4, 3, 11, 9, 5, 8, 3, 5, 8, 10, 4, 6, 3, 8, 11, 7, 10, 3, 9, 8, 10, 4,
                  3, 11, 9, 5, 8]


def assert_skip_draft_keeps_the_target_distribution(fields) -> dict:
  """Rounds drafted over a plan that skips layer 1 (so q is far enough from p for the χ²
  test to see each classic acceptance bug), with the plan fields `fields(state, L, cache)`
  set (quantised weights, a sparse KV window, slots selected from the prefilled `cache`),
  verified by the float32 target: the first committed token ~ p, the second ~ p(. | first).
  """
  import jax
  import jax.numpy as jnp

  from specjax.decode.generate import prefill_step
  from specjax.kv_cache import KVCache
  from specjax.plan import DraftPlan
  from specjax.sampling import SamplingParams

  config, graphdef, state = target("llama", 4, 12)
  L, sampling = config.num_layers, SamplingParams(temperature=2.0, top_p=1.0)
  prompt = jnp.asarray([SAMPLED_PROMPT], jnp.int32)
  cache = KVCache.create(config, 1, 64)
  first, cache = prefill_step(state, cache, prompt, jnp.int32(len(SAMPLED_PROMPT)),
                              DraftPlan.full(L),
                              jax.random.key(0), graphdef=graphdef, sampling=sampling)
  plan = DraftPlan.from_skips(L, [1], [1]).replace(**fields(state, L, cache))
  return assert_plan_keeps_the_target_distribution(state, graphdef, config, cache, first[0],
                                                   plan, sampling, vocab=12)
