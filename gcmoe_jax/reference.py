"""The oracle (`moe_emulated`) and the accuracy yardstick (`moe_bf16`).

`moe_emulated` is the exact definition of what every backend computes (DESIGN §2, docs/semantics.md). Where DESIGN
leaves an order of operations open, this module fixes it, and the C++ CPU handler follows it bit for bit:

* **Block dots.** A GEMM is a sequence of K32 blocks. For FP8 activations x FP4 weights the block dot
  ``D = sum_i (x_i * 2**9) * (w_i * 2)`` is an exact int32 (|D| < 2**27), and the block's contribution is
  ``p = f32(D) * 2**(ex + ew - 10)``. For FP8 x FP8 (the shared expert) each E4M3 value v is split into
  ``hi = 8 v`` (|v| >= 1, else 0) and ``lo = 512 v`` (|v| < 1, else 0), four exact int32 dots are formed and
  ``p = ((f32(Shh) * 2**-6 + f32(Shl + Slh) * 2**-12) + f32(Sll) * 2**-18) * 2**(ex + ew)``.
  Scaling by ``2**n`` is two exact multiplications by ``2**(n//2)`` and ``2**(n - n//2)``.
* **Accumulation.** ``acc = 0; for each block in increasing K: acc = acc + p`` in float32.
* **NaN.** A block whose activations hold a NaN contributes NaN (the int dot cannot carry it).
* **SwiGLU.** ``silu(g) = g / (1 + exp(-g))`` is evaluated in float64 and rounded to float32, for each of the 65536
  BF16 inputs (a table), so that every backend can reproduce it exactly.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import formats
from gcmoe_jax.formats import BLOCK, ExpertWeights, SharedWeights

__all__ = ["moe_emulated", "moe_bf16", "silu_table", "mxfp8"]


@functools.lru_cache(maxsize=None)
def silu_table() -> np.ndarray:
  """float32 ``silu(g)`` for every BF16 bit pattern ``g`` (index = the 16 bits), computed in float64."""
  bits = np.arange(1 << 16, dtype=np.uint32) << 16
  g = bits.view(np.float32)
  out = np.empty_like(g)
  for i, v in enumerate(g.tolist()):
    # math.exp is the C library's exp, the same function the C++ handler calls.
    if v != v:
      out[i] = v
    elif v == -math.inf:
      out[i] = -0.0
    elif -v > 709.0:
      out[i] = -0.0 if v < 0 else v  # exp(-v) overflows: silu(v) -> -0
    else:
      out[i] = v / (1.0 + math.exp(-v))
  return out.astype(np.float32)


def _bf16(v: jax.Array) -> jax.Array:
  return jnp.asarray(v).astype(jnp.bfloat16)


def _round_bf16(v: jax.Array) -> jax.Array:
  """float32 -> float32 on the BF16 grid (round to nearest even; NaN stays NaN, overflow goes to Inf).

  Integer arithmetic on the bits rather than a convert pair: XLA may drop an f32 -> bf16 -> f32 round trip
  (``xla_allow_excess_precision``), which would make the oracle skip a rounding on some backends.
  """
  u = jax.lax.bitcast_convert_type(jnp.asarray(v, jnp.float32), jnp.uint32)
  rounded = (u + jnp.uint32(0x7FFF) + ((u >> 16) & 1)) & jnp.uint32(0xFFFF0000)
  quiet_nan = (u & jnp.uint32(0xFFFF0000)) | jnp.uint32(0x00400000)
  out = jnp.where(jnp.isnan(v), quiet_nan, rounded)
  return jax.lax.bitcast_convert_type(out, jnp.float32)


def mxfp8(v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """MXFP8 of rows ``[M, K]``: (int32 values ``x * 2**9`` [M, K], NaN flags [M, K/32], exponents int32 [M, K/32]).

  The int32 form is exact: every E4M3 value is a multiple of ``2**-9``.
  """
  bits, sb = formats.quantize_mx(v, fmt="e4m3")
  vals = formats.decode_e4m3(bits)
  nan = jnp.isnan(vals)
  ints = jnp.where(nan, 0.0, vals * 512.0).astype(jnp.int32)
  m, k = ints.shape
  return ints, nan.reshape(m, k // BLOCK, BLOCK).any(-1), sb.astype(jnp.int32) - formats.UE8M0_BIAS


def _e4m3_split(ints: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``512 v`` -> (``8 v`` where |v| >= 1 else 0, ``512 v`` where |v| < 1 else 0)."""
  big = jnp.abs(ints) >= 512
  return jnp.where(big, ints // 64, 0), jnp.where(big, 0, ints)


def _gemm(x_ints, x_nan, x_exp, weight_block, num_blocks: int, n: int, fp8_weights: bool) -> jax.Array:
  """``acc[m, n] = sum over K32 blocks, in order, of p(m, n, b)`` (the module doc's block dots).

  Args:
    x_ints, x_nan, x_exp: `mxfp8` of the activations, [M, K], [M, K/32], [M, K/32].
    weight_block: ``b -> (w_ints [M or 1, N, 32] int32, w_exp [M or 1, N] int32)`` for K32 block b; FP4 weights
      as ``2 w``, FP8 weights as ``512 w``.
  """
  m = x_ints.shape[0]
  xb = x_ints.reshape(m, num_blocks, BLOCK)

  def step(acc, b):
    x = jax.lax.dynamic_index_in_dim(xb, b, axis=1, keepdims=False)[:, None, :]  # [M, 1, 32]
    w, w_exp = weight_block(b)
    if fp8_weights:
      xh, xl = _e4m3_split(x)
      wh, wl = _e4m3_split(w)
      shh = jnp.sum(xh * wh, axis=-1).astype(jnp.float32)
      sx = jnp.sum(xh * wl + xl * wh, axis=-1).astype(jnp.float32)
      sll = jnp.sum(xl * wl, axis=-1).astype(jnp.float32)
      p = (shh * 2.0**-6 + sx * 2.0**-12) + sll * 2.0**-18
      shift = 0
    else:
      p = jnp.sum(x * w, axis=-1).astype(jnp.float32)  # exact int32, |D| < 2**27
      shift = -10
    e = jax.lax.dynamic_index_in_dim(x_exp, b, axis=1)[:, :1] + w_exp + shift
    p = formats._scale_by_pow2(p, e)
    p = jnp.where(jax.lax.dynamic_index_in_dim(x_nan, b, axis=1), jnp.nan, p)
    return acc + p, None

  # Block 0 runs outside the scan so that the carry has the step's type (shard_map's check_vma rejects a carry
  # built from an unvarying jnp.zeros); the additions are the same, in the same order.
  acc, _ = step(jnp.zeros((m, n), jnp.float32), jnp.int32(0))
  acc, _ = jax.lax.scan(step, acc, jnp.arange(1, num_blocks))
  return acc


def _routed_block(payload: jax.Array, scales: jax.Array, eids: jax.Array):
  """Block fetcher for routed FP4 weights ``[E, K/128, N, 64]`` gathered per row's expert ``eids [M]``."""

  def fetch(b):
    kb, sub = b // 4, b % 4
    blk = jax.lax.dynamic_index_in_dim(payload, kb, axis=1, keepdims=False)  # [E, N, 64]
    blk = jax.lax.dynamic_slice_in_dim(blk, sub * 16, 16, axis=2)[eids]  # [M, N, 16]
    byte = jax.lax.bitcast_convert_type(blk, jnp.uint8)
    codes = jnp.stack([byte & 0xF, byte >> 4], axis=-1).reshape(*byte.shape[:2], BLOCK)
    ints = (formats.decode_e2m1(codes) * 2.0).astype(jnp.int32)
    words = jax.lax.dynamic_index_in_dim(scales, kb, axis=1, keepdims=False)[eids]  # [M, N] (scales MN-major)
    sbyte = (jax.lax.bitcast_convert_type(words, jnp.uint32) >> (8 * sub).astype(jnp.uint32)) & 0xFF
    return ints, sbyte.astype(jnp.int32) - formats.UE8M0_BIAS

  return fetch


def _shared_block(payload: jax.Array, scales: jax.Array, group: int):
  """Block fetcher for shared FP8 weights ``[K/128, N, 128]`` (same for every row)."""
  per_word = 4 * group // BLOCK  # K32 blocks covered by one int32 scale word

  def fetch(b):
    blk = jax.lax.dynamic_index_in_dim(payload, b // 4, axis=0, keepdims=False)  # [N, 128]
    blk = jax.lax.dynamic_slice_in_dim(blk, (b % 4) * BLOCK, BLOCK, axis=1)[None]  # [1, N, 32]
    ints = (formats.decode_e4m3(blk) * 512.0).astype(jnp.int32)
    words = jax.lax.dynamic_index_in_dim(scales, b // per_word, axis=1, keepdims=False)  # [N]
    byte_id = (b % per_word) // (group // BLOCK)
    sbyte = (jax.lax.bitcast_convert_type(words, jnp.uint32) >> (8 * byte_id).astype(jnp.uint32)) & 0xFF
    return ints, (sbyte.astype(jnp.int32) - formats.UE8M0_BIAS)[None]

  return fetch


def _swiglu(h: jax.Array, clamp: float | None) -> jax.Array:
  """``h`` [M, 2I] f32 in the stored gate/up interleave -> BF16 ``silu(min(g, c)) * clip(u, -c, c)`` [M, I]."""
  h = formats.gate_up_deinterleave(h)
  i = h.shape[-1] // 2
  g, u = _round_bf16(h[:, :i]), _round_bf16(h[:, i:])
  if clamp is not None:
    c = _round_bf16(jnp.float32(clamp))
    g = jnp.minimum(g, c)
    u = jnp.clip(u, -c, c)
  g_bits = jax.lax.bitcast_convert_type(g, jnp.uint32) >> 16
  s = jnp.asarray(silu_table())[g_bits.astype(jnp.int32)]
  return _round_bf16(s * u)


def _expert_mlp(x: jax.Array, row_weight: jax.Array, gemm1, gemm2, clamp) -> jax.Array:
  """Steps 1-5 of DESIGN §2 for rows ``[M, H]`` of BF16 values (held in float32); returns them likewise."""
  xi, xnan, xexp = mxfp8(x)
  hid = gemm1(xi, xnan, xexp)  # [M, 2I]
  a = _round_bf16(row_weight[:, None] * _swiglu(hid, clamp))
  ai, anan, aexp = mxfp8(a)
  return _round_bf16(gemm2(ai, anan, aexp))


def moe_emulated(x: jax.Array, w: ExpertWeights, ids: jax.Array, weights: jax.Array, *,
                 clamp: float | None = None) -> jax.Array:
  """The exact emulation of the operator (DESIGN §2) in `jax.numpy`; jit-able.

  Args:
    x: ``[T, H]`` bfloat16 activations.
    w: quantized experts (`formats.quantize_experts`).
    ids: ``[T, k]`` int32 expert ids; ids < 0 are padding. Ids >= E are not checked here (`gcmoe_jax.moe` does).
    weights: ``[T, k]`` float32 route weights.
    clamp: the SwiGLU clamp, or None.

  Returns:
    ``[T, H]`` bfloat16.
  """
  e, h, i = w.num_experts, w.hidden, w.intermediate
  t, k = ids.shape
  x = _bf16(x).astype(jnp.float32)
  if t == 0:
    return jnp.zeros((0, h), jnp.bfloat16)
  flat_ids = ids.reshape(-1).astype(jnp.int32)
  valid = flat_ids >= 0
  eids = jnp.where(valid, flat_ids, 0).clip(0, e - 1)
  rows = jnp.repeat(x, k, axis=0)  # [T*k, H], row t*k + j
  gemm1 = lambda xi, xn, xe: _gemm(xi, xn, xe, _routed_block(w.w13, w.w13_scale, eids), h // BLOCK, 2 * i, False)
  gemm2 = lambda xi, xn, xe: _gemm(xi, xn, xe, _routed_block(w.w2, w.w2_scale, eids), i // BLOCK, h, False)
  o = _expert_mlp(rows, weights.reshape(-1).astype(jnp.float32), gemm1, gemm2, clamp)
  o = jnp.where(valid[:, None], o, 0.0).reshape(t, k, h)
  acc = jnp.zeros((t, h), jnp.float32)
  for j in range(k):  # the fixed summation order of step 6
    acc = acc + o[:, j]
  if w.shared is not None:
    acc = acc + _shared_expert(x, w.shared, clamp)
  return _round_bf16(acc).astype(jnp.bfloat16)  # exact: the value is already on the BF16 grid


def _shared_expert(x: jax.Array, s: SharedWeights, clamp: float | None) -> jax.Array:
  h, i_s = s.hidden, s.intermediate
  gemm1 = lambda xi, xn, xe: _gemm(xi, xn, xe, _shared_block(s.s13, s.s13_scale, s.group), h // BLOCK, 2 * i_s, True)
  gemm2 = lambda xi, xn, xe: _gemm(xi, xn, xe, _shared_block(s.s2, s.s2_scale, s.group), i_s // BLOCK, h, True)
  return _expert_mlp(x, jnp.ones((x.shape[0],), jnp.float32), gemm1, gemm2, clamp)


def moe_bf16(x: jax.Array, w13: jax.Array, w2: jax.Array, ids: jax.Array, weights: jax.Array, *,
             shared: tuple[jax.Array, jax.Array] | None = None, clamp: float | None = None) -> jax.Array:
  """The dense BF16 MoE from unquantized weights: the accuracy yardstick.

  BF16 operands, FP32 accumulation and activation math, one BF16 rounding of y.

  Args:
    x: ``[T, H]`` activations; w13 ``[E, H, 2I]`` (gate = ``[..., :I]``); w2 ``[E, I, H]``; ids, weights ``[T, k]``;
    shared: optional ``(s13 [H, 2Is], s2 [Is, H])``; clamp: the SwiGLU clamp or None.
  """
  x = _bf16(x)
  e = w13.shape[0]

  def mlp(xr, a13, a2):
    hid = jnp.dot(xr, _bf16(a13), preferred_element_type=jnp.float32)
    i = hid.shape[-1] // 2
    g, u = hid[..., :i], hid[..., i:]
    if clamp is not None:
      g, u = jnp.minimum(g, clamp), jnp.clip(u, -clamp, clamp)
    return jax.nn.silu(g) * u

  valid = ids >= 0
  eids = jnp.where(valid, ids, 0).clip(0, e - 1)
  act = jax.vmap(lambda a13: mlp(x, a13, None))(jnp.asarray(w13))  # [E, T, I]: every expert, every token
  # Route weights per (expert, token); a token routed twice to one expert gets both weights.
  onehot = (eids[..., None] == jnp.arange(e)) & valid[..., None]  # [T, k, E]
  rw = jnp.einsum("tke,tk->et", onehot.astype(jnp.float32), weights.astype(jnp.float32))
  o = jnp.einsum("eti,eih->th", _bf16(act * rw[..., None]), _bf16(w2), preferred_element_type=jnp.float32)
  if shared is not None:
    o = o + jnp.dot(_bf16(mlp(x, shared[0], None)), _bf16(shared[1]), preferred_element_type=jnp.float32)
  return _bf16(o)
