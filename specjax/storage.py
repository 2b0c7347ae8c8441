"""Where specjax keeps what it builds: converted params, tokenizers, assembled GGUF files,
compiled kernels and programs, drafters' artefacts.

One folder, `$SPECJAX_CACHE` (default `~/.cache/specjax`), read at each call so a test or
a notebook can point it elsewhere. Its own module because every layer writes there, from
the kernels' build up to the benchmarks, and none of them should import another layer to
find it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
  """The folder specjax caches under (`$SPECJAX_CACHE`, else `~/.cache/specjax`)."""
  return Path(os.environ.get("SPECJAX_CACHE", Path.home() / ".cache" / "specjax"))
