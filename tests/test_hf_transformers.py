"""Hugging Face checkpoints written by transformers itself, a writer nobody here wrote:
for each family a random model (random norms too) saved with `save_pretrained` in two or
more safetensors shards, beside a real model's tokenizer and chat template saved by
`AutoTokenizer.save_pretrained`. specjax loads the folder (and llama's as a hub id from a
hub cache too, `HF_HUB_OFFLINE=1`): float32 logits within 1e-4 of transformers' on
the same folder, chat-template ids equal to `apply_chat_template`'s, and greedy SSD equal
to greedy AR for a layer drafter, `8bit` and `quantspec` (the trained tiny models'
folders, in `test_hf_checkpoints.py`, also check that those drafts were partly
accepted: a random model's are not a test of acceptance). Runs where torch
is installed (`make test` runs it in the compatibility venv)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import prompt_logits  # noqa: E402
from hf_folders import hub_layout  # noqa: E402

from specjax.models.loader import load_model  # noqa: E402

# `reference` alone, not `real`: the models are random and tiny (hidden 64), so their programs
# compile with XLA's optimisations off as the tiny models' do (optimised, the five checkpoint
# tests took 119 s in one process on the compatibility venv instead of 66 s, 2026-12-07).
pytestmark = pytest.mark.reference

# family -> (transformers config class, the registered model whose tokenizer it gets)
FAMILIES = {
    "llama": ("LlamaConfig", "smollm2-135m-instruct"),
    "mistral": ("MistralConfig", "smollm2-135m-instruct"),
    "qwen2": ("Qwen2Config", "qwen2.5-coder-0.5b-instruct"),
    "qwen3": ("Qwen3Config", "qwen2.5-coder-0.5b-instruct"),
    "gemma3": ("Gemma3TextConfig", "gemma3-270m"),
}
VOCAB = 1024
CHATS = [[{"role": "user", "content": "Write a haiku about the sea."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "Hello! 你好"}, {"role": "user", "content": "2+2?"}]]


@functools.cache
def _tokenizer_folder(name: str, root) -> object:
  """A registered model's tokenizer (from its GGUF) and chat template, saved as
  transformers saves a tokenizer: tokenizer.json, tokenizer_config.json (and, in
  transformers 5, chat_template.jinja)."""
  from specjax.models.gguf import open_gguf
  from specjax.models.registry import get_spec, is_installed
  from specjax.models.tokenizer import tokenizer_from_gguf

  if not is_installed(get_spec(name)):
    pytest.skip(f"{name} weights package not installed ({get_spec(name).install})")
  ours = tokenizer_from_gguf(open_gguf(get_spec(name).locate()))  # no weights loaded
  folder = root / f"tok-{name}"
  ours.save(folder)  # tokenizer.json
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(folder / "tokenizer.json"), chat_template=ours.chat_template,
      **ours.special)
  tok.save_pretrained(folder)
  return folder


def _config(family: str, vocab: int, **extra):
  common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  cls = getattr(transformers, FAMILIES[family][0])
  if family == "llama":
    return cls(**common, tie_word_embeddings=True, **extra)
  if family == "mistral":
    return cls(**common, sliding_window=7, tie_word_embeddings=False, **extra)
  if family == "qwen2":
    return cls(**common, tie_word_embeddings=False, **extra)
  if family == "qwen3":
    return cls(**common, head_dim=24, tie_word_embeddings=True, **extra)
  return cls(**common, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
             layer_types=["sliding_attention", "full_attention"] * 2, **extra)


def _checkpoint(tmp_path, family: str, **extra):
  """(folder, transformers model) of a random `family` model saved in shards."""
  tok_folder = _tokenizer_folder(FAMILIES[family][1], tmp_path.parent)
  torch.manual_seed(0)
  # The model's vocabulary is the tokenizer's first VOCAB ids: the chat checks only
  # encode, and a 262k-row head would cost every forward here for nothing.
  model = transformers.AutoModelForCausalLM.from_config(_config(family, VOCAB, **extra))
  model = model.float().eval()
  with torch.no_grad():  # random norms too, so the (1 + w) conventions are exercised
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  folder = tmp_path / f"random-{family}"
  total = sum(p.numel() * 4 for p in model.parameters())
  model.save_pretrained(folder, max_shard_size=total // 2 + 1)
  transformers.AutoTokenizer.from_pretrained(tok_folder).save_pretrained(folder)
  assert len(list(folder.glob("*.safetensors"))) >= 2
  assert (folder / "model.safetensors.index.json").exists()
  return folder, model


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_transformers_checkpoint_loads_by_folder_and_hub_id(family, tmp_path, monkeypatch):
  folder, hf = _checkpoint(tmp_path, family)
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.delenv("HF_HUB_CACHE", raising=False)
  hub_layout(tmp_path / "hf" / "hub", f"specjax-test/random-{family}", folder)
  ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (1, 20))  # past windows
  ref = _hf_logits(hf, ids)
  hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
  # one family by hub id too: the same loader behind a snapshot (every family's folder
  # path is the hub's; `test_hf_checkpoints.py` loads each family by hub id as well)
  sources = (folder, f"specjax-test/random-{family}") if family == "llama" else (folder,)
  for source in sources:
    m = load_model(source, dtype="float32", verbose=False)
    np.testing.assert_allclose(prompt_logits(m.config, m.graphdef, m.state, ids), ref,
                               atol=1e-4, rtol=1e-4)
    assert m.tokenizer.is_chat == (hf_tok.chat_template is not None)  # gemma3-270m: base
    for chat in CHATS if m.tokenizer.is_chat else ():
      want = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
      want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
      assert m.tokenizer.encode_chat(chat) == list(want), (source, chat)
    text = "The capital of France is"
    assert m.tokenizer.encode(text) == hf_tok(text).input_ids
  _assert_lossless(m)


def _assert_lossless(m) -> None:
  """Greedy SSD == greedy AR on the loaded checkpoint for a layer drafter, 8-bit draft
  weights and QuantSpec (against AR on its 8-bit KV cache)."""
  from specjax.decode.engine import speculative_generate
  from specjax.decode.generate import generate
  from specjax.drafters import Int8WeightsDrafter, QuantSpecDrafter, StaticDrafter
  from specjax.plan import DraftPlan
  from specjax.quant_kv_cache import QuantKV

  prompt = list(range(10, 40))
  layer = StaticDrafter(DraftPlan.from_skips(m.config.num_layers, [1, 2], [2]))
  kv = QuantKV(group=8, residual=16)
  run = lambda **kw: generate(m.graphdef, m.state, m.config, prompt, max_new_tokens=16,
                              eos_ids=(), **kw).tokens
  ar, ar_q = run(), run(kv_cache=kv)
  for d, want in ((layer, ar), (Int8WeightsDrafter.for_model(m, base=layer), ar),
                  (QuantSpecDrafter.for_model(m, base=layer, weight_group=32, kv_cache=kv),
                   ar_q)):
    out = speculative_generate(m.graphdef, m.state, m.config, prompt, d, max_new_tokens=16,
                               eos_ids=(), gamma=4, threshold=0.0)
    assert out.tokens == want, d.name


@pytest.mark.parametrize("family, scaling", [
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ("llama", {"rope_type": "linear", "factor": 4.0}),
    ("gemma3", {"rope_type": "linear", "factor": 8.0}),
], ids=["llama3", "linear", "gemma3-linear"])
def test_rope_scaling_computes_transformers_angles(family, scaling, tmp_path):
  """Llama 3.1's frequency blend (an original context of 64 puts most frequencies in the
  scaled or blended bands) and linear scaling, Gemma 3's on its global layers only."""
  if family == "gemma3":
    extra = {"rope_parameters": {"full_attention": {**scaling, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 1e4}}}
  else:
    extra = {"rope_parameters": {**scaling, "rope_theta": 5e5}}
  folder, hf = _checkpoint(tmp_path, family, **extra)
  m = load_model(folder, dtype="float32", verbose=False)
  assert m.config.rope_scaling is not None
  ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, (1, 48))
  np.testing.assert_allclose(prompt_logits(m.config, m.graphdef, m.state, ids),
                             _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
