"""The generated results pages under docs/results/, shared by `specjax bench` and experiments/.

A results page holds one topic (long context, QuantSpec, the GPU, ...). Each section of
it sits between `<!-- begin:NAME -->` and `<!-- end:NAME -->` and ends with the command
that produced it, so a section is only ever written by a command, and a rerun of that
command replaces it: a page holds the latest run of each configuration, and older runs
live in git history. The section's name picks its page (`PAGES`, by prefix).
"""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
RESULTS = DOCS_DIR / "results"

# Section-name prefix -> (page file, title, what the page is for). The first prefix that a
# name starts with wins, so longer prefixes come first.
PAGES: list[tuple[str, str, str, str]] = [
    ("bench-", "spec-bench-runs.md", "Spec-Bench runs, category by category",
     "The latest `specjax bench --write-docs` run on each model and weight format: the "
     "per-category speedups, the draft lengths `--auto-gamma` chose and the figures behind "
     "them. The leaderboard over every run is [spec-bench.md](spec-bench.md)."),
    ("sweep-", "sweeps.md", "Ablation sweeps",
     "`specjax sweep FILE` over the seeds' own ablation grids (`experiments/sweeps/`)."),
    ("long-context-", "long-context.md", "Long context",
     "The layer-skipping drafters against AR as the prompt grows "
     "(`python -m experiments.bench_long_context`)."),
    ("quantspec-", "quantspec.md", "QuantSpec",
     "QuantSpec's draft over the hierarchical quantised KV cache at long context, and the "
     "step costs on that cache."),
    ("quant-steps-", "quantspec.md", "", ""),
    ("vocab-", "vocab.md", "Vocabulary shortlists: FR-Spec and DynaSpec",
     "Drafts whose LM head scores a shortlist, against the same draft with the full head, "
     "and the DynaSpec router's ablations."),
    ("router-ablation-", "vocab.md", "", ""),
    ("knn-streams-", "knn-ssd.md", "KNN-SSD on task streams",
     "Per-domain skip sets picked by nearest neighbour, on streams that mix domains "
     "(`python -m experiments.bench_knn_streams`)."),
    ("forward-", "step-costs.md", "Step costs on a CPU",
     "What a draft step, a verification and an AR step cost in one process, the AR "
     "decode speed against the weight-bandwidth roofline and transformers, the per-round "
     "breakdown and the layer-selection DP's cost."),
    ("round-", "step-costs.md", "", ""),
    ("layer-dp-", "step-costs.md", "", ""),
    ("cpu-kernels-", "cpu-kernels.md", "CPU kernels",
     "specjax's C++ kernels against XLA's own ops, matrix by matrix and for a step's "
     "attention, and one experiment on two jax installs."),
    ("attention-", "cpu-kernels.md", "", ""),
    ("gguf-kernel-", "cpu-kernels.md", "", ""),
    ("jax-versions-", "cpu-kernels.md", "", ""),
    ("gpu-", "gpu.md", "GPU runs",
     "Step costs, AR decode speed and end-to-end runs on lent GPUs, each regenerated from "
     "the JSON lines the device wrote (`docs/gpu/`), and the Pallas kernels' timings. "
     "What the code does on a GPU and why: [../GPU.md](../GPU.md)."),
    ("kernels-gpu", "gpu.md", "", ""),
    ("load-", "loading.md", "Loading checkpoints",
     "Loading Hugging Face checkpoints against transformers, and real weights through the "
     "folder path."),
    ("hf-", "loading.md", "", ""),
]
OTHER = ("other.md", "Other results", "Sections no topic page claims.")


def page_for(name: str) -> Path:
  """The page a section named `name` belongs on."""
  for prefix, page, _, _ in PAGES:
    if name.startswith(prefix):
      return RESULTS / page
  return RESULTS / OTHER[0]


def _page_head(page: Path) -> str:
  """A new page's title and introduction: the first `PAGES` entry naming it."""
  for _, file, title, intro in [*PAGES, ("", *OTHER)]:
    if file == page.name and title:
      return f"# {title}\n\n{intro}\n"
  return f"# {page.stem}\n"


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


def write_section(name: str, body: str, command: str, page: Path | None = None) -> None:
  """Replace section `name` on its page (or append it); a no-op outside a repository
  checkout (an installed package has no docs/ beside it)."""
  if not DOCS_DIR.exists():
    return
  page = page or page_for(name)
  begin, end = f"<!-- begin:{name} -->", f"<!-- end:{name} -->"
  stamp = f"_Regenerated {datetime.date.today().isoformat()} by `{command}`._"
  block = f"{begin}\n{body.rstrip()}\n\n{stamp}\n{end}"
  text = page.read_text() if page.exists() else _page_head(page)
  if begin in text:
    text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
  else:
    text = text.rstrip() + "\n\n" + block + "\n"
  page.parent.mkdir(parents=True, exist_ok=True)
  page.write_text(text)


def sections(text: str) -> dict[str, str]:
  """A page's generated sections, name -> body (markers excluded), in page order."""
  return {m.group(1): m.group(2).strip()
          for m in re.finditer(r"<!-- begin:(\S+) -->\n(.*?)<!-- end:\1 -->", text, re.S)}


def copy_image(src, name: str) -> str:
  """Copy a plot to docs/img/NAME; return its Markdown image link as a results page
  writes it, or "" when there is no plot (or no docs folder)."""
  import shutil

  if not src or not Path(src).exists() or not DOCS_DIR.exists():
    return ""
  img = DOCS_DIR / "img" / name
  img.parent.mkdir(exist_ok=True)
  shutil.copy(src, img)
  return f"![{Path(name).stem}](../img/{name})"
