"""orbax save / restore of specjax pytrees: converted params, trained tiny models, routers
and KNN skip libraries.

Writes go to a temporary directory renamed into place, so an interrupted save never
leaves a half-written checkpoint that looks complete. Each save also lists its data files'
sizes (`files.json`), which a restore checks before orbax reads anything: a truncated or
overwritten file is refused by name, where orbax would fail one read and leave the others'
coroutines to complain when collected (hundreds of warnings for a model's 272 tensors).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from specjax.errors import SpecjaxError

FILES = "files.json"  # beside meta.json: the size of each array data file under tree/


class CheckpointError(SpecjaxError, RuntimeError):
  """A checkpoint is missing, corrupt or belongs to something else."""


def _checkpointer() -> ocp.StandardCheckpointer:
  """A checkpointer of this process alone. Orbax by default syncs every process of a
  multi-process run at each save and restore, but what is saved here (a tiny model, a
  router, converted weights) is each process's own, read under a file lock: a process
  holding the lock would wait in the sync for one waiting on the lock."""
  me = jax.process_index()
  return ocp.StandardCheckpointer(multiprocessing_options=ocp.options.MultiprocessingOptions(
      primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"process{me}"))


def save_tree(directory: Path, tree: Any, meta: dict | None = None) -> None:
  """Save a pytree of arrays (and a JSON `meta` beside it) atomically."""
  directory = Path(directory).absolute()
  directory.parent.mkdir(parents=True, exist_ok=True)
  # A fresh temporary name per call: two processes saving the same tree (test workers)
  # never write into one another's files.
  tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", suffix=".tmp", dir=directory.parent))
  with _checkpointer() as ckpt:
    ckpt.save(tmp / "tree", tree)
    ckpt.wait_until_finished()
  (tmp / "meta.json").write_text(json.dumps(meta or {}, indent=1))
  (tmp / FILES).write_text(json.dumps(_sizes(tmp / "tree"), indent=0, sort_keys=True))
  shutil.rmtree(directory, ignore_errors=True)
  tmp.rename(directory)


def load_meta(directory: Path) -> dict:
  path = Path(directory) / "meta.json"
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as err:
    raise CheckpointError(f"cannot read {path}: {err}") from err


def _sizes(tree_dir: Path) -> dict[str, int]:
  """{path under `tree_dir`: bytes} of the array data orbax wrote there: its OCDBT data
  files (`d/`), content-addressed and never rewritten. The small JSON files beside them
  are orbax's to parse (and may be edited: `_sharding`, see `restore_tree`)."""
  return {str(f.relative_to(tree_dir)): f.stat().st_size
          for f in sorted(tree_dir.rglob("*")) if f.is_file() and f.parent.name == "d"}


def _check_sizes(directory: Path) -> None:
  """Refuse a checkpoint whose files differ in size from what its save listed (checkpoints
  written before the list existed are not checked)."""
  listed = directory / FILES
  if not listed.exists():
    return
  try:
    expected = json.loads(listed.read_text())
  except (OSError, ValueError) as err:
    raise CheckpointError(f"checkpoint at {directory} is unreadable: {listed.name}: {err}"
                          ) from err
  actual = _sizes(directory / "tree")
  for name, size in expected.items():
    if actual.get(name) != size:
      found = "missing" if name not in actual else f"{actual[name]} bytes"
      raise CheckpointError(f"checkpoint at {directory} is damaged: tree/{name} is {found}, "
                            f"{size} bytes when saved")


def restore_tree(directory: Path, like: Any) -> Any:
  """Restore into the structure, shapes and dtypes of `like` (arrays or ShapeDtypeStructs)."""
  directory = Path(directory).absolute()
  if not (directory / "tree").exists():
    raise CheckpointError(f"no checkpoint at {directory}")
  _check_sizes(directory)
  # placed on this process's first device: a checkpoint written on another backend
  # (a router trained on a CPU, read on a GPU) would otherwise be refused as another
  # topology, and across hosts `jax.devices()[0]` is another process's device
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), like)
  try:
    with _checkpointer() as ckpt:
      return ckpt.restore(directory / "tree", abstract)
  except Exception as err:  # orbax/tensorstore raise many types for damaged files
    raise CheckpointError(f"checkpoint at {directory} is unreadable: {_brief(err)}") from err


def _brief(err: Exception) -> str:
  """The first line of a restore error, without the TensorStore spec that tensorstore
  appends (some 60 lines of JSON); the whole error stays chained as the cause."""
  text = str(err).split(" See full TensorStore details")[0].strip()
  return (text.splitlines() or [type(err).__name__])[0]
