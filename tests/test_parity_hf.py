"""Parity with HF transformers, a reference nobody here wrote.

With `SPECJAX_LIVE_HF=1`, the real GGUF models loaded by both libraries from the same
file; `test_golden.py` checks them against their recorded outputs on every run. Random
models of every family written by transformers are `test_hf_transformers.py`'s.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import LIVE, prompt_logits, real_model  # noqa: E402
from make_goldens import MODELS, PROMPT, load_hf  # noqa: E402

from specjax.decode.generate import generate  # noqa: E402

pytestmark = pytest.mark.reference


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.real
@LIVE
@pytest.mark.parametrize("name", MODELS)
def test_real_model_matches_transformers(name):
  from specjax.models.registry import get_spec

  ours = real_model(name)
  hf, _ = load_hf(get_spec(name).locate())
  ids = np.asarray([ours.tokenizer.encode(PROMPT)])
  mine, ref = prompt_logits(ours.config, ours.graphdef, ours.state, ids), _hf_logits(hf, ids)
  scale = np.abs(ref).max()
  assert np.abs(mine - ref).max() < 1e-3 * scale, np.abs(mine - ref).max()
  np.testing.assert_array_equal(mine.argmax(-1), ref.argmax(-1))

  gen = generate(ours.graphdef, ours.state, ours.config, ids[0].tolist(),
                 max_new_tokens=32, eos_ids=())
  with torch.no_grad():
    hf_out = hf.generate(torch.tensor(ids), max_new_tokens=32, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
  assert gen.tokens == hf_out[0, ids.shape[1]:].tolist()
