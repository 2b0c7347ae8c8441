"""specjax.ops, the one place that picks a C++ kernel, a Pallas kernel or XLA for an op: a
decode step's few float32 rows on one CPU take the kernels, and nothing sharded ever
reaches a C++ custom call (it sees one device's buffer)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from specjax import cpu_kernels, ops

ROOT = Path(__file__).resolve().parent.parent
built = pytest.mark.skipif(cpu_kernels.kernel_status("f32_matmul") != "ready",
                           reason="the C++ kernels did not build here")


def test_one_device_is_not_sharded():
  x = jnp.ones((2, 8))
  assert not ops.sharded(x)
  assert not jax.jit(lambda x: jnp.asarray(ops.sharded(x)))(x)


@built
def test_a_decode_step_takes_the_kernels_and_a_prompt_takes_xla():
  w = jnp.ones((8, 4), jnp.float32)
  step = jax.jit(lambda x: ops.matmul(x, w)).lower(jnp.ones((1, 5, 8))).as_text()
  prompt = jax.jit(lambda x: ops.matmul(x, w)).lower(jnp.ones((1, 17, 8))).as_text()
  assert "specjax_f32_matmul" in step and "specjax_f32_matmul" not in prompt
  logits = jnp.ones((2, 50), jnp.float32)
  assert "specjax_f32_argmax" in jax.jit(ops.argmax).lower(logits).as_text()


# Run in a child process: the fake devices must be set before jax starts.
_ON_A_MESH = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from specjax import cpu_kernels, ops
    from specjax.config import tiny_config
    from specjax.errors import ConfigError
    from specjax.kv_cache import KVCache
    from specjax.model import apply, init_model
    from specjax.plan import DraftPlan

    assert cpu_kernels.kernel_status("f32_matmul") == "ready"
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    w = jnp.ones((8, 4), jnp.float32)
    x = jnp.ones((1, 5, 8), jnp.float32)
    step = lambda x: ops.matmul(x, w)
    assert "specjax_f32_matmul" in jax.jit(step).lower(x).as_text()
    with jax.set_mesh(mesh):
      assert "specjax_" not in jax.jit(step).lower(x).as_text()  # a mesh is set
      assert not ops.quant_codes_on_cpu()
    split = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    assert ops.sharded(split)
    assert "specjax_" not in jax.jit(lambda x, w: ops.matmul(x, w)).lower(x, split).as_text()
    assert ops.blocks_unavailable() is None
    assert "sharded over a mesh" in ops.blocks_unavailable(split)
    blocks = jax.device_put(jnp.zeros((4, 18), jnp.uint8), NamedSharding(mesh, P("tp")))
    try:
      ops.gguf_matmul(jnp.ones((1, 32), jnp.float32), blocks, 2)  # Q4_0 rows, split
      raise AssertionError("a sharded GGUF matrix reached the kernel")
    except ConfigError as err:
      assert "sharded over a mesh" in str(err), err
    # A whole decode step of a tiny model: kernels alone, XLA under the mesh, same logits.
    config = tiny_config("llama")
    graphdef, state = nnx.split(init_model(config, seed=1))
    cache = KVCache.create(config, 1, 64)
    tokens = jnp.asarray([[3, 4, 5]], jnp.int32)
    positions = jnp.arange(3, dtype=jnp.int32)[None]
    plan = DraftPlan.full(config.num_layers)
    fwd = lambda s, c, t, p: apply(s, c, t, p, plan, graphdef=graphdef)[0].logits
    alone = jax.jit(fwd).lower(state, cache, tokens, positions).as_text()
    assert "specjax_f32_matmul" in alone and "specjax_f32_attention" in alone
    want = np.asarray(jax.jit(fwd)(state, cache, tokens, positions))
    with jax.set_mesh(mesh):
      assert "specjax_" not in jax.jit(fwd).lower(state, cache, tokens, positions).as_text()
      got = np.asarray(jax.jit(fwd)(state, cache, tokens, positions))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    print("ok")
""")


@built
def test_on_a_mesh_no_operand_reaches_a_cpp_kernel():
  out = subprocess.run([sys.executable, "-c", _ON_A_MESH], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
