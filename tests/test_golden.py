"""The real GGUF models against HF transformers' recorded outputs (`tests/golden/`, written
by `tests/make_goldens.py` from the same files): logits, greedy tokens, tokenizer and chat
template. The live comparisons, which load each GGUF through transformers, run with
`SPECJAX_LIVE_HF=1` (`test_parity_hf.py`, `test_weights.py`)."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from conftest import prompt_logits, real_model
from make_goldens import GOLDEN, MODELS, sha256

from specjax.decode.generate import generate
from specjax.models.registry import get_spec, is_installed

pytestmark = pytest.mark.real


@functools.cache
def golden(name: str) -> tuple[dict, dict]:
  """(arrays, meta) of `name`'s golden; fails unless it was recorded from the installed
  GGUF file."""
  npz, meta_file = GOLDEN / f"{name}.npz", GOLDEN / f"{name}.json"
  if not npz.exists():
    pytest.fail(f"no golden for {name}: record it with `python tests/make_goldens.py "
                f"--models {name}`")
  meta = json.loads(meta_file.read_text())
  gguf = get_spec(name).locate()
  if sha256(gguf) != meta["gguf_sha256"]:
    pytest.fail(f"{gguf} is not the file {name}'s golden was recorded from "
                f"({meta['install']}); rerun `python tests/make_goldens.py --models {name}`")
  with np.load(npz) as f:
    return dict(f), meta


@pytest.fixture(scope="module", params=MODELS)
def model(request):
  """Each real model, loaded once for the module's tests (one in memory at a time)."""
  return real_model(request.param)


def test_logits_and_greedy_tokens_match_transformers(model):
  """Every recorded logit within 1e-3 of the position's largest |logit|, the same
  full-vocabulary argmax and log-sum-exp, and transformers' 32 greedy tokens."""
  ref, _ = golden(model.name)
  ids = ref["prompt_ids"]
  mine = prompt_logits(model.config, model.graphdef, model.state, ids[None])[0]
  tol = 1e-3 * ref["scale"][:, None]
  top = np.take_along_axis(mine, ref["top_ids"], -1)
  assert np.all(np.abs(top - ref["top_logits"]) < tol), np.abs(top - ref["top_logits"]).max()
  sampled = mine[:, ref["sampled_ids"]]
  assert np.all(np.abs(sampled - ref["sampled_logits"]) < tol)
  np.testing.assert_array_equal(mine.argmax(-1), ref["argmax"])
  m = mine.max(-1, keepdims=True)
  lse = m[:, 0] + np.log(np.exp(mine - m).sum(-1))
  assert np.all(np.abs(lse - ref["lse"]) < tol[:, 0])

  gen = generate(model.graphdef, model.state, model.config, ids.tolist(),
                 max_new_tokens=len(ref["greedy"]), eos_ids=())
  assert gen.tokens == ref["greedy"].tolist()


def test_tokenizer_and_chat_template_match_transformers(model):
  tok = model.tokenizer
  _, meta = golden(model.name)
  rec = meta["tokenizer"]
  for text, ids in zip(rec["texts"], rec["ids"], strict=True):
    assert tok.encode(text, add_bos=False) == ids, text
    assert tok.decode(ids) == text
  if tok.is_chat:
    assert tok.render_chat(rec["chat"]) == rec["chat_rendered"]


def test_a_golden_of_another_gguf_file_is_refused(monkeypatch):
  """Another file's golden fails the test and names the command that rerecords it."""
  name = MODELS[0]
  if not is_installed(get_spec(name)):
    pytest.skip(f"{name} weights package not installed")
  monkeypatch.setitem(globals(), "sha256", lambda path: "0" * 64)
  golden.cache_clear()
  try:
    with pytest.raises(pytest.fail.Exception, match=f"make_goldens.py --models {name}"):
      golden(name)
  finally:
    golden.cache_clear()
