"""One process of `test_tensor_parallel.py`'s two-process run: process `argv[1]` of two,
each with two fake CPU devices, joined by `jax.distributed` (gloo collectives) into one
4-device mesh; prints the tokens AR and three drafters decode there as a JSON line."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{sys.argv[2]}", num_processes=2,
                           process_id=int(sys.argv[1]))

from specjax.decode.engine import speculative_generate  # noqa: E402
from specjax.decode.generate import generate  # noqa: E402
from specjax.drafters.factory import DrafterFactory  # noqa: E402
from specjax.models.loader import load_model  # noqa: E402

PROMPT = json.loads(sys.argv[3])
m = load_model("tiny-llama", verbose=False, tensor_parallel=4)
factory = DrafterFactory(m, gamma=4, verbose=False,
                         options={"clasp": {"interval": 3, "skip": 1},
                                  "quantspec": {"group": 32, "residual": 32}})
out = {"devices": jax.device_count(), "local": jax.local_device_count(),
       "ar": generate(m.graphdef, m.state, m.config, PROMPT, max_new_tokens=16,
                      eos_ids=()).tokens}
for name in ("clasp", "8bit", "quantspec"):
  out[name] = speculative_generate(m.graphdef, m.state, m.config, PROMPT, factory.make(name),
                                   max_new_tokens=16, gamma=4, eos_ids=()).tokens
print(json.dumps(out), flush=True)
