"""`compile_cache.enable`: a second process loads what the first compiled, and the user's
own setting (a folder, or the cache turned off) is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A fresh process: enable(), then one jitted program; prints the folder in use and how many
# programs came from the disk cache.
SCRIPT = """
import json, jax, jax.numpy as jnp
from specjax import compile_cache
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
folder = compile_cache.enable()
jax.jit(lambda x: jnp.tanh(x) @ x.T + 1)(jnp.ones((8, 8))).block_until_ready()
print(json.dumps({"folder": folder and str(folder), "hits": len(hits),
                  "max_size": jax.config.jax_compilation_cache_max_size}))
"""


def _run(env_changes: dict[str, str | None], cache: Path) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(SPECJAX_CACHE=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  for k, v in env_changes.items():
    if v is None:
      env.pop(k, None)
    else:
      env[k] = v
  out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                       text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
  first, second = _run({}, tmp_path), _run({}, tmp_path)
  assert first["folder"] == second["folder"] == str(tmp_path / "xla")
  assert first["hits"] == 0 and second["hits"] >= 1
  assert any((tmp_path / "xla").iterdir())
  assert first["max_size"] > 0  # bounded: jax's default grows without limit


@pytest.mark.parametrize("env", [{"SPECJAX_COMPILE_CACHE": "0"},
                                 {"JAX_COMPILATION_CACHE_DIR": ""}],
                         ids=["specjax-off", "jax-off"])
def test_a_cache_turned_off_stays_off(tmp_path, env):
  assert _run(env, tmp_path) == {"folder": None, "hits": 0, "max_size": -1}
  assert not (tmp_path / "xla").exists()


def test_the_users_own_folder_is_kept(tmp_path):
  mine = tmp_path / "mine"
  run = _run({"JAX_COMPILATION_CACHE_DIR": str(mine)}, tmp_path)
  assert run["folder"] == str(mine) and any(mine.iterdir())
  assert not (tmp_path / "xla").exists()


def test_the_command_line_enables_it_before_running_a_command(monkeypatch, capsys):
  from specjax import cli, compile_cache

  calls = []
  monkeypatch.setattr(compile_cache, "enable", lambda: calls.append("enable"))
  assert cli.main(["models"]) == 0 and calls == ["enable"]
