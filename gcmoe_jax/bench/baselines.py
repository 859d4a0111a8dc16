"""BF16 MoE baselines for the benchmark: what a JAX user would write without gcmoe_jax.

Both compute the same function as `reference.moe_bf16` (BF16 operands, FP32 accumulation and SwiGLU, the route
weight applied to the activation before the down projection, one BF16 rounding of y), with different data movement:

* `ragged_dot_moe`: the T*k (token, slot) rows sorted by expert, one `jax.lax.ragged_dot` per GEMM (grouped GEMM);
  touches each hit expert's weights once.
* `dense_gather_moe`: per slot j, gather every token's expert weights ``[T, H, 2I]`` and contract with einsum;
  touches T*k expert copies (memory grows with T; the sweep skips it above a byte budget).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dense_gather_bytes", "dense_gather_moe", "ragged_dot_moe"]


def _swiglu(h: jax.Array, clamp: float | None) -> jax.Array:
  """float32 ``[M, 2I]`` (gate | up) -> float32 ``[M, I]``, as `reference.moe_bf16`."""
  i = h.shape[-1] // 2
  g, u = h[..., :i], h[..., i:]
  if clamp is not None:
    g, u = jnp.minimum(g, clamp), jnp.clip(u, -clamp, clamp)
  return jax.nn.silu(g) * u


def _shared(x: jax.Array, shared: tuple[jax.Array, jax.Array] | None, clamp: float | None) -> jax.Array | float:
  if shared is None:
    return 0.0
  s13, s2 = shared
  h = jnp.dot(x, s13.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  a = _swiglu(h, clamp).astype(jnp.bfloat16)
  return jnp.dot(a, s2.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def ragged_dot_moe(x: jax.Array, w13: jax.Array, w2: jax.Array, ids: jax.Array, weights: jax.Array, *,
                   shared: tuple[jax.Array, jax.Array] | None = None, clamp: float | None = None) -> jax.Array:
  """Grouped-GEMM BF16 MoE: rows sorted by expert, `jax.lax.ragged_dot` for both projections; jit-able.

  Args:
    x: ``[T, H]`` activations (cast to bfloat16).
    w13: bfloat16 ``[E, H, 2I]`` (gate = ``[..., :I]``); w2: bfloat16 ``[E, I, H]``.
    ids: int32 ``[T, k]`` (ids < 0: padding, dropped); weights: float32 ``[T, k]``.
    shared: optional bfloat16 ``(s13 [H, 2Is], s2 [Is, H])``; clamp: the SwiGLU clamp or None.

  Returns:
    bfloat16 ``[T, H]``.
  """
  x = x.astype(jnp.bfloat16)
  e = w13.shape[0]
  t, k = ids.shape
  flat = ids.reshape(-1)
  valid = flat >= 0
  # Padding rows join expert 0's group (their output is masked below): ragged_dot needs every row in a group.
  eid = jnp.where(valid, flat, 0)
  order = jnp.argsort(eid, stable=True)
  group_sizes = jnp.bincount(eid, length=e).astype(jnp.int32)
  rows = x[order // k]  # [T*k, H], sorted by expert
  h = jax.lax.ragged_dot(rows, w13.astype(jnp.bfloat16), group_sizes, preferred_element_type=jnp.float32)
  rw = jnp.where(valid, weights.reshape(-1).astype(jnp.float32), 0.0)[order]
  a = (_swiglu(h, clamp) * rw[:, None]).astype(jnp.bfloat16)
  o = jax.lax.ragged_dot(a, w2.astype(jnp.bfloat16), group_sizes, preferred_element_type=jnp.float32)
  o = jnp.zeros_like(o).at[order].set(o)  # back to (token, slot) order
  o = jnp.where(valid[:, None], o, 0.0).reshape(t, k, -1).sum(axis=1)
  return (o + _shared(x, shared, clamp)).astype(jnp.bfloat16)


def dense_gather_bytes(tokens: int, hidden: int, intermediate: int) -> int:
  """Bytes of the BF16 weights `dense_gather_moe` materialises for one slot (its peak temporary)."""
  return tokens * 3 * hidden * intermediate * 2


def dense_gather_moe(x: jax.Array, w13: jax.Array, w2: jax.Array, ids: jax.Array, weights: jax.Array, *,
                     shared: tuple[jax.Array, jax.Array] | None = None, clamp: float | None = None) -> jax.Array:
  """Gather-and-einsum BF16 MoE: each token's k experts' weights gathered, one slot at a time; jit-able.

  Args and returns: as `ragged_dot_moe`. Peak temporary memory is `dense_gather_bytes` (T copies of an expert).
  """
  x = x.astype(jnp.bfloat16)
  valid = ids >= 0
  eids = jnp.where(valid, ids, 0)
  acc = jnp.zeros(x.shape, jnp.float32)
  for j in range(ids.shape[1]):  # slot by slot, so that only T (not T*k) expert copies are live at once
    a13 = w13[eids[:, j]].astype(jnp.bfloat16)  # [T, H, 2I]
    h = jnp.einsum("th,thn->tn", x, a13, preferred_element_type=jnp.float32)
    rw = jnp.where(valid[:, j], weights[:, j].astype(jnp.float32), 0.0)
    a = (_swiglu(h, clamp) * rw[:, None]).astype(jnp.bfloat16)
    o = jnp.einsum("ti,tih->th", a, w2[eids[:, j]].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    acc = acc + jnp.where(valid[:, j, None], o, 0.0)
  return (acc + _shared(x, shared, clamp)).astype(jnp.bfloat16)
