"""Tensor parallelism on 8 fake CPU devices (float32): a model placed on a mesh decodes the
single-device tokens, greedy SSD on a mesh equals greedy AR, each device holds about 1/N
of the sharded weights and of the KV cache, and a mesh that does not fit is refused.

Each check runs in a child process: the fake devices must be set before jax starts."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specjax import sharding
from specjax.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _child(body: str, timeout: int = 900) -> dict:
  script = textwrap.dedent("""
      import os
      os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
      import json
      import jax
      from specjax import sharding
      from specjax.decode.engine import speculative_generate
      from specjax.decode.generate import generate
      from specjax.models.loader import load_model
      PROMPT = "the cat sat on the mat and the dog"
      out = {}
  """) + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
  run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
  assert run.returncode == 0, run.stderr[-4000:]
  return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_family_decodes_its_single_device_tokens_on_2_and_8_devices():
  """Each family's greedy tokens on a 2- and an 8-way mesh (4-way: the drafters' test
  below), its weights split across the devices."""
  out = _child("""
      for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"):
        one = load_model(name, verbose=False)
        ids = one.tokenizer.encode(PROMPT)
        want = generate(one.graphdef, one.state, one.config, ids, max_new_tokens=24).tokens
        alone = sharding.bytes_per_device(one.state)[0]
        for n in (2, 8):
          m = load_model(name, verbose=False, tensor_parallel=n)
          got = generate(m.graphdef, m.state, m.config, ids, max_new_tokens=24).tokens
          held = sharding.bytes_per_device(m.state)
          out[f"{name}/{n}"] = {"same": got == want, "devices": len(held),
                                "share": max(held.values()) / alone}
  """)
  for key, row in out.items():
    n = int(key.split("/")[1])
    assert row["same"], key
    assert row["devices"] == n, key
    assert row["share"] < 1.2 / n + 0.05, (key, row)  # norms and small tables replicated


def test_greedy_ssd_on_a_mesh_equals_greedy_ar():
  """Every drafter on a 4-way mesh, built by the factory as `specjax bench` builds them
  (their artefacts the factory tests' small ones): layer plans (static, early exit,
  Self-SD, SWIFT, CLaSp's and KnapSpec's DPs, KNN-SSD), 8-bit weights, QuantSpec's cache
  and weights, the sparse-KV drafts, FR-Spec's and DynaSpec's shortlisted heads."""
  out = _child("""
      import sys, tempfile, types
      sys.path.insert(0, "tests")
      from targets import PROMPT, target
      from test_drafter_factory import small_factory
      from specjax.plan import DraftPlan, save_plan

      config, graphdef, state = target("llama", 4, 97)
      graphdef, placed = sharding.place(graphdef, state, sharding.make_mesh(4))
      model = types.SimpleNamespace(name="tiny-llama", config=config, graphdef=graphdef,
                                    state=placed)
      plan = tempfile.mkdtemp() + "/static.json"
      save_plan(plan, DraftPlan.from_skips(4, [2], [1]), model="tiny-llama")
      f = small_factory(model, plan)
      for name in ("static", "early_exit", "self_sd", "swift", "clasp", "knapspec", "knn",
                   "8bit", "quantspec", "streaming_kv", "snapkv", "frspec", "dynaspec"):
        d = f.make(name)
        ar = generate(graphdef, placed, config, PROMPT, max_new_tokens=24, eos_ids=(),
                      kv_cache=d.kv_cache).tokens
        ssd = speculative_generate(graphdef, placed, config, PROMPT, d, max_new_tokens=24,
                                   gamma=4, eos_ids=())
        out[name] = {"same": ssd.tokens == ar, "accepted": ssd.accepted,
                     "drafted": ssd.drafted}
  """, timeout=1500)
  assert len(out) == 13
  for name, row in out.items():
    assert row["same"], (name, row)
    assert row["accepted"] > 0, (name, row)  # drafts were kept, not only the bonus token
  assert any(r["accepted"] < r["drafted"] for r in out.values())  # and some rejected


def test_sampled_rounds_on_a_mesh_keep_the_target_distribution():
  """The powered χ² test of the sampling tests, once, on a 4-way mesh: 40 000 rounds drafted
  under a plan that skips sub-layers, their first and second committed tokens against the
  target's distributions (the test can see each classic acceptance bug at this n)."""
  out = _child("""
      import sys
      sys.path.insert(0, "tests")
      import jax.numpy as jnp
      from targets import assert_plan_keeps_the_target_distribution, target
      from specjax.decode.generate import prefill_step
      from specjax.kv_cache import KVCache
      from specjax.plan import DraftPlan
      from specjax.sampling import SamplingParams

      config, graphdef, state = target("llama", 4, 12)
      graphdef, placed = sharding.place(graphdef, state, sharding.make_mesh(4))
      sampling = SamplingParams(temperature=2.0, top_p=1.0)
      prompt = jnp.asarray([[9, 8, 10, 4, 3, 11, 9, 5, 8, 3, 5, 8, 10, 4, 6, 3, 8, 11, 7, 10,
                             3, 9, 8, 10, 4, 3, 11, 9, 5, 8]], jnp.int32)
      with sharding.running_on(placed):
        cache = KVCache.create(config, 1, 64)
        first, cache = prefill_step(placed, cache, prompt, jnp.int32(30),
                                    DraftPlan.full(4), jax.random.key(0), graphdef=graphdef,
                                    sampling=sampling)
        out["split"] = len(cache.k[0].sharding.device_set)
        out["power"] = assert_plan_keeps_the_target_distribution(
            placed, graphdef, config, cache, first[0], DraftPlan.from_skips(4, [1], [1]),
            sampling, vocab=12)
  """, timeout=1200)
  assert out["split"] == 4  # the cache itself lives on the mesh


