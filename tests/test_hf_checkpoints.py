"""Hugging Face checkpoints: each family's folder (two safetensors shards and their index)
loads by path and by hub id from a hub cache (`HF_HUB_OFFLINE=1`) as the model it was
written from, greedy SSD equals greedy AR on two of them for a layer drafter, `8bit` and
`quantspec`, bfloat16 stays bfloat16 on the way in, and bad input is refused by name
with nothing cached. The folders are the trained tiny models exported to HF's names and
layouts (`hf_folders.export`); `test_hf_transformers.py` checks the same loader against
checkpoints and tokenizers written by transformers itself."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import prompt_logits
from hf_folders import export, hf_config_of, hub_layout, word_tokenizer, write_checkpoint
from targets import PROMPT, assert_exercised, target

from specjax.config import RopeScaling
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.models.hf_config import UnsupportedArchitectureError, config_from_hf
from specjax.models.loader import load_model
from specjax.models.registry import UnknownModelError
from specjax.models.safetensors_file import CheckpointFolderError
from specjax.models.source import HubError, artefact_key

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<s> w3 {% endif %}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
  """arch -> the folder of its trained tiny model, exported in float32."""
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for arch in ARCHS:
    config, _, state = target(arch)
    folder = write_checkpoint(root / f"tiny-{arch}", hf_config_of(config),
                              export(config, state), generation={"eos_token_id": [2]})
    word_tokenizer(folder, config.vocab_size, TEMPLATE)
    out[arch] = folder
  return out


def _logits(model, ids):
  return prompt_logits(model.config, model.graphdef, model.state, ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_folder_loads_as_the_model_it_was_written_from(folders, arch):
  config, graphdef, state = target(arch)
  m = load_model(folders[arch], verbose=False)
  assert m.name == f"tiny-{arch}" and m.source.kind == "folder"
  assert m.config.scale == config.scale  # gemma3's from query_pre_attn_scalar
  assert m.config == dataclasses.replace(config, rope_interleaved=False,
                                         query_scale=m.config.query_scale)
  ids = np.random.default_rng(0).integers(3, config.vocab_size, (2, 21))  # past gemma's window
  # llama's rotary pairs are reordered on export: the same dot products, other roundings
  np.testing.assert_allclose(_logits(m, ids), prompt_logits(config, graphdef, state, ids),
                             atol=1e-4 if arch == "llama" else 0, rtol=0)
  assert m.tokenizer.encode("w5 w6") == [1, 5, 6]  # the post-processor's <s>
  assert m.tokenizer.encode_chat([{"role": "w4", "content": "w7"}]) == [1, 4, 7, 2, 1, 3]


def test_a_hub_id_loads_from_the_hub_cache_offline(folders, tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.delenv("HF_HUB_CACHE", raising=False)
  snapshot = hub_layout(tmp_path / "hf" / "hub", "specjax-test/tiny-qwen3", folders["qwen3"])
  m = load_model("specjax-test/tiny-qwen3", verbose=False)
  assert m.name == "specjax-test/tiny-qwen3" and m.source.path == snapshot
  direct = load_model(folders["qwen3"], verbose=False)
  ids = np.arange(3, 23)[None]
  np.testing.assert_array_equal(_logits(m, ids), _logits(direct, ids))
  # its artefacts are keyed by the hub's content hashes, apart from the folder's
  assert artefact_key(m).startswith("specjax-test--tiny-qwen3-") and m.key != direct.key
  with pytest.raises(HubError, match=r"specjax-test/absent is not in the hub cache at .*"
                                     r"HF_HUB_OFFLINE is set"):
    load_model("specjax-test/absent")
  assert not (tmp_path / "hf" / "hub" / "models--specjax-test--absent" / "snapshots").exists()


# Every family's folder loads as the model it was written from (the test above); decoding
# a loaded model adds what the loader hands the drafters (config, eos ids, dtype, the head
# they quantise): two families, qwen2 (an untied head, biases) and gemma3 (a scaled tied
# embedding, sliding windows).
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_greedy_ssd_equals_ar_on_a_loaded_folder(folders, arch):
  """A layer drafter, 8-bit draft weights and QuantSpec (its 8-bit KV cache is the
  target's, so its reference is AR on that cache) on the loaded model."""
  from specjax.drafters import Int8WeightsDrafter, QuantSpecDrafter, StaticDrafter
  from specjax.plan import DraftPlan
  from specjax.quant_kv_cache import QuantKV

  m = load_model(folders[arch], verbose=False)
  L = m.config.num_layers
  layer = StaticDrafter(DraftPlan.from_skips(L, [1, 2], [1, 2]))
  kv = QuantKV(group=8, residual=16)
  drafters = {"static": layer, "8bit": Int8WeightsDrafter.for_model(m, base=layer),
              "quantspec": QuantSpecDrafter.for_model(m, base=layer, weight_group=32,
                                                      kv_cache=kv)}
  ar = generate(m.graphdef, m.state, m.config, PROMPT, max_new_tokens=40, eos_ids=()).tokens
  ar_q = generate(m.graphdef, m.state, m.config, PROMPT, max_new_tokens=40, eos_ids=(),
                  kv_cache=kv).tokens
  for name, d in drafters.items():
    out = speculative_generate(m.graphdef, m.state, m.config, PROMPT, d, max_new_tokens=40,
                               eos_ids=(), gamma=4, threshold=0.0)
    assert out.tokens == (ar_q if name == "quantspec" else ar), name
    assert_exercised(out, deep=True)


def test_bfloat16_weights_load_as_bfloat16_without_a_float32_detour(folders, tmp_path):
  config, _, state = target("qwen2")
  tensors = export(config, state, ml_dtypes.bfloat16)
  folder = write_checkpoint(tmp_path / "bf16", hf_config_of(config), tensors, shards=3)
  word_tokenizer(folder, config.vocab_size)
  m = load_model(folder, dtype="bfloat16", verbose=False)
  assert {x.dtype for x in jax.tree.leaves(m.state)} == {np.dtype(ml_dtypes.bfloat16)}
  emb = np.asarray(m.state["embedding"].get_value())
  np.testing.assert_array_equal(emb, tensors["model.embed_tokens.weight"])
  f32 = load_model(folder, dtype="float32", verbose=False)
  np.testing.assert_array_equal(np.asarray(f32.state["embedding"].get_value()),
                                tensors["model.embed_tokens.weight"].astype(np.float32))


def _copy(folder, tmp_path, name="copy"):
  out = tmp_path / name
  shutil.copytree(folder, out)
  return out


def _edit_config(folder, **changes):
  cfg = json.loads((folder / "config.json").read_text())
  cfg.update(changes)
  (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]},
     r"model_type 'phi3' \(Phi3ForCausalLM\) is not supported\. Supported: Llama"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling = .*yarn.* \(specjax computes none \(default\), linear or llama3\)"),
    ({"attention_bias": True}, r"llama with attention_bias = True is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act = 'gelu'"),
    ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping = 30.0"),
])
def test_an_unsupported_architecture_or_setting_is_refused_by_name(folders, tmp_path, changes,
                                                                   message):
  folder = _copy(folders["llama"], tmp_path)
  _edit_config(folder, **changes)
  with pytest.raises(UnsupportedArchitectureError, match=message):
    load_model(folder, verbose=False)


