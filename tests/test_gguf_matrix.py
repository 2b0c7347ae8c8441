"""`--dtype gguf`: a target reading its GGUF file's blocks through `cpu_kernels.gguf_matmul`.

The kernel's weights are gguf-py's, bit for bit, for every type it reads; a row's product
does not depend on the rows beside it; a tiny model in blocks decodes losslessly with
layer-skipping and 8-bit drafts; SmolLM2's real blocks give the float32 model's logits
up to rounding, and its verification rows equal its AR steps bit for bit."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ARCHS
from flax import nnx

from specjax import cpu_kernels
from specjax.config import tiny_config
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.drafters import (
  ClaspDrafter,
  FRSpecDrafter,
  Int8WeightsDrafter,
  KnapSpecDrafter,
  Q4WeightsDrafter,
  StaticDrafter,
)
from specjax.errors import ConfigError
from specjax.gguf_matrix import KINDS, GGUFMatrix, GGUFMatrixError
from specjax.model import init_model
from specjax.models.loader import at_precision, quantized_blocks, with_values
from specjax.plan import DraftPlan

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or cpu_kernels.kernel_status("gguf_matmul") != "ready",
    reason="the gguf_matmul kernel runs on a CPU backend with a C++ compiler")


def _random_blocks(kind: int, rows: int, inputs: int, seed: int = 0) -> np.ndarray:
  """Rows of random blocks of ggml type `kind`: every code pattern, with each float16
  scale (and minimum) a finite value of either sign, so the weights are finite."""
  weights, nbytes = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
  rng = np.random.default_rng(seed)
  blocks = rng.integers(0, 256, (rows * inputs // weights, nbytes), dtype=np.uint8)
  halves = {2: [0], 3: [0, 2], 6: [0], 8: [0], 12: [0, 2], 14: [208]}[kind]
  for at in halves:
    scale = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
    blocks[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
  return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_kernel_weights_are_gguf_py_bit_for_bit(name):
  kind = KINDS[name]
  blocks = _random_blocks(kind, rows=40, inputs=512)
  want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(kind)).astype(np.float32)
  got = np.asarray(cpu_kernels.gguf_dequantize(jnp.asarray(blocks), kind))
  assert got.shape == want.shape == (40, 512)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", sorted(KINDS))
def test_kernel_rows_do_not_depend_on_their_neighbours(name):
  """Products against float64 numpy, within float32 rounding of the sums of |x·w|; each
  row of an 11-row call (more than one tile of the kernel's 9, whose weight rows it reads
  one at a time, where one row reads them two at a time) equal, bit for bit, to the same
  row alone; 71 outputs, so one weight row has no partner."""
  kind = KINDS[name]
  blocks = jnp.asarray(_random_blocks(kind, rows=71, inputs=768, seed=1))
  w = gguf.quants.dequantize(np.asarray(blocks), gguf.GGMLQuantizationType(kind))
  x = np.random.default_rng(2).standard_normal((11, 768)).astype(np.float32)
  many = np.asarray(cpu_kernels.gguf_matmul(jnp.asarray(x), blocks, kind))
  magnitude = np.abs(x).astype(np.float64) @ np.abs(w).T
  assert np.all(np.abs(many - x.astype(np.float64) @ w.T) <= 1e-6 * magnitude + 1e-30)
  for r in (0, 5, 10):
    alone = np.asarray(cpu_kernels.gguf_matmul(jnp.asarray(x[r:r + 1]), blocks, kind))
    np.testing.assert_array_equal(alone[0], many[r])


def test_matrix_parts_and_their_errors():
  """q|k|v of two types: the outputs of each part in order, rows gathered from one part;
  a type the kernel does not read and parts of different widths are refused."""
  q8 = _random_blocks(KINDS["Q8_0"], 32, 64)
  q5 = _random_blocks(KINDS["Q5_0"], 16, 64, seed=3)
  m = GGUFMatrix.from_rows([(q5, KINDS["Q5_0"]), (q5, KINDS["Q5_0"]), (q8, KINDS["Q8_0"])])
  assert m.kinds == (KINDS["Q5_0"], KINDS["Q8_0"]) and m.shape == (64, 64)
  x = jnp.ones((2, 64), jnp.float32)
  want = np.asarray(x) @ np.asarray(m.dequantize()).T
  np.testing.assert_allclose(np.asarray(m.matmul(x)), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(m.matmul(jnp.ones((20, 64)))), np.tile(want[:1], (20, 1)),
                             rtol=1e-5, atol=1e-5)  # many rows: dequantised, XLA's dot
  with pytest.raises(GGUFMatrixError, match="one-part"):
    m.take_rows(jnp.array([0]))
  with pytest.raises(GGUFMatrixError, match="ggml type 10"):
    GGUFMatrix.from_rows([(q8, 10)])
  with pytest.raises(GGUFMatrixError, match="inputs"):
    GGUFMatrix.from_rows([(q8, KINDS["Q8_0"]), (_random_blocks(8, 4, 96), KINDS["Q8_0"])])


def _in_blocks(config, state):
  """A tiny model's state with every matrix in Q8_0 blocks (gguf-py's quantisation) but
  layer 1's MLP, in Q5_0: block types that differ between layers, as a Q4_K_M file's do
  (its Q6_K rows in some layers' MLPs), so layers' states differ in static metadata."""
  q8 = dict(quantized_blocks(state, config, KINDS["Q8_0"]))
  q5 = dict(quantized_blocks(state, config, KINDS["Q5_0"]))
  mixed = {name: q5[name] if name.startswith("blocks/1/mlp/") else m for name, m in q8.items()}
  return with_values(state, list(mixed.items()))


@pytest.fixture(scope="module", params=ARCHS)
def tiny_blocks(request):
  """(config, graphdef, float32 state, the same model in Q8_0 blocks, its dequantised
  float32 twin)."""
  config = tiny_config(request.param)
  graphdef, state = nnx.split(init_model(config, seed=3))
  blocks = _in_blocks(config, state)
  shapes = {"/".join(map(str, p)): v.get_value().shape for p, v in nnx.to_flat_state(state)}

  def dense(name: str, m: GGUFMatrix) -> jax.Array:
    w = np.asarray(m.dequantize())  # [Out, In], as a file stores it
    if name.split("/")[-1] in ("o", "down", "lm_head"):  # specjax stores these [In, Out]
      w = w.T
    return jnp.asarray(w.reshape(shapes[name]))

  matrices = [("/".join(map(str, p)), v.get_value()) for p, v in nnx.to_flat_state(blocks)]
  twin = with_values(state, [(name, dense(name, m)) for name, m in matrices
                             if isinstance(m, GGUFMatrix)])
  return config, graphdef, state, blocks, twin


def test_tiny_model_in_blocks_is_its_dequantised_twin(tiny_blocks):
  from conftest import prompt_logits

  config, graphdef, _, blocks, twin = tiny_blocks
  ids = np.array([[1, 5, 9, 14, 3, 7, 22, 40]])
  np.testing.assert_allclose(prompt_logits(config, graphdef, blocks, ids),
                             prompt_logits(config, graphdef, twin, ids), rtol=1e-4, atol=1e-4)


# Each family's forward over blocks is checked above (its dequantised twin); what the
# drafters add over blocks is family-blind but for the head, so two families decode: qwen2
# (an untied head, whose rows a shortlist takes, and biases) and gemma3 (sliding windows,
# four norms a layer, a scaled tied embedding).
@pytest.mark.parametrize("tiny_blocks", ["qwen2", "gemma3"], indirect=True)
def test_tiny_model_in_blocks_decodes_losslessly(tiny_blocks):
  """Greedy SSD == greedy AR on the blocks: a layer-skipping draft (the target's own
  blocks), 8-bit and Q4_0 drafts quantised from them, the layer-skipping and Q4_0 drafts
  over a shortlisted head whose rows stay blocks, and the per-round DPs over layers
  (CLaSp; KnapSpec over the Q4_0 copy), whose scan reads layers of unequal block types."""
  from test_knapspec import synthetic_profile

  config, graphdef, _, blocks, _ = tiny_blocks
  L = config.num_layers
  ids = [1, 5, 9, 14, 3, 7]
  ar = generate(graphdef, blocks, config, ids, max_new_tokens=24, eos_ids=()).tokens
  model = type("Loaded", (), {"state": blocks, "config": config})
  skip = StaticDrafter(DraftPlan.from_skips(L, skip_attn=[1], skip_mlp=[2]))
  short = np.arange(0, config.vocab_size, 2, dtype=np.int32)  # the head's rows kept in blocks
  q4 = Q4WeightsDrafter.for_model(model)
  knapspec = KnapSpecDrafter(profile=synthetic_profile(L, draft="q4_0"), interval=4, window=2,
                             selection_budget=None)
  dps = (ClaspDrafter(interval=4, skip=1), Q4WeightsDrafter(q4.weights, knapspec))
  for drafter in (skip, Int8WeightsDrafter.for_model(model), FRSpecDrafter(short, skip), q4,
                  FRSpecDrafter(short, q4), *dps):
    ssd = speculative_generate(graphdef, blocks, config, ids, drafter, max_new_tokens=24,
                               eos_ids=(), gamma=3)
    assert ssd.tokens == ar, drafter.name


def test_shortlist_rows_stay_blocks(tiny_blocks):
  """FR-Spec's head rows from a target in blocks are its blocks' rows (the file's bytes),
  and score the shortlist as the dequantised rows do."""
  config, graphdef, _, blocks, twin = tiny_blocks
  ids = jnp.asarray([3, 0, 50, 96], jnp.int32)
  rows = nnx.merge(graphdef, blocks).shortlist_rows(ids)
  assert isinstance(rows, GGUFMatrix) and rows.shape == (config.embed_dim, 4)
  h = jax.random.normal(jax.random.key(0), (1, 2, config.embed_dim))
  np.testing.assert_allclose(
      np.asarray(nnx.merge(graphdef, blocks).head_shortlist(h, ids, rows=rows)),
      np.asarray(nnx.merge(graphdef, twin).head_shortlist(h, ids)), rtol=1e-5, atol=1e-5)


def test_blocks_are_not_recast(tiny_blocks):
  config, _, _, blocks, _ = tiny_blocks
  with pytest.raises(ConfigError, match="GGUF blocks"):
    at_precision(config, blocks, "bfloat16")


@pytest.mark.real
def test_smollm2_blocks_match_float32_and_verify_bit_for_bit():
  """SmolLM2's own Q4_1/Q8_0 blocks: prompt logits within float32 rounding of the float32
  model's (the same weights), and a verification's rows equal to AR steps bit for bit
  (what keeps greedy SSD on greedy AR's tokens on near ties)."""
  from conftest import prompt_logits, real_model
  from test_real_ssd import _rows_against_steps

  f32 = real_model("smollm2-135m-instruct")
  from specjax.models.loader import with_gguf_blocks

  m = with_gguf_blocks(f32, verbose=False)
  ids = np.asarray([m.tokenizer.encode_prompt("Why is the sky blue?")])
  np.testing.assert_allclose(prompt_logits(m.config, m.graphdef, m.state, ids),
                             prompt_logits(f32.config, f32.graphdef, f32.state, ids),
                             rtol=1e-3, atol=1e-3)
  assert _rows_against_steps(m.config, m.graphdef, m.state, list(ids[0]), 6) == 0.0
  ar = generate(m.graphdef, m.state, m.config, list(ids[0]), max_new_tokens=32,
                eos_ids=()).tokens
  L = m.config.num_layers
  skip = StaticDrafter(DraftPlan.from_skips(L, skip_attn=range(10, 26, 2),
                                            skip_mlp=range(12, 28, 3)))
  for drafter in (skip, Int8WeightsDrafter.for_model(m)):
    ssd = speculative_generate(m.graphdef, m.state, m.config, list(ids[0]), drafter,
                               max_new_tokens=32, eos_ids=(), gamma=4)
    assert ssd.tokens == ar, drafter.name


def test_blocks_have_their_own_precision_name_and_bits(tiny_blocks):
  """Saved latency profiles and Self-SD searches are keyed by the precision: a target in
  blocks must not reuse the float32 target's; a draft's byte cost scales by its bits."""
  from specjax.decode.generate import precision_name, weight_bits

  config, _, state, blocks, _ = tiny_blocks
  assert precision_name(config, blocks) == "gguf" and precision_name(config, state) == "float32"
  assert weight_bits(state) == 32
  # Q8_0 (34 bytes a block of 32) but layer 1's MLP in Q5_0 (22): the mean over weights
  flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(blocks)}
  weights = {name: np.prod(m.shape) for name, m in flat.items() if isinstance(m, GGUFMatrix)}
  q5 = sum(n for name, n in weights.items() if name.startswith("blocks/1/mlp/"))
  total = sum(weights.values())
  assert weight_bits(blocks) == pytest.approx((34 * (total - q5) + 22 * q5) * 8 / 32 / total)


def test_blocks_need_the_cpu_kernel(monkeypatch):
  """Without the kernel (a GPU backend, no compiler, SPECJAX_CPU_KERNELS=0) `--dtype gguf`
  says so, rather than falling back to a slow path nobody asked for."""
  from specjax.models.loader import with_gguf_blocks

  monkeypatch.setattr(cpu_kernels.build, "kernel_status",
                      lambda kernel="int8_matmul": "disabled by SPECJAX_CPU_KERNELS=0")
  with pytest.raises(ConfigError, match="gguf_matmul kernel.*SPECJAX_CPU_KERNELS=0"):
    with_gguf_blocks(None)