_COLLECTIVES = r"""
      import collections, dataclasses, re
      import jax.numpy as jnp
      from flax import nnx
      from specjax.config import tiny_config
      from specjax.decode.generate import decode_step
      from specjax.decode.round import Draft, draft_step, verify_step
      from specjax.kv_cache import KVCache
      from specjax.model import init_model
      from specjax.plan import DraftPlan
      from specjax.sampling import SamplingParams

      def collectives(hlo):
        ops = re.findall(r"= \S+ ([a-z-]+?)(?:-start)?\(", hlo)
        return collections.Counter(o for o in ops if o in (
            "all-reduce", "all-gather", "collective-permute", "reduce-scatter", "all-to-all"))

      def config(L, kv_heads):  # the Llama-3 GQA ratio at a test's size
        return dataclasses.replace(tiny_config("llama", num_layers=L, vocab_size=256),
                                   num_heads=4 * kv_heads, num_kv_heads=kv_heads,
                                   hidden_dim=256, tie_embeddings=False)

      def compiled(L, kv_heads, n):
        cfg = config(L, kv_heads)
        graphdef, state = sharding.place(*nnx.split(init_model(cfg)), sharding.make_mesh(n))
        full, greedy = DraftPlan.full(L), SamplingParams()
        token, key = jnp.zeros((1,), jnp.int32), jax.random.key(0)
        with sharding.running_on(state):
          cache = KVCache.create(cfg, 1, 64)
          step = decode_step.lower(state, cache, token, full, key, graphdef=graphdef,
                                   sampling=greedy).compile().as_text()
          draft = Draft(jnp.int32(4), jnp.zeros((4,), jnp.int32), jnp.zeros((4,)), None)
          verify = verify_step.lower(state, cache, token[0], draft, full, key,
                                     graphdef=graphdef, sampling=greedy).compile().as_text()
        return collectives(step), collectives(verify)
"""


