"""Parity with HF transformers, a reference nobody here wrote.

Random-init HF models of every family (Qwen3 has no GGUF here) converted to specjax,
and (with `SPECJAX_LIVE_HF=1`) the real GGUF models loaded by both libraries from the same
file; `test_golden.py` checks the latter against their recorded outputs on every run.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import LIVE, prompt_logits, real_model  # noqa: E402
from hf_convert import config_from_hf, params_from_hf  # noqa: E402
from make_goldens import MODELS, PROMPT, load_hf  # noqa: E402

from specjax.decode.generate import generate  # noqa: E402

pytestmark = pytest.mark.reference


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.float().numpy()


def _tiny_hf(arch: str):
  common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  if arch == "llama":
    cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True)
  elif arch == "qwen2":
    cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
  elif arch == "qwen3":
    cfg = transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=True)
  else:
    cfg = transformers.Gemma3TextConfig(**common, head_dim=16, sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention"] * 2,
                                        query_pre_attn_scalar=16)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
  with torch.no_grad():  # random norms too, so the (1 + w) conventions are exercised
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_random_init_hf_models(arch):
  hf = _tiny_hf(arch)
  config, graphdef, state = params_from_hf(hf, config_from_hf(hf.config))
  ids = np.random.default_rng(0).integers(0, 101, (1, 20))  # > sliding window of 6
  ours, ref = prompt_logits(config, graphdef, state, ids), _hf_logits(hf, ids)
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


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
