"""llama.cpp as a baseline row of `specjax bench`: greedy decoding of the same GGUF file
on the same prompts, in the same process, timed as specjax's AR is timed.

llama.cpp reads the file's own quantised weights and quantises activations for its dots,
so its tokens are not specjax's float32 ones (how many agree is recorded): the row says
how fast a mature low-bit CPU engine decodes these prompts, beside which SSD's lossless
speedups can be read. It runs on every core (the binding's default is half of them), as
specjax's kernels do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from specjax.errors import ConfigError, SpecjaxError
from specjax.models.source import gguf_file

METHOD = "llama.cpp"
INSTALL = "pip install llama-cpp-python  # builds llama.cpp: minutes, needs a C++ compiler"


class MissingBaselineError(SpecjaxError, ImportError):
  """The llama.cpp Python binding is not installed."""


def _binding():
  """The `llama_cpp` module, or an error that says how to install it."""
  try:
    import llama_cpp
  except ImportError as err:
    raise MissingBaselineError(f"the llama.cpp baseline needs its binding:\n  {INSTALL}"
                               ) from err
  return llama_cpp


def build_features() -> str:
  """The CPU features the installed llama.cpp was built for ("AVX512 AVX512_VNNI ..."):
  which of its kernels a run measured. A build for an Intel Xeon's AMX (GGML_NATIVE on a
  Sapphire Rapids host) crashed in `ggml_backend_amx_mul_mat` in this project's VM."""
  info = _binding().llama_print_system_info().decode()
  on = [f.split("=")[0].split(":")[-1].strip() for f in info.split("|")
        if f.strip().endswith("= 1")]
  return " ".join(on) or info.strip()


class LlamaCppBaseline:
  """One llama.cpp model over a source's GGUF file (`source.gguf_file`), with room for
  `context` tokens (prompt and answer)."""

  def __init__(self, model_name: str, context: int):
    self.threads = os.cpu_count() or 1
    self._llm = _binding().Llama(model_path=str(gguf_file(model_name)), n_ctx=context,
                                 verbose=False, n_threads=self.threads,
                                 n_threads_batch=self.threads)

  def generate(self, ids: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    """Greedy decoding of `max_new_tokens` after `ids` from an empty KV cache: the tokens,
    the seconds to the first token (prompt and first token: specjax's prefill) and those
    after it (the decode)."""
    self._llm.reset()  # no prefix of the previous prompt's KV is reused
    tokens: list[int] = []
    start = time.perf_counter()
    first = 0.0
    for tok in self._llm.generate(list(ids), temp=0.0):
      tokens.append(int(tok))
      if len(tokens) == 1:
        first = time.perf_counter()
      if len(tokens) == max_new_tokens:
        break
    end = time.perf_counter()
    return {"tokens": tokens, "prefill_s": first - start, "decode_s": end - first}


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  """How many leading tokens two greedy decodings share."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def record(baseline: LlamaCppBaseline, ids: Sequence[int], max_new_tokens: int,
           reference: Sequence[int], tags: dict) -> dict[str, Any]:
  """A results record of the baseline on one prompt, in the fields `metrics.summarize`
  reads (a reference: no M, no mismatches), with how many leading tokens it shares with
  specjax's AR tokens `reference`."""
  out = baseline.generate(ids, max_new_tokens)
  agree = shared_prefix(out["tokens"], reference)
  return dict(tags, method=METHOD, is_reference=True, tokens=[out["tokens"]],
              prompt_tokens=len(ids), decode_tokens=len(out["tokens"]) - 1,
              decode_s=out["decode_s"], prefill_s=out["prefill_s"], compile_s=0.0,
              agreeing_tokens=agree, threads=baseline.threads)


def check(model_name: str, temperature: float, max_turns: int) -> None:
  """Refuse, before anything is loaded, a run the baseline cannot mirror: no binding, a
  model without a GGUF file, sampling, more than one turn."""
  _binding()
  try:
    gguf_file(model_name)
  except ConfigError as err:
    raise ConfigError(f"the llama.cpp baseline reads a GGUF file: {err}") from None
  if temperature != 0:
    raise ConfigError("the llama.cpp baseline decodes greedily: drop --llama-cpp or "
                      "--temperature")
  if max_turns != 1:
    raise ConfigError("the llama.cpp baseline decodes the first turn only: drop --llama-cpp "
                      "or --max-turns")