def test_a_layer_costs_two_all_reduces_and_no_weight_moves():
  """The compiled AR step and verification on a mesh whose devices divide the kv heads
  (Llama-3-70B's 8 on 4 or 8 devices): each layer adds exactly two all-reduces (after
  the output projection and after down) and nothing else, so no weight is gathered and
  no activation is shuffled between devices. With 2 kv heads on 4 devices the attention
  falls back to its input-dimension split, which the same count shows to cost more."""
  out = _child(_COLLECTIVES + """
      for n in (4, 8):
        (s2, v2), (s4, v4) = compiled(2, 8, n), compiled(4, 8, n)
        out[f"8 kv heads/{n}"] = {"step": dict(s4), "verify": dict(v4),
                                  "step per layer": (s4 - s2), "verify per layer": (v4 - v2)}
      (s2, _), (s4, _) = compiled(2, 2, 4), compiled(4, 2, 4)
      out["2 kv heads/4"] = {"step per layer": sum((s4 - s2).values()) / 2}
  """)
  for n in (4, 8):
    row = out[f"8 kv heads/{n}"]
    for part in ("step", "verify"):
      assert row[f"{part} per layer"] == {"all-reduce": 4}, (n, part, row)  # 2 layers' worth
      assert set(row[part]) == {"all-reduce"}, (n, part, row)  # no gather, permute, scatter
      assert row[part]["all-reduce"] <= 2 * 4 + 4, (n, part, row)  # + embedding, head, choice
  assert out["2 kv heads/4"]["step per layer"] > 2


def test_regrouped_rows_decode_the_single_device_tokens():
  """A model whose kv heads divide the devices has its fused rows regrouped per device;
  AR and SSD (a layer-skip plan with 8-bit weights, the copies built from the regrouped
  rows) then decode the single-device tokens on 4 devices, and a new plan value compiles
  nothing."""
  out = _child(_COLLECTIVES + """
      import sys, tempfile, types
      sys.path.insert(0, "tests")
      from test_drafter_factory import small_factory
      from specjax.plan import save_plan
      cfg = config(4, 8)
      graphdef, state = nnx.split(init_model(cfg))
      prompt = [5, 17, 99, 3, 42, 42, 7, 250, 11]
      want = generate(graphdef, state, cfg, prompt, max_new_tokens=20, eos_ids=()).tokens
      pgraph, placed = sharding.place(graphdef, state, sharding.make_mesh(4))
      merged = nnx.merge(pgraph, placed)
      out["shards"] = [(b.attn.shards, b.mlp.shards) for b in merged.blocks]
      out["qkv"] = str(merged.blocks[0].attn.qkv.get_value().sharding.spec)
      out["ar"] = generate(pgraph, placed, cfg, prompt, max_new_tokens=20,
                           eos_ids=()).tokens == want
      plan = tempfile.mkdtemp() + "/static.json"
      save_plan(plan, DraftPlan.from_skips(4, [2], [1]), model="random")
      f = small_factory(types.SimpleNamespace(name="random", config=cfg, graphdef=pgraph,
                                              state=placed), plan)
      from specjax.quant import quantize_mlp_weights, quantize_weights_int8
      for kind, copy in (("int8", quantize_weights_int8(placed, 4)),
                         ("int4", quantize_mlp_weights(placed, 4, 32))):
        held = sharding.bytes_per_device(copy)
        out[f"{kind} share"] = max(held.values()) / sum(held.values())
        out[f"{kind} like parents"] = all(
            getattr(layer, n).codes.sharding.spec[:2] == (
                ("tp", None) if n in ("qkv", "gate_up") else (None, "tp"))
            for layer in copy.layers for n in ("qkv", "o", "gate_up", "down")
            if getattr(layer, n) is not None)
      for name in ("static", "8bit", "quantspec"):
        d = f.make(name)
        ar = generate(pgraph, placed, cfg, prompt, max_new_tokens=20, eos_ids=(),
                      kv_cache=d.kv_cache).tokens
        ssd = speculative_generate(pgraph, placed, cfg, prompt, d, max_new_tokens=20,
                                   gamma=4, eos_ids=())
        out[name] = ssd.tokens == ar == want
      # QuantSpec's draft attention by the Pallas kernel (interpreted here), per kv head
      # under shard_map: lossless, and its draft step gathers no codes.
      qs = f.make("quantspec")
      qs = dataclasses.replace(qs, kv_cache=dataclasses.replace(qs.kv_cache, kernel=True))
      ar = generate(pgraph, placed, cfg, prompt, max_new_tokens=20, eos_ids=(),
                    kv_cache=qs.kv_cache).tokens
      ssd = speculative_generate(pgraph, placed, cfg, prompt, qs, max_new_tokens=20, gamma=4,
                                 eos_ids=())
      out["quantspec/pallas"] = ssd.tokens == ar
      with sharding.running_on(placed):
        cache = qs.kv_cache.create(cfg, 1, 256)
        hlo = draft_step.lower(placed, cache, jnp.int32(5), qs.overlay_plan(
            types.SimpleNamespace(config=cfg)), jax.random.key(0), graphdef=pgraph,
            vocab=None, gamma=4, threshold=0.0, sampling=SamplingParams())
        out["pallas sharded"] = "SPMDFullToShardShape" in hlo.as_text() or (
            "manual_computation" in hlo.as_text())
        out["pallas collectives"] = dict(collectives(hlo.compile().as_text()))
      # A new plan value reuses the draft executable: plans are traced, on a mesh too.
      with sharding.running_on(placed):
        cache = KVCache.create(cfg, 1, 64)
        before = draft_step._cache_size()
        for skip in ([1], [2], [0, 3]):
          draft_step(placed, cache, jnp.int32(5), DraftPlan.from_skips(4, skip, skip),
                     jax.random.key(0), graphdef=pgraph, vocab=None, gamma=4, threshold=0.0,
                     sampling=SamplingParams())
        out["compiled"] = draft_step._cache_size() - before
  """)
  assert out["shards"] == [[4, 4]] * 4 and out["qkv"] == "P('tp', None)"
  assert out["ar"] and out["static"] and out["8bit"] and out["quantspec"], out
  assert out["quantspec/pallas"] and out["pallas sharded"], out
  for kind in ("int8", "int4"):  # each device a quarter of the draft's copies, split as
    assert out[f"{kind} share"] < 0.26 and out[f"{kind} like parents"], out  # the target
  assert set(out["pallas collectives"]) == {"all-reduce"}, out  # the codes stay put
  assert out["compiled"] == 1, out


