"""Trace-time argument checks shared by the API and the expert-parallel entry points (a leaf module)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def check_activations(x: Any, hidden: int) -> None:
  """``x`` must be a bfloat16 ``[T, H]`` array with H = ``hidden`` (TypeError for type/rank, ValueError for H)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"moe: x must be an array, got {type(x).__name__}")
  if x.dtype != jnp.bfloat16:
    raise TypeError(f"moe: x must have dtype bfloat16, got {x.dtype} (convert with x.astype(jnp.bfloat16))")
  if x.ndim != 2:
    raise TypeError(f"moe: x must be rank 2 [T, H], got shape {list(x.shape)}")
  if x.shape[1] != hidden:
    raise ValueError(f"moe: x.shape[1] (H) must equal the experts' hidden size {hidden}, got {x.shape[1]}")