def test_a_missing_shard_or_a_misshapen_tensor_is_named(folders, tmp_path):
  folder = _copy(folders["qwen2"], tmp_path)
  (folder / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(CheckpointFolderError,
                     match=r"shard model-00002-of-00002.safetensors \(of 2 the index lists\) "
                           r"is missing"):
    load_model(folder, verbose=False)
  folder = _copy(folders["qwen2"], tmp_path, "shape")
  _edit_config(folder, intermediate_size=96)  # the tensors are 128 wide
  with pytest.raises(CheckpointFolderError,
                     match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \[128, 64\]; "
                           r"config.json says \[96, 64\]"):
    load_model(folder, verbose=False)


def test_a_truncated_shard_is_refused_before_any_read(folders, tmp_path):
  folder = _copy(folders["gemma3"], tmp_path)
  shard = folder / "model-00001-of-00002.safetensors"
  shard.write_bytes(shard.read_bytes()[:-100])
  with pytest.raises(CheckpointFolderError, match="truncated or damaged"):
    load_model(folder, verbose=False)


def test_what_is_not_a_model_says_what_model_takes(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(UnknownModelError, match="folder without config.json"):
    load_model(tmp_path / "empty")
  with pytest.raises(UnknownModelError, match="a hub id org/name"):
    load_model("not-a-model")
  with pytest.raises(UnknownModelError, match="no GGUF file at"):
    load_model(tmp_path / "absent.gguf")


def test_an_unsupported_gguf_architecture_is_refused_and_nothing_cached(tmp_path,
                                                                       monkeypatch):
  import gguf

  from specjax.models.gguf import GGUFFormatError

  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  path = tmp_path / "phi.gguf"
  writer = gguf.GGUFWriter(str(path), "phi3")
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(GGUFFormatError, match=r"architecture 'phi3' is not one of"):
    load_model(path, verbose=False)
  assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_two_checkpoints_of_one_shape_keep_their_artefacts_apart(folders, tmp_path):
  """Same config, other weights (a fine-tune): another key; the same files: the same."""
  folder = _copy(folders["llama"], tmp_path)
  shard = folder / "model-00002-of-00002.safetensors"
  raw = bytearray(shard.read_bytes())
  raw[-4:] = np.float32(0.5).tobytes()  # the last weight of the last tensor
  shard.write_bytes(bytes(raw))
  a, b = load_model(folders["llama"], verbose=False), load_model(folder, verbose=False)
  assert a.name == "tiny-llama" and b.name == "copy"
  assert a.key != load_model(_copy(folder, tmp_path, "tiny-llama"), verbose=False).key
  assert a.key == load_model(folders["llama"], verbose=False).key


def test_rope_configs_of_both_layouts_read_alike():
  """The hub's `rope_theta` + `rope_scaling` and transformers 5's `rope_parameters`."""
  base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 100}
  scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
  old = config_from_hf({**base, "rope_theta": 5e5,
                        "rope_scaling": {"rope_type": "llama3", **scaling}})
  new = config_from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                                    **scaling}})
  assert old == new and old.rope_base == 5e5
  assert old.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
  gemma = {**base, "model_type": "gemma3_text", "sliding_window": 4, "head_dim": 16,
           "query_pre_attn_scalar": 16}
  g_old = config_from_hf({**gemma, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                          "sliding_window_pattern": 2,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
  g_new = config_from_hf({**gemma, "layer_types": ["sliding_attention", "full_attention"],
                          "rope_parameters": {
                              "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                 "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 1e4}}})
  assert g_old == g_new and g_old.global_every == 2
  assert g_old.layer_rope_scaling(0) is None and g_old.layer_rope_scaling(1).factor == 8.0
  assert (g_old.layer_rope_base(0), g_old.layer_rope_base(1)) == (1e4, 1e6)


def test_llama3_rope_scaling_keeps_fast_frequencies_and_divides_slow_ones():
  s = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position=8192)
  inv = 1.0 / (5e5 ** (np.arange(0, 128, 2) / 128))
  out = s.apply(inv)
  wavelength = 2 * np.pi / inv
  fast, slow = wavelength < 8192 / 4, wavelength > 8192
  np.testing.assert_array_equal(out[fast], inv[fast])
  np.testing.assert_allclose(out[slow], inv[slow] / 8)
  mid = ~fast & ~slow
  assert mid.any() and np.all((out[mid] < inv[mid]) & (out[mid] > inv[mid] / 8))
  np.testing.assert_allclose(RopeScaling("linear", 4.0).apply(inv), inv / 4)