def test_two_processes_decode_the_single_device_tokens_on_one_mesh():
  """Multi-host as on a GPU cluster: two processes of two devices each, joined by
  `jax.distributed.initialize`, place the model on one 4-device mesh; AR, CLaSp (a
  per-round DP whose choices the host reads), 8bit and QuantSpec decode the single-device
  tokens in both. What it guards: no step reads an array another process holds, and
  loading does not wait on a lock inside a cross-process sync."""
  from specjax.decode.generate import generate
  from specjax.models.loader import load_model

  prompt = [5, 17, 99, 3, 42, 42, 7, 250, 11]
  one = load_model("tiny-llama", verbose=False)
  want = generate(one.graphdef, one.state, one.config, prompt, max_new_tokens=16,
                  eos_ids=()).tokens
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  runs = [subprocess.Popen([sys.executable, "tests/multi_process_child.py", str(i), str(port),
                            json.dumps(prompt)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for i in (0, 1)]
  try:
    results = [r.communicate(timeout=600) for r in runs]
  finally:
    for r in runs:
      r.kill()
  for r, (stdout, stderr) in zip(runs, results):
    assert r.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert (out["devices"], out["local"]) == (4, 2)
    for name in ("ar", "clasp", "8bit", "quantspec"):
      assert out[name] == want, (name, out[name], want)


def test_the_kv_cache_is_split_on_kv_heads_when_they_divide():
  out = _child("""
      from specjax.kv_cache import KVCache
      m = load_model("tiny-llama", verbose=False, tensor_parallel=2)  # 2 kv heads
      with sharding.running_on(m.state):
        cache = KVCache.create(m.config, 1, 64)
      out["split"] = [list(s.data.shape) for s in cache.k[0].addressable_shards]
      import warnings
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m8 = load_model("tiny-llama", verbose=False, tensor_parallel=8)
      out["warned"] = [str(w.message) for w in caught if "do not divide" in str(w.message)]
      with sharding.running_on(m8.state):
        cache = KVCache.create(m8.config, 1, 64)
      out["replicated"] = [list(s.data.shape) for s in cache.k[0].addressable_shards][:2]
  """)
  assert out["split"] == [[1, 1, 64, 16], [1, 1, 64, 16]]
  assert out["replicated"] == [[1, 2, 64, 16], [1, 2, 64, 16]]
  assert len(out["warned"]) == 1 and "2 kv heads do not divide 8 devices" in out["warned"][0]


def test_generate_on_the_command_line_prints_the_single_device_text():
  env_flag = "--xla_force_host_platform_device_count=4"
  run = lambda *a: subprocess.run(
      [sys.executable, "-m", "specjax.cli", "generate", "--model", "tiny-llama",
       "--max-new-tokens", "16", "--prompt", "the cat sat", *a], cwd=ROOT, capture_output=True,
      text=True, timeout=600, env={**os.environ, "XLA_FLAGS": env_flag})
  one, four = run(), run("--tensor-parallel", "4")
  assert one.returncode == 0 and four.returncode == 0, four.stderr[-3000:]
  assert four.stdout == one.stdout and one.stdout.strip()


def test_a_mesh_that_cannot_hold_the_model_is_refused_with_the_reason():
  """GGUF blocks on a mesh (only the C++ kernels read them: the target's under --dtype
  gguf, the 4bit draft's Q4_0 copies), and a mesh of your own whose axis is not the one
  the rules split over."""
  out = _child("""
      from jax.sharding import Mesh
      from specjax.errors import ConfigError
      for name, kw in (("gguf", dict(dtype="gguf", tensor_parallel=2)),
                       ("axis", dict(mesh=Mesh(jax.devices()[:2], ("model",))))):
        try:
          load_model("tiny-llama", verbose=False, **kw)
          out[name] = "loaded"
        except ConfigError as err:
          out[name] = str(err)
      from specjax.quant import q4_0_draft_weights
      m = load_model("tiny-llama", verbose=False, tensor_parallel=2)
      try:
        q4_0_draft_weights(m.state, m.config.num_layers)
        out["q4_0"] = "built"
      except ConfigError as err:
        out["q4_0"] = str(err)
  """)
  assert "runs on one CPU, not over --tensor-parallel" in out["gguf"]
  assert "axis named 'tp'" in out["axis"] and "('model',)" in out["axis"]
  assert "4bit draft" in out["q4_0"] and "sharded over a mesh" in out["q4_0"]


def test_a_mesh_larger_than_the_devices_is_refused_with_the_way_out():
  with pytest.raises(ConfigError, match="xla_force_host_platform_device_count=64"):
    sharding.make_mesh(64)
  with pytest.raises(ConfigError, match="at least 1"):
    sharding.make_mesh(0)


def test_each_rule_splits_the_first_dimension_the_devices_divide():
  P = sharding.P
  assert sharding.param_spec("qkv", (128, 64), 4) == P(None, "tp")  # rows as stored: D
  assert sharding.param_spec("qkv", (128, 64), 4, regrouped=True) == P("tp", None)
  assert sharding.param_spec("o", (4, 16, 64), 4) == P("tp", None, None)
  assert sharding.param_spec("o", (4, 16, 64), 8) == P(None, None, "tp")  # 4 heads, 8 devices
  assert sharding.param_spec("embedding", (259, 64), 2) == P(None, "tp")  # odd vocabulary
  assert sharding.param_spec("embedding", (151936, 896), 8) == P("tp", None)
  assert sharding.param_spec("scale", (64,), 4) == P()
  assert sharding.param_spec("down", (6, 10), 4) == P()  # neither divides: replicated
