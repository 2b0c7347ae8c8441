"""DraftPlan: which sub-layers the draft runs.

A plan is a pytree of traced arrays, not a static argument: changing which layers are
skipped between rounds never recompiles. Later methods add fields (KV precision, vocab
shortlist) without changing the forward pass signature.

Plan bits, the one flat form of a plan's masks (searches, DP items, saved records,
experiments): bool[2L] in sub-layer order attn_0, mlp_0, attn_1, mlp_1, ... — the order
of the residuals a forward returns — True where the sub-layer runs. Sub-layer i is
layer i // 2, attention when i is even. `DraftPlan.to_bits` / `from_bits` convert.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError


def conditionals_skip_cheaply() -> bool:
  """Whether a `lax.cond` costs next to nothing on this backend. On a CPU it runs its
  branch in place: a traced plan really skips its sub-layers, and the quantised cache
  skips idle flushes. An accelerator copies each predicate to the host and waits (XLA:GPU;
  docs/GPU.md), so there plans that hold are frozen (`DraftPlan.freeze`) and
  flushes run unconditionally."""
  return jax.default_backend() == "cpu"


class PlanError(SpecjaxError, ValueError):
  """A malformed draft plan (wrong length, wrong dtype, not boolean)."""


@flax.struct.dataclass
class DraftPlan:
  """`attn[l]` / `mlp[l]`: run the attention / MLP sub-layer of layer l. `vocab`, when
  set, is the draft's LM-head shortlist: full-vocabulary ids, -1 for padding; the draft
  scores only those rows (verification always uses the full vocabulary). `router`, when
  set, picks the shortlist per draft step (DynaSpec, `Transformer.routed_head`); with
  `vocab` too, the routed clusters are scored beside `vocab`, a static core the router
  leaves out."""

  attn: jax.Array  # bool[L]
  mlp: jax.Array  # bool[L]
  vocab: jax.Array | None = None  # int32[K] shortlist; None: the full vocabulary
  # The shortlist's LM-head rows, gathered once (`session.Session.with_head_rows`):
  # float[K, D], or a `quant.Int8Matrix` of K channels under 8-bit weights. None: each
  # draft step gathers them (XLA:CPU does not hoist that gather out of the draft loop).
  head_rows: Any = None
  router: Any = None  # router.RouterPlan: a shortlist chosen per draft step (DynaSpec)
  # QuantSpec: the precision the draft reads the KV cache at (4: upper nibbles of a
  # QuantKVCache; 16: as stored).
  kv_bits: int = flax.struct.field(pytree_node=False, default=16)
  # A sparse-KV draft (StreamingLLM-style, `drafters.streaming_kv`): (sinks, recent), the
  # draft reads only the verified cache's first `sinks` slots and its last `recent` ones
  # (plus this round's drafts). Static: the slice sizes shape the executable. None: all.
  kv_window: tuple[int, int] | None = flax.struct.field(pytree_node=False, default=None)
  # A SnapKV-style draft (`drafters.snapkv`): `kv_cache.KeptKV`, the prompt slots each kv
  # head of each layer attended to most, copied out of the verified cache after prefill;
  # the draft reads them beside `kv_window`'s recent slots (its sinks 0). None: no selection.
  kv_keep: Any = None
  # quant.DraftWeights: quantised matrices the draft reads instead of the target's own
  # (8-bit: every matmul and the LM head; 4-bit: QuantSpec's MLP). None: the target's.
  weights: Any = None
  # float32[] this round's draft early stop (a draft step whose top-1 probability falls
  # below it ends the draft), for drafters that adapt it between rounds (Self-SD's
  # adaptive draft-exiting). None: the engine's static `threshold`.
  stop: jax.Array | None = None
  # Every sub-layer runs, known at trace time (`full`): the forward traces no per-layer
  # conditional. The AR step and verification use it; a GPU runs each conditional as a
  # host round trip. Static, so a dense plan gets its own executable.
  dense: bool = flax.struct.field(pytree_node=False, default=False)
  # The masks as static (attn, mlp) tuples (`freeze`): the forward then traces exactly the
  # sub-layers that run and no conditional, one executable per plan. For drafters whose
  # plan is fixed, on backends where a conditional costs a host sync (GPU).
  frozen: tuple[tuple[bool, ...], tuple[bool, ...]] | None = flax.struct.field(
      pytree_node=False, default=None)

  def freeze(self) -> DraftPlan:
    """This plan with its masks also static (see `frozen`); needs concrete masks."""
    as_tuple = lambda a: tuple(bool(v) for v in np.asarray(a))
    return self.replace(frozen=(as_tuple(self.attn), as_tuple(self.mlp)))

  def runs(self, kind: str, layer: int) -> jax.Array | bool | None:
    """Whether the forward runs sub-layer `kind` ("attn" / "mlp") of `layer`: None when it
    always does (no conditional), False when it never does (not traced), else the traced
    predicate of a `lax.cond`."""
    if self.dense:
      return None
    if self.frozen is not None:
      return None if self.frozen[kind == "mlp"][layer] else False
    return getattr(self, kind)[layer]

  @property
  def weight_bits(self) -> int:
    """Bits per weight of the draft's quantised matrices; 16 when it reads the target's."""
    return 16 if self.weights is None else self.weights.bits

  @property
  def num_layers(self) -> int:
    return self.attn.shape[-1]

  @classmethod
  def full(cls, num_layers: int) -> DraftPlan:
    """The target model itself: every sub-layer runs, with no conditional traced."""
    ones = jnp.ones((num_layers,), jnp.bool_)
    return cls(attn=ones, mlp=ones, dense=True)

  @classmethod
  def from_masks(cls, attn: Sequence[bool], mlp: Sequence[bool]) -> DraftPlan:
    attn_np, mlp_np = _as_mask(attn, "attn"), _as_mask(mlp, "mlp")
    if attn_np.shape != mlp_np.shape:
      raise PlanError(f"attn has {attn_np.size} layers but mlp has {mlp_np.size}")
    return cls(attn=jnp.asarray(attn_np), mlp=jnp.asarray(mlp_np))

  @classmethod
  def from_bits(cls, bits: Sequence[bool]) -> DraftPlan:
    """The plan of plan bits (module docstring: sub-layer order, True = runs)."""
    arr = _as_mask(bits, "plan bits")
    if arr.size % 2:
      raise PlanError(f"plan bits hold two per layer (attn_0, mlp_0, attn_1, ...), got "
                      f"{arr.size}")
    return cls.from_masks(arr[0::2], arr[1::2])

  def to_bits(self) -> np.ndarray:
    """This plan's masks as plan bits (host-side)."""
    bits = np.empty(2 * self.num_layers, bool)
    bits[0::2], bits[1::2] = np.asarray(self.attn), np.asarray(self.mlp)
    return bits

  @classmethod
  def from_skips(
      cls, num_layers: int, skip_attn: Sequence[int] = (), skip_mlp: Sequence[int] = ()
  ) -> DraftPlan:
    """A plan that skips the listed layer indices."""
    attn = np.ones(num_layers, bool)
    mlp = np.ones(num_layers, bool)
    for name, idx, mask in (("attn", skip_attn, attn), ("mlp", skip_mlp, mlp)):
      for i in idx:
        if not 0 <= i < num_layers:
          raise PlanError(f"skip_{name} index {i} outside 0..{num_layers - 1}")
        mask[i] = False
    return cls.from_masks(attn, mlp)

  @classmethod
  def first_layers(cls, num_layers: int, k: int) -> DraftPlan:
    """Early exit: run layers 0..k-1 only."""
    if not 0 <= k <= num_layers:
      raise PlanError(f"k={k} outside 0..{num_layers}")
    mask = np.arange(num_layers) < k
    return cls.from_masks(mask, mask)

  def check(self, num_layers: int) -> DraftPlan:
    """Raise a clear error unless this plan fits a model of `num_layers` layers."""
    for name in ("attn", "mlp"):
      arr = getattr(self, name)
      if arr.shape != (num_layers,):
        raise PlanError(
            f"plan.{name} has shape {tuple(arr.shape)}, the model has {num_layers} layers"
        )
      if arr.dtype != jnp.bool_:
        raise PlanError(f"plan.{name} must be bool, got {arr.dtype}")
    if self.dense and not isinstance(self.attn, jax.core.Tracer) and not (
        np.all(np.asarray(self.attn)) and np.all(np.asarray(self.mlp))):
      raise PlanError("a dense plan runs every sub-layer: build it with DraftPlan.full, or "
                      "use from_masks for a plan that skips some")
    if self.frozen is not None and not isinstance(self.attn, jax.core.Tracer) and (
        self.frozen != self.freeze().frozen):
      raise PlanError("a frozen plan's static masks differ from its arrays: freeze() it again "
                      "after changing them")
    if self.kv_bits not in (4, 8, 16):
      raise PlanError(f"plan.kv_bits must be 4, 8 or 16, got {self.kv_bits}")
    if self.kv_window is not None:
      w = self.kv_window
      if not (isinstance(w, tuple) and len(w) == 2 and all(isinstance(n, int) for n in w)
              and w[0] >= 0 and w[1] >= 1):
        raise PlanError(f"plan.kv_window must be (sinks >= 0, recent >= 1) as ints, got {w!r}")
      if self.kv_bits != 16:
        raise PlanError("plan.kv_window reads a full-precision cache as stored; with "
                        f"kv_bits={self.kv_bits} the draft would read a quantised one")
    if self.kv_keep is not None:
      if self.kv_window is None or self.kv_window[0] != 0:
        raise PlanError("plan.kv_keep (selected slots) is read beside a recent window and no "
                        f"sinks: set kv_window=(0, recent), got {self.kv_window!r}")
      if len(self.kv_keep.k) != num_layers:
        raise PlanError(f"plan.kv_keep holds slots for {len(self.kv_keep.k)} layers, the model "
                        f"has {num_layers}: it was selected on another model")
    if self.weights is not None and len(self.weights.layers) != num_layers:
      raise PlanError(f"plan.weights cover {len(self.weights.layers)} layers, the model has "
                      f"{num_layers}: they were quantised from another model")
    if self.stop is not None and (jnp.shape(self.stop) != () or
                                  jnp.result_type(self.stop) != jnp.float32):
      raise PlanError(f"plan.stop must be a float32 scalar, got "
                      f"{jnp.result_type(self.stop)}{jnp.shape(self.stop)}")
    if self.vocab is not None and (self.vocab.ndim != 1 or self.vocab.dtype != jnp.int32):
      raise PlanError(f"plan.vocab must be int32[K], got {self.vocab.dtype}{self.vocab.shape}")
    if self.head_rows is not None:
      # float rows [K, D], an 8-bit head's codes [K, D], or GGUF blocks (shape [D, K])
      n = (self.head_rows.codes.shape[0] if hasattr(self.head_rows, "codes") else
           self.head_rows.shape[1] if hasattr(self.head_rows, "parts") else
           self.head_rows.shape[0])
      if self.vocab is None or n != self.vocab.shape[0]:
        raise PlanError(f"plan.head_rows hold {n} rows for a shortlist of "
                        f"{None if self.vocab is None else self.vocab.shape[0]} ids: gather "
                        f"them again after changing the shortlist")
    return self

  def with_shortlist(self, ids, vocab_size: int, eos_ids=(), size: int | None = None
                     ) -> DraftPlan:
    """This plan with a draft-head shortlist of `ids`, padded with -1 to `size`.

    The shortlist must hold every EOS id: a draft that cannot propose EOS would never let
    a generation end early. Ids must be distinct and inside the vocabulary."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
      raise PlanError(f"a shortlist is a non-empty 1-D list of token ids, got {arr.shape} "
                      f"{arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
      raise PlanError(f"shortlist ids must be in [0, {vocab_size}), got {arr.min()}..{arr.max()}")
    if np.unique(arr).size != arr.size:
      raise PlanError("shortlist ids must be distinct")
    missing = sorted(set(int(e) for e in eos_ids) - set(arr.tolist()))
    if missing:
      raise PlanError(f"the shortlist is missing EOS id(s) {missing}: the draft could never "
                      f"propose the end of the answer; add them")
    size = arr.size if size is None else size
    if size < arr.size:
      raise PlanError(f"shortlist of {arr.size} ids does not fit size {size}")
    padded = np.full(size, -1, np.int32)
    padded[: arr.size] = arr
    return self.replace(vocab=jnp.asarray(padded), head_rows=None)

  @property
  def active_fraction(self) -> float:
    """Share of the 2L sub-layers this plan runs (host-side, for reports)."""
    return float((np.sum(self.attn) + np.sum(self.mlp)) / (2 * self.num_layers))

  def to_json(self) -> dict:
    out = {"attn": np.asarray(self.attn).tolist(), "mlp": np.asarray(self.mlp).tolist()}
    if self.vocab is not None:
      out["vocab"] = np.asarray(self.vocab).tolist()
    return out

  @classmethod
  def from_json(cls, obj: dict) -> DraftPlan:
    try:
      return cls.from_masks(obj["attn"], obj["mlp"])
    except (KeyError, TypeError) as err:
      raise PlanError(f"a plan needs boolean lists 'attn' and 'mlp': {err}") from err


def _as_mask(values: Sequence[bool], name: str) -> np.ndarray:
  arr = np.asarray(values)
  if arr.ndim != 1:
    raise PlanError(f"{name} must be a 1-D list of booleans, got shape {arr.shape}")
  if arr.dtype != bool:
    if not np.isin(arr, (0, 1)).all():
      raise PlanError(f"{name} must hold booleans, got {arr.tolist()}")
    arr = arr.astype(bool)
  return arr


def save_plan(path: str | Path, plan: DraftPlan, *, model: str, **meta) -> None:
  """A plan file: the masks plus the model they were made for (checked on load)."""
  Path(path).write_text(json.dumps({"model": model, **plan.to_json(), **meta}, indent=1))


def load_plan(path: str | Path, *, model: str) -> DraftPlan:
  try:
    obj = json.loads(Path(path).read_text())
  except (OSError, ValueError) as err:
    raise PlanError(f"cannot read plan file {path}: {err}") from err
  if obj.get("model") not in (None, model):
    raise PlanError(f"plan file {path} was made for model {obj['model']!r}, not {model!r}")
  return DraftPlan.from_json(obj)
