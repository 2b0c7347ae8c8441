"""The window of verified tokens: the last W tokens verification committed, with the full
model's residual after every sub-layer at each. CLaSp's and KnapSpec's layer DPs score a
candidate plan against it (`selection.layer_probe`); both round drivers extend it, the
device loop inside its `while_loop` (`round_loop`), so it belongs to decoding.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Window:
  """The last W verified tokens with the full model's residuals after every sub-layer."""

  tokens: jax.Array  # int32[W] input token at each position
  positions: jax.Array  # int32[W]
  next_tokens: jax.Array  # int32[W] the token that followed (the target's choice)
  residuals: jax.Array  # [2L, W, D] full-model residual after each sub-layer
  valid: jax.Array  # bool[W]

  @property
  def size(self) -> int:
    return self.tokens.shape[0]


@jax.jit
def push_step(window: Window, residuals: jax.Array, last: jax.Array, committed: jax.Array,
               start: jax.Array, n_commit: jax.Array) -> Window:
  """Append one round's verified rows (the first n_commit of [last, accepted drafts]) and
  keep the newest W. residuals[2L, T, D] come from the verify pass, committed[T] are the
  round's committed tokens, `start` the position of `last`."""
  W, T = window.size, committed.shape[0]
  inputs = jnp.concatenate([last[None], committed[:-1]])

  def newest(old, new, axis=0):
    both = jnp.concatenate([old, new.astype(old.dtype)], axis=axis)
    return jax.lax.dynamic_slice_in_dim(both, n_commit, W, axis=axis)

  return Window(tokens=newest(window.tokens, inputs),
                positions=newest(window.positions, start + jnp.arange(T, dtype=jnp.int32)),
                next_tokens=newest(window.next_tokens, committed),
                residuals=newest(window.residuals, residuals, axis=1),
                valid=newest(window.valid, jnp.arange(T) < n_commit))
