"""Regenerating sections of docs/BENCHMARKS.md, shared by `specjax bench` and experiments/.

Each section sits between `<!-- begin:NAME -->` and `<!-- end:NAME -->` and ends with the
command that produced it, so the file is only ever written by commands.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md"


def machine() -> str:
  """Device, CPU model and its widest vector extension, core count and jax version, for
  the record. The extension tells apart CPUs sold under one name (an "AMD EPYC" with
  AVX2 only, another with AVX-512) whose C++ kernels take different register tiles."""
  import jax

  fields: dict[str, str] = {}  # the first processor's lines
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      key, _, value = line.partition(":")
      fields.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  cpu = fields.get("model name") or platform.processor() or platform.machine()
  isa = vector_extension(fields.get("flags", ""))
  dev = jax.devices()[0]
  return (f"{dev.platform.upper()} ({getattr(dev, 'device_kind', '')}), {cpu}"
          f"{f' ({isa})' if isa else ''}, {os.cpu_count()} cores, jax {jax.__version__}")


def vector_extension(flags: str) -> str:
  """The widest x86 vector extension in a /proc/cpuinfo `flags` line ('' if none known)."""
  words = set(flags.split())
  for name, flag in (("AVX-512", "avx512f"), ("AVX2", "avx2"), ("AVX", "avx")):
    if flag in words:
      return name
  return ""


def write_section(name: str, body: str, command: str) -> None:
  """Replace section `name` of docs/BENCHMARKS.md (or append it); a no-op outside a
  repository checkout (an installed package has no docs/ beside it)."""
  if not DOCS.parent.exists():
    return
  begin, end = f"<!-- begin:{name} -->", f"<!-- end:{name} -->"
  stamp = datetime.date.today().isoformat()
  block = f"{begin}\n{body.rstrip()}\n\n_Regenerated {stamp} by `{command}`._\n{end}"
  text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
  if begin in text:
    text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
  else:
    text = text.rstrip() + "\n\n" + block + "\n"
  DOCS.write_text(text)


def copy_image(src, name: str) -> str:
  """Copy a plot next to BENCHMARKS.md (docs/img/NAME); return its Markdown image link,
  or "" when there is no plot (or no docs folder)."""
  import shutil

  if not src or not Path(src).exists() or not DOCS.parent.exists():
    return ""
  img = DOCS.parent / "img" / name
  img.parent.mkdir(exist_ok=True)
  shutil.copy(src, img)
  return f"![{Path(name).stem}](img/{name})"