def _split_copy(src, out_dir, parts: int):
  """`src` rewritten by gguf-py's writer as llama.cpp's split set of `parts` files."""
  import gguf

  reader = gguf.GGUFReader(src)
  arch = reader.fields["general.architecture"].contents()
  n = len(reader.tensors)
  writer = gguf.GGUFWriter(str(out_dir / "model.gguf"), arch,
                           split_max_tensors=-(-n // parts))
  for name, field in reader.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture":
      continue
    kind = field.types[0]
    sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(name, field.contents(), kind, sub_type=sub)
  for t in reader.tensors:
    writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return sorted(out_dir.glob("model-*-of-*.gguf"))


@pytest.mark.real
def test_a_split_gguf_set_loads_as_its_whole_file(tmp_path, monkeypatch):
  """SmolLM2's file as a split set of three (llama.cpp's layout) decodes the registered
  model's greedy tokens; a set missing a file, or given from its second file, is refused."""
  from conftest import real_model

  from specjax.models.gguf import GGUFFormatError
  from specjax.models.registry import get_spec

  whole = real_model("smollm2-135m-instruct")
  files = _split_copy(get_spec(whole.name).locate(), tmp_path, 3)
  assert [f.name for f in files] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  split = load_model(files[0], verbose=False)
  assert split.name == "model" and split.config == whole.config
  ids = whole.tokenizer.encode_prompt("Name three primary colours.")
  run = lambda m: generate(m.graphdef, m.state, m.config, ids, max_new_tokens=12).tokens
  assert run(split) == run(whole)
  with pytest.raises(UnknownModelError, match="pass its first file, model-00001-of-00003"):
    load_model(files[1])
  files[2].unlink()
  with pytest.raises(GGUFFormatError, match="split file model-00003-of-00003.gguf of 3 is "
                                            "missing"):
    load_model(files[0])


def test_the_cli_takes_a_folder_and_says_what_model_takes(folders, capsys):
  from specjax.cli import main

  assert main(["models"]) == 0
  out = capsys.readouterr().out
  assert "--model takes a registered name" in out and "a hub id org/name" in out
  assert "Qwen3 (qwen3)" in out
  assert main(["generate", "--model", str(folders["qwen3"]), "--prompt", "w5 w6",
               "--max-new-tokens", "6", "--no-chat", "--quiet", "--json",
               "--drafter", "early_exit"]) == 0
  stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert stats["model"] == "tiny-qwen3" and stats["matches_ar"] is True
