"""OCP Microscaling (MX) formats and the Table 10 weight layouts.

The one rounding convention of the project (DESIGN §2):

* A block is 32 contiguous elements along the reduction (K) dimension (128 for the shared expert's optional
  K-group 128). Its scale exponent is ``e = ceil(log2(amax / max_elem))`` with ``max_elem`` 6 (E2M1) or 448 (E4M3),
  clamped to the UE8M0 range [-127, 127] and stored as the byte ``e + 127``. An all-zero block gets byte 127.
* Elements are ``round_nearest_even(v / 2**e)`` on the element grid, saturating at ``+-max_elem``.
* ``amax`` is taken over the finite elements only; a NaN or +-Inf element is encoded as E4M3 NaN (``0x7F``/``0xFF``)
  so it propagates to exactly the outputs that read it. Weights must be finite: `quantize_experts` rejects
  non-finite weights, and E2M1 (which has no NaN) is only used for weights.
* float32 subnormal inputs count as zero (XLA flushes denormals on CPU and GPU; the C++ handler does the same).
* E2M1 codes: bit 3 is the sign, bits 2..0 index the magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6). A value that rounds to
  zero is encoded +0 (code 0), whatever its sign.

Layouts (Table 10 of the paper; K is the reduction dimension, N the output dimension):

* routed payload  ``int8 [E, K/128, N, 64]``: for every (expert, K128 block, row n), 64 bytes holding the 128 E2M1
  codes of that block, element ``2i`` in the low nibble of byte ``i`` and element ``2i + 1`` in the high nibble;
* routed scales   ``int32 [E, K/128, N]`` (MN-major: the words of one K128 block are contiguous over the rows):
  byte ``i`` (little-endian, bits ``8i..8i+7``) of word ``[e, kb, n]`` is the UE8M0 scale of the K32 sub-block
  ``i`` of row n's K128 block kb. A kernel stage of 128 rows takes its words as one 512-B run, not 128 words
  K/128 apart;
* shared payload  ``int8 [K/128, N, 128]``: the E4M3 bytes of one K128 block of row n;
* shared scales   ``int32 [N, ceil(K / (4 * group))]``: four consecutive group scales per word (group 32 or 128),
  a ragged tail padded with byte 127.

W13's N is 2I. Its rows are stored gate/up-interleaved in groups of 8: stored row ``16q + i`` is gate row ``8q + i``
and stored row ``16q + 8 + i`` is up row ``8q + i`` (``i < 8``). An MMA fragment of 16 weight rows (m16 on SM120,
a warp's quarter of wgmma m64 on SM90) then holds, in each thread, the gate and the up value of the same
intermediate column (rows ``r`` and ``r + 8``), so the SwiGLU epilogue needs no data exchange between threads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = [
  "E2M1_MAX",
  "E4M3_MAX",
  "ExpertWeights",
  "SharedWeights",
  "decode_e2m1",
  "decode_e4m3",
  "decode_ue8m0",
  "dequantize_experts",
  "encode_e2m1",
  "encode_e4m3",
  "from_mxfp4",
  "gate_up_interleave",
  "gate_up_deinterleave",
  "pack_scales",
  "quantize_experts",
  "quantize_mx",
  "scale_exponent",
  "to_mxfp4",
  "unpack_scales",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
UE8M0_BIAS = 127
BLOCK = 32
K_TILE = 128  # K extent of one payload block: 128 FP4 values = 64 bytes, 128 FP8 values = 128 bytes.
_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        np.float32)


# ---------------------------------------------------------------------------------------------------------------
# Element and scale codecs (jax.numpy; they also accept numpy arrays and run under jit)
# ---------------------------------------------------------------------------------------------------------------


def scale_exponent(amax: jax.Array, max_elem: float) -> jax.Array:
  """The UE8M0 exponent ``ceil(log2(amax / max_elem))`` clamped to [-127, 127], computed exactly.

  Written with `frexp` instead of `log2` so that the result is exact for every float32 ``amax``: with
  ``amax = m * 2**p`` (m in [0.5, 1)) and ``max_elem = m_e * 2**p_e``, ``amax <= max_elem * 2**e`` holds for
  ``e >= p - p_e`` when ``m <= m_e`` and for ``e >= p - p_e + 1`` otherwise. ``amax == 0`` gives 0 (byte 127).
  """
  amax = jnp.asarray(amax, jnp.float32)
  m_e, p_e = math.frexp(max_elem)
  m, p = jnp.frexp(amax)
  e = p - p_e + jnp.where(m > m_e, 1, 0)
  e = jnp.where(amax > 0, e, 0)
  return jnp.clip(e, -UE8M0_BIAS, UE8M0_BIAS).astype(jnp.int32)


def _exp2(e: jax.Array) -> jax.Array:
  """Exact ``2.0**e`` in float32 for integer ``e`` in [-149, 127] (built from the exponent bits)."""
  e = jnp.asarray(e, jnp.int32)
  normal = jax.lax.bitcast_convert_type(jnp.clip(e + 127, 1, 254) << 23, jnp.float32)
  # 2**-127 .. 2**-149 are subnormal: a single mantissa bit.
  subnormal = jax.lax.bitcast_convert_type(jnp.int32(1) << jnp.clip(e + 149, 0, 22), jnp.float32)
  return jnp.where(e >= -126, normal, subnormal)


def _scale_by_pow2(v: jax.Array, e: jax.Array) -> jax.Array:
  """``v * 2**e`` for integer ``e`` in [-276, 254] as two exact multiplications (no overflow of the factors)."""
  e = jnp.asarray(e, jnp.int32)
  half = e // 2
  return v * _exp2(half) * _exp2(e - half)


def encode_e2m1(q: jax.Array) -> jax.Array:
  """E2M1 codes (uint8 in [0, 15]) of float32 values already divided by their block scale.

  Rounds to nearest even on the grid (0, 0.5, 1, 1.5, 2, 3, 4, 6) and saturates at 6.
  """
  q = jnp.asarray(q, jnp.float32)
  a = jnp.minimum(jnp.abs(q), E2M1_MAX)
  # The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; jnp.round is half-to-even, which on these
  # spacings is exactly E2M1's round-to-nearest-even (ties go to the code with an even mantissa bit).
  idx = jnp.where(a < 2.0, jnp.round(a * 2.0),
                  jnp.where(a < 4.0, jnp.round(a) + 2.0, jnp.round(a * 0.5) + 4.0))
  idx = idx.astype(jnp.uint8)
  sign = jnp.where((q < 0) & (idx > 0), jnp.uint8(8), jnp.uint8(0))
  return idx | sign


def decode_e2m1(codes: jax.Array) -> jax.Array:
  """Float32 values of E2M1 codes (uint8 in [0, 15])."""
  return jnp.asarray(_E2M1_VALUES)[jnp.asarray(codes).astype(jnp.int32) & 15]


def encode_e4m3(q: jax.Array) -> jax.Array:
  """E4M3 (``float8_e4m3fn``) bit patterns (uint8) of float32 values already divided by their block scale.

  Rounds to nearest even, saturates finite values at +-448, and maps NaN and +-Inf to NaN. Written with exact
  float32 arithmetic and integer assembly rather than a cast to float8: inside a fusion, XLA:GPU elides an
  f32 -> f8 -> f32 round trip, which would make the oracle skip the quantization on GPU.
  """
  q = jnp.asarray(q, jnp.float32)
  a = jnp.minimum(jnp.abs(q), E4M3_MAX)
  a = jnp.where(a < np.float32(np.finfo(np.float32).tiny), 0.0, a)  # float32 subnormals flush to zero
  _, p = jnp.frexp(jnp.where(a > 0, a, 1.0))
  e = jnp.maximum(p - 1, -6)  # floor(log2 a); below 2**-6 the grid is the subnormal one, spacing 2**-9
  m = jnp.round(_scale_by_pow2(a, 3 - e))  # a / 2**e * 8, exact; then round half to even
  code = jnp.where(e == -6, m, (e + 7) * 8 + (m - 8)).astype(jnp.int32)  # m == 16 carries into the exponent
  code = jnp.where(a == 0, 0, code)
  sign = jnp.where(jnp.signbit(q), 0x80, 0)
  code = jnp.where(jnp.isfinite(q), code | sign, 0x7F | sign)
  return code.astype(jnp.uint8)


_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def decode_e4m3(bits: jax.Array) -> jax.Array:
  """Float32 values of E4M3 bit patterns (uint8 or int8), by table (no float8 conversion for XLA to elide)."""
  bits = jnp.asarray(bits)
  if bits.dtype != jnp.uint8:
    bits = jax.lax.bitcast_convert_type(bits.astype(jnp.int8), jnp.uint8)
  return jnp.asarray(_E4M3_VALUES)[bits.astype(jnp.int32)]


def decode_ue8m0(scale_bytes: jax.Array) -> jax.Array:
  """Float32 ``2**(byte - 127)`` of UE8M0 scale bytes (byte 255, NaN in the MX spec, is never produced here)."""
  return _exp2(jnp.asarray(scale_bytes).astype(jnp.int32) - UE8M0_BIAS)


def quantize_mx(v: jax.Array, *, fmt: str, group: int = BLOCK) -> tuple[jax.Array, jax.Array]:
  """Quantizes along the last axis in blocks of ``group`` elements.

  Args:
    v: float array ``[..., K]`` with ``K % group == 0``.
    fmt: ``"e2m1"`` or ``"e4m3"``.
    group: block length along K (32, or 128 for the shared expert's K-group 128).

  Returns:
    ``(codes, scale_bytes)``: codes uint8 ``[..., K]`` (E2M1 codes or E4M3 bits) and UE8M0 bytes uint8
    ``[..., K / group]``.
  """
  v = jnp.asarray(v).astype(jnp.float32)
  k = v.shape[-1]
  if k % group:
    raise ValueError(f"quantize_mx: the last dimension must be a multiple of {group}, got {k}")
  max_elem, encode = {"e2m1": (E2M1_MAX, encode_e2m1), "e4m3": (E4M3_MAX, encode_e4m3)}[fmt]
  blocks = v.reshape(*v.shape[:-1], k // group, group)
  amax = jnp.max(jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), 0.0), axis=-1)
  e = scale_exponent(amax, max_elem)
  q = _scale_by_pow2(blocks, -e[..., None])
  codes = encode(q).reshape(v.shape)
  return codes, (e + UE8M0_BIAS).astype(jnp.uint8)


def pack_scales(scale_bytes: jax.Array) -> jax.Array:
  """Packs UE8M0 bytes ``[..., G]`` four per int32 ``[..., ceil(G/4)]`` (byte i of a word = group 4w+i).

  A ragged tail is padded with byte 127 (scale 1).
  """
  b = jnp.asarray(scale_bytes).astype(jnp.uint32)
  g = b.shape[-1]
  pad = (-g) % 4
  if pad:
    b = jnp.concatenate([b, jnp.full((*b.shape[:-1], pad), UE8M0_BIAS, jnp.uint32)], axis=-1)
  b = b.reshape(*b.shape[:-1], -1, 4)
  word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
  return jax.lax.bitcast_convert_type(word, jnp.int32)


def unpack_scales(words: jax.Array, groups: int | None = None) -> jax.Array:
  """Inverse of `pack_scales`: int32 ``[..., W]`` -> uint8 ``[..., groups]`` (default ``4 W``)."""
  w = jax.lax.bitcast_convert_type(jnp.asarray(words, jnp.int32), jnp.uint32)
  b = jnp.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=-1).astype(jnp.uint8)
  b = b.reshape(*w.shape[:-1], 4 * w.shape[-1])
  return b if groups is None else b[..., :groups]


# ---------------------------------------------------------------------------------------------------------------
# Tile layouts
# ---------------------------------------------------------------------------------------------------------------


def _pack_fp4_payload(codes: jax.Array) -> jax.Array:
  """E2M1 codes ``[E, N, K]`` -> int8 payload ``[E, K/128, N, 64]``."""
  e, n, k = codes.shape
  c = codes.astype(jnp.uint8).reshape(e, n, k // 2, 2)
  byte = c[..., 0] | (c[..., 1] << 4)
  byte = byte.reshape(e, n, k // K_TILE, K_TILE // 2).transpose(0, 2, 1, 3)
  return jax.lax.bitcast_convert_type(byte, jnp.int8)


def _routed_scales(scale_bytes: jax.Array) -> jax.Array:
  """UE8M0 bytes ``[E, N, K/32]`` -> the routed scale words ``[E, K/128, N]`` (MN-major)."""
  return jnp.swapaxes(pack_scales(scale_bytes), 1, 2)


def _routed_scale_bytes(words: jax.Array, groups: int) -> jax.Array:
  """Inverse of `_routed_scales`: ``[E, K/128, N]`` -> uint8 ``[E, N, groups]``."""
  return unpack_scales(jnp.swapaxes(words, 1, 2), groups)


def _unpack_fp4_payload(payload: jax.Array) -> jax.Array:
  """int8 payload ``[E, K/128, N, 64]`` -> E2M1 codes uint8 ``[E, N, K]``."""
  e, kb, n, _ = payload.shape
  byte = jax.lax.bitcast_convert_type(jnp.asarray(payload, jnp.int8), jnp.uint8).transpose(0, 2, 1, 3)
  codes = jnp.stack([byte & 0xF, byte >> 4], axis=-1)
  return codes.reshape(e, n, kb * K_TILE)


def gate_up_interleave(w: jax.Array, axis: int = -1) -> jax.Array:
  """Reorders ``[gate | up]`` (each I wide along ``axis``) into the stored 8-row interleave of the module doc."""
  w = jnp.moveaxis(jnp.asarray(w), axis, -1)
  two_i = w.shape[-1]
  gate, up = w[..., : two_i // 2], w[..., two_i // 2:]
  lead = w.shape[:-1]
  q = two_i // 16
  out = jnp.stack([gate.reshape(*lead, q, 8), up.reshape(*lead, q, 8)], axis=-2).reshape(*lead, two_i)
  return jnp.moveaxis(out, -1, axis)


def gate_up_deinterleave(w: jax.Array, axis: int = -1) -> jax.Array:
  """Inverse of `gate_up_interleave`: stored order -> ``[gate | up]``."""
  w = jnp.moveaxis(jnp.asarray(w), axis, -1)
  two_i = w.shape[-1]
  lead = w.shape[:-1]
  g = w.reshape(*lead, two_i // 16, 2, 8)
  half = two_i // 2
  out = jnp.concatenate([g[..., 0, :].reshape(*lead, half), g[..., 1, :].reshape(*lead, half)], axis=-1)
  return jnp.moveaxis(out, -1, axis)


# ---------------------------------------------------------------------------------------------------------------
# Weight containers
# ---------------------------------------------------------------------------------------------------------------


def _check_array(owner: str, name: str, a: Any, shape: tuple[int, ...], dtype: Any) -> None:
  if getattr(a, "dtype", None) != np.dtype(dtype):
    raise TypeError(f"{owner}: {name} must have dtype {np.dtype(dtype).name}, got {getattr(a, 'dtype', type(a))}")
  if tuple(a.shape) != tuple(shape):
    raise ValueError(f"{owner}: {name} must have shape {list(shape)}, got {list(a.shape)}")


def _is_placeholder(a: Any) -> bool:
  # Containers built by hand from objects that are not arrays (specs, None) skip the array checks.
  return not hasattr(a, "shape") or not hasattr(a, "dtype")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SharedWeights:
  """The shared expert in MXFP8 (Table 10 shared layouts).

  Attributes:
    s13: int8 ``[H/128, 2 Is, 128]`` E4M3 payload of the fused gate/up projection (rows gate/up interleaved).
    s13_scale: int32 ``[2 Is, ceil(H / (4 group))]`` packed UE8M0 scales.
    s2: int8 ``[Is/128, H, 128]`` E4M3 payload of the down projection.
    s2_scale: int32 ``[H, ceil(Is / (4 group))]``.
    hidden, intermediate: H and Is.
    group: the K-group of the scales, 32 or 128.
  """

  s13: jax.Array
  s13_scale: jax.Array
  s2: jax.Array
  s2_scale: jax.Array
  hidden: int
  intermediate: int
  group: int = 128

  def __post_init__(self):
    h, i_s, g = self.hidden, self.intermediate, self.group
    if g not in (32, 128):
      raise ValueError(f"SharedWeights: group must be 32 or 128, got {g}")
    _check_dim("SharedWeights", "hidden", h, 512, 8192)
    _check_dim("SharedWeights", "intermediate", i_s, 256, 4096)
    if any(_is_placeholder(a) for a in (self.s13, self.s13_scale, self.s2, self.s2_scale)):
      return
    _check_array("SharedWeights", "s13", self.s13, (h // K_TILE, 2 * i_s, K_TILE), np.int8)
    _check_array("SharedWeights", "s13_scale", self.s13_scale, (2 * i_s, -(-h // (4 * g))), np.int32)
    _check_array("SharedWeights", "s2", self.s2, (i_s // K_TILE, h, K_TILE), np.int8)
    _check_array("SharedWeights", "s2_scale", self.s2_scale, (h, -(-i_s // (4 * g))), np.int32)

  def tree_flatten(self):
    return (self.s13, self.s13_scale, self.s2, self.s2_scale), (self.hidden, self.intermediate, self.group)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return _unchecked(cls, (*children, *aux))


def _unchecked(cls, values):
  """Rebuilds a container without the construction checks: pytree transformations (shard_map's per-shard views,
  vmap, tree_map to shardings) legitimately hold leaves of other shapes than the static config describes."""
  obj = object.__new__(cls)
  for f, v in zip(dataclasses.fields(cls), values):
    object.__setattr__(obj, f.name, v)
  return obj


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
  """Routed experts in MXFP4 (Table 10 routed layouts), plus an optional shared expert.

  Attributes:
    w13: int8 ``[E, H/128, 2I, 64]`` packed E2M1 payload of the fused gate/up projection (rows gate/up interleaved,
      see the module doc).
    w13_scale: int32 ``[E, H/128, 2I]`` packed UE8M0 scales (MN-major, see the module doc).
    w2: int8 ``[E, I/128, H, 64]`` packed E2M1 payload of the down projection.
    w2_scale: int32 ``[E, I/128, H]``.
    shared: the shared expert, or None.
    num_experts, hidden, intermediate: E, H and I (static).
  """

  w13: jax.Array
  w13_scale: jax.Array
  w2: jax.Array
  w2_scale: jax.Array
  shared: SharedWeights | None
  num_experts: int
  hidden: int
  intermediate: int

  def __post_init__(self):
    e, h, i = self.num_experts, self.hidden, self.intermediate
    if not isinstance(e, int) or e < 1:
      raise ValueError(f"ExpertWeights: num_experts must be a positive int, got {e!r}")
    _check_dim("ExpertWeights", "hidden", h, 512, 8192)
    _check_dim("ExpertWeights", "intermediate", i, 256, 4096)
    if self.shared is not None:
      if not isinstance(self.shared, SharedWeights):
        raise TypeError(f"ExpertWeights: shared must be SharedWeights or None, got {type(self.shared).__name__}")
      if self.shared.hidden != h:
        raise ValueError(f"ExpertWeights: shared expert hidden size must equal H = {h}, got {self.shared.hidden}")
    if any(_is_placeholder(a) for a in (self.w13, self.w13_scale, self.w2, self.w2_scale)):
      return
    _check_array("ExpertWeights", "w13", self.w13, (e, h // K_TILE, 2 * i, K_TILE // 2), np.int8)
    _check_array("ExpertWeights", "w13_scale", self.w13_scale, (e, h // K_TILE, 2 * i), np.int32)
    _check_array("ExpertWeights", "w2", self.w2, (e, i // K_TILE, h, K_TILE // 2), np.int8)
    _check_array("ExpertWeights", "w2_scale", self.w2_scale, (e, i // K_TILE, h), np.int32)

  @property
  def config(self) -> tuple[int, int, int, int | None, int | None]:
    """``(E, H, I, Is, shared_group)``: what an op specialises on (Is and group are None without shared)."""
    s = self.shared
    return (self.num_experts, self.hidden, self.intermediate,
            None if s is None else s.intermediate, None if s is None else s.group)

  def tree_flatten(self):
    return ((self.w13, self.w13_scale, self.w2, self.w2_scale, self.shared),
            (self.num_experts, self.hidden, self.intermediate))

  @classmethod
  def tree_unflatten(cls, aux, children):
    return _unchecked(cls, (*children, *aux))


def _check_dim(owner: str, name: str, value: Any, lo: int, hi: int) -> None:
  # Table 10: H multiple of 128 in [512, 8192], I multiple of 128 in [256, 4096].
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
  if value % K_TILE or not lo <= value <= hi:
    raise ValueError(f"{owner}: {name} must be a multiple of 128 in [{lo}, {hi}] (Table 10), got {value}")


# ---------------------------------------------------------------------------------------------------------------
# Weight transforms
# ---------------------------------------------------------------------------------------------------------------


def _require_finite(name: str, w: jax.Array) -> None:
  if isinstance(w, jax.core.Tracer):
    return  # Checked eagerly only: a traced transform cannot raise on values (documented in docs/semantics.md).
  bad = ~np.isfinite(np.asarray(w, np.float32))
  if bad.any():
    where = tuple(int(v) for v in np.argwhere(bad)[0])
    raise ValueError(f"quantize_experts: {name} must be finite, got {int(bad.sum())} non-finite value(s), "
                     f"the first at index {where}")


@functools.partial(jax.jit, static_argnames=("gate_up",))
def _quantize_routed(w: jax.Array, gate_up: bool = False) -> tuple[jax.Array, jax.Array]:
  """``[E, K, N]`` (x @ W orientation) -> (payload ``[E, K/128, N, 64]``, scales ``[E, K/128, N]``).

  Jitted: eagerly, the transform is ~100 small ops, each compiled on first use.
  """
  if gate_up:
    w = gate_up_interleave(w)
  codes, sb = quantize_mx(jnp.swapaxes(w, 1, 2), fmt="e2m1")
  return _pack_fp4_payload(codes), _routed_scales(sb)


@functools.partial(jax.jit, static_argnames=("group", "gate_up"))
def _quantize_shared(w: jax.Array, group: int, gate_up: bool = False) -> tuple[jax.Array, jax.Array]:
  """``[K, N]`` -> (payload int8 ``[K/128, N, 128]``, scales int32 ``[N, ceil(K / (4 group))]``)."""
  if gate_up:
    w = gate_up_interleave(w)
  k, n = w.shape
  codes, sb = quantize_mx(w.T, fmt="e4m3", group=group)
  payload = codes.reshape(n, k // K_TILE, K_TILE).transpose(1, 0, 2)
  return jax.lax.bitcast_convert_type(payload, jnp.int8), pack_scales(sb)


def _as_float(name: str, w: Any) -> jax.Array:
  w = jnp.asarray(w)
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"quantize_experts: {name} must be a floating array (bfloat16 or float32), got {w.dtype}")
  return w.astype(jnp.float32)


def quantize_experts(w13: jax.Array, w2: jax.Array, *, shared: tuple[jax.Array, jax.Array] | None = None,
                     shared_group: int = 128) -> ExpertWeights:
  """Quantizes BF16/F32 expert weights into the Table 10 layouts.

  Args:
    w13: ``[E, H, 2I]`` float: the fused gate/up projection in ``x @ W`` orientation, gate = ``[..., :I]``,
      up = ``[..., I:]``.
    w2: ``[E, I, H]`` float: the down projection.
    shared: optional shared expert ``(s13 [H, 2Is], s2 [Is, H])``, quantized to MXFP8.
    shared_group: K-group of the shared expert's scales, 32 or 128.

  Returns:
    `ExpertWeights` with MXFP4 routed experts and, if given, MXFP8 shared weights.

  Raises:
    TypeError, ValueError: for shapes outside Table 10, non-float dtypes or non-finite weights.
  """
  w13, w2 = _as_float("w13", w13), _as_float("w2", w2)
  if w13.ndim != 3 or w2.ndim != 3:
    raise ValueError(f"quantize_experts: w13 must be [E, H, 2I] and w2 [E, I, H], got shapes "
                     f"{list(w13.shape)} and {list(w2.shape)}")
  e, h, two_i = w13.shape
  if two_i % 2 or w2.shape != (e, two_i // 2, h):
    raise ValueError(f"quantize_experts: w2 must have shape [E, I, H] = {[e, two_i // 2, h]} to match w13 "
                     f"{list(w13.shape)}, got {list(w2.shape)}")
  _check_dim("quantize_experts", "H (w13.shape[1])", h, 512, 8192)
  _check_dim("quantize_experts", "I (w13.shape[2] / 2)", two_i // 2, 256, 4096)
  _require_finite("w13", w13)
  _require_finite("w2", w2)
  p13, s13 = _quantize_routed(w13, gate_up=True)
  p2, s2 = _quantize_routed(w2)
  sw = None
  if shared is not None:
    sw = _quantize_shared_pair(shared, h, shared_group)
  return ExpertWeights(p13, s13, p2, s2, sw, e, h, two_i // 2)


def _quantize_shared_pair(shared: Any, h: int, group: int) -> SharedWeights:
  if not isinstance(shared, (tuple, list)) or len(shared) != 2:
    raise TypeError(f"quantize_experts: shared must be a pair (s13 [H, 2Is], s2 [Is, H]), got {type(shared)}")
  if group not in (32, 128):
    raise ValueError(f"quantize_experts: shared_group must be 32 or 128, got {group}")
  s13, s2 = _as_float("shared[0] (s13)", shared[0]), _as_float("shared[1] (s2)", shared[1])
  if s13.ndim != 2 or s13.shape[0] != h or s13.shape[1] % 2:
    raise ValueError(f"quantize_experts: shared s13 must have shape [H, 2Is] with H = {h}, got {list(s13.shape)}")
  i_s = s13.shape[1] // 2
  if s2.shape != (i_s, h):
    raise ValueError(f"quantize_experts: shared s2 must have shape [Is, H] = {[i_s, h]}, got {list(s2.shape)}")
  _check_dim("quantize_experts", "Is (s13.shape[1] / 2)", i_s, 256, 4096)
  _require_finite("shared s13", s13)
  _require_finite("shared s2", s2)
  p13, sc13 = _quantize_shared(s13, group, gate_up=True)
  p2, sc2 = _quantize_shared(s2, group)
  return SharedWeights(p13, sc13, p2, sc2, h, i_s, group)


def _dequantize_routed(payload: jax.Array, scales: jax.Array) -> jax.Array:
  """payload ``[E, K/128, N, 64]`` + scales ``[E, K/128, N]`` -> float32 ``[E, K, N]``."""
  codes = _unpack_fp4_payload(payload)  # [E, N, K]
  e, n, k = codes.shape
  s = decode_ue8m0(_routed_scale_bytes(scales, k // BLOCK))  # [E, N, K/32]
  v = decode_e2m1(codes).reshape(e, n, k // BLOCK, BLOCK) * s[..., None]
  return jnp.swapaxes(v.reshape(e, n, k), 1, 2)


def _dequantize_shared(payload: jax.Array, scales: jax.Array, group: int) -> jax.Array:
  """payload ``[K/128, N, 128]`` + scales ``[N, ceil(K/(4 group))]`` -> float32 ``[K, N]``."""
  kb, n, _ = payload.shape
  k = kb * K_TILE
  v = decode_e4m3(payload).transpose(1, 0, 2).reshape(n, k // group, group)
  s = decode_ue8m0(unpack_scales(scales, k // group))
  return (v * s[..., None]).reshape(n, k).T


def dequantize_experts(w: ExpertWeights) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None]:
  """Inverse transform (for tests and debugging): float32 ``(w13 [E, H, 2I], w2 [E, I, H], shared or None)``."""
  w13 = gate_up_deinterleave(_dequantize_routed(w.w13, w.w13_scale))
  w2 = _dequantize_routed(w.w2, w.w2_scale)
  shared = None
  if w.shared is not None:
    s = w.shared
    shared = (gate_up_deinterleave(_dequantize_shared(s.s13, s.s13_scale, s.group)),
              _dequantize_shared(s.s2, s.s2_scale, s.group))
  return w13, w2, shared


# ---------------------------------------------------------------------------------------------------------------
# MXFP4 checkpoints (gpt-oss style): blocks uint8 [E, N, K/32, 16], scales uint8 [E, N, K/32]
# ---------------------------------------------------------------------------------------------------------------

_GATE_UP_ORDERS = ("interleaved", "concatenated")


def _checkpoint_to_codes(name: str, blocks: Any, scales: Any) -> tuple[jax.Array, jax.Array]:
  blocks, scales = jnp.asarray(blocks), jnp.asarray(scales)
  if blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
    raise TypeError(f"from_mxfp4: {name} blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
  if blocks.ndim != 4 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:3]:
    raise ValueError(f"from_mxfp4: {name} blocks must be [E, N, K/32, 16] and scales [E, N, K/32], got "
                     f"{list(blocks.shape)} and {list(scales.shape)}")
  e, n, kb, _ = blocks.shape
  codes = jnp.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(e, n, kb * BLOCK)
  return codes, scales


def from_mxfp4(w13_blocks: jax.Array, w13_scales: jax.Array, w2_blocks: jax.Array, w2_scales: jax.Array, *,
               gate_up: str = "interleaved", shared: tuple[jax.Array, jax.Array] | None = None,
               shared_group: int = 128) -> ExpertWeights:
  """Repacks an MXFP4 checkpoint into `ExpertWeights` without requantizing (codes and scales are kept as is).

  Args:
    w13_blocks: uint8 ``[E, 2I, H/32, 16]``: two E2M1 codes per byte (element 2i in the low nibble), rows are
      output features.
    w13_scales: uint8 ``[E, 2I, H/32]`` UE8M0 bytes.
    w2_blocks: uint8 ``[E, H, I/32, 16]``.
    w2_scales: uint8 ``[E, H, I/32]``.
    gate_up: row order of ``w13_blocks``: ``"interleaved"`` (gpt-oss: even rows gate, odd rows up) or
      ``"concatenated"`` (first I rows gate, then up).
    shared: optional float shared expert ``(s13 [H, 2Is], s2 [Is, H])``, quantized to MXFP8.
    shared_group: 32 or 128.
  """
  if gate_up not in _GATE_UP_ORDERS:
    raise ValueError(f"from_mxfp4: gate_up must be one of {_GATE_UP_ORDERS}, got {gate_up!r}")
  c13, s13 = _checkpoint_to_codes("w13", w13_blocks, w13_scales)
  c2, s2 = _checkpoint_to_codes("w2", w2_blocks, w2_scales)
  e, two_i, h = c13.shape
  if c2.shape != (e, h, two_i // 2):
    raise ValueError(f"from_mxfp4: w2 blocks must describe [E, H, I] = {[e, h, two_i // 2]} to match w13, got "
                     f"{list(c2.shape)}")
  _check_dim("from_mxfp4", "H", h, 512, 8192)
  _check_dim("from_mxfp4", "I", two_i // 2, 256, 4096)
  if gate_up == "interleaved":
    order = np.concatenate([np.arange(0, two_i, 2), np.arange(1, two_i, 2)])
    c13, s13 = c13[:, order], s13[:, order]
  # Rows are now [gate | up]; bring them into the stored 8-row interleave.
  c13 = gate_up_interleave(c13, axis=1)
  s13 = gate_up_interleave(s13, axis=1)
  sw = None if shared is None else _quantize_shared_pair(shared, h, shared_group)
  return ExpertWeights(_pack_fp4_payload(c13), _routed_scales(s13), _pack_fp4_payload(c2), _routed_scales(s2), sw,
                       e, h, two_i // 2)


def to_mxfp4(w: ExpertWeights, *, gate_up: str = "interleaved") -> tuple[jax.Array, ...]:
  """Exports the routed experts as a gpt-oss style checkpoint ``(w13_blocks, w13_scales, w2_blocks, w2_scales)``."""
  if gate_up not in _GATE_UP_ORDERS:
    raise ValueError(f"to_mxfp4: gate_up must be one of {_GATE_UP_ORDERS}, got {gate_up!r}")

  def export(payload, scales, deinterleave):
    codes = _unpack_fp4_payload(payload)  # [E, N, K]
    e, n, k = codes.shape
    sb = _routed_scale_bytes(scales, k // BLOCK)
    if deinterleave:
      codes, sb = gate_up_deinterleave(codes, axis=1), gate_up_deinterleave(sb, axis=1)
      if gate_up == "interleaved":
        order = np.stack([np.arange(n // 2), np.arange(n // 2, n)], axis=1).reshape(-1)
        codes, sb = codes[:, order], sb[:, order]
    c = codes.reshape(e, n, k // BLOCK, 16, 2)
    return (c[..., 0] | (c[..., 1] << 4)).astype(jnp.uint8), sb

  b13, s13 = export(w.w13, w.w13_scale, True)
  b2, s2 = export(w.w2, w.w2_scale, False)
  return b13, s13, b2, s2
