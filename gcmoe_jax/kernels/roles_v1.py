"""Role kernels v1 (issue 5): dispatch, compute and finalize of the GC-MoE operator, straightforward and exact.

Three CuTe DSL kernels, one cubin each, that together compute `gcmoe_jax.reference.moe_emulated` bit for bit (the
math of docs/semantics.md) under the epoch and fault protocols of `gcmoe_jax.kernels.abi`. They favour being
obviously right over being fast: SIMT integer dot products, no tensor cores, no TMA, no pipelining.

**Parameters.** Every kernel takes exactly `abi.PARAMS`: 13 global pointers (PTX ``.param .u64 .ptr .global
.align 16``), then ``tokens`` (``.u32``, read as int32) and ``clamp`` (``.f32``). Unused pointers stay parameters.
Pointers must be 16-byte aligned (weights and activation rows are read with 16-byte vector loads).

**Launch.** Block = `THREADS` (the PTX carries ``.reqntid 256, 1, 1``: any other block size fails to launch, and
``.minnctapersm 1``), no dynamic shared memory (all SMEM is static, <= 43,024 B + the cubin's reservation), no
cluster. Warp roles: none; every thread of a CTA runs the same code. The grid is the runtime's choice:

* Role 1, dispatch (entry ``gcmoe_role1_dispatch_v1_0``): block 0 does the work, other blocks return. One CTA.
* Role 2, compute (``gcmoe_role2_compute_v1_0``): any grid G >= 1, read from ``%nctaid.x``.
* Role 3, finalize (``gcmoe_role3_finalize_v1_0``): any grid >= 1 (block b takes tokens b, b + grid, ...).

(The ``_0`` is CuTe DSL's per-trace suffix; `gcmoe_jax.kernels.build` records the exact symbol from the PTX.)

**Roles.** (``cur = header.epoch + 1``; T = min(tokens, capacity).)

1. Dispatch. Threads scan the assignments ``a = t k + j`` (a < T k): an id >= E records the fault (role 1, block,
   epoch cur, counter = the id, observed = a) once through a CAS on ``error_flag`` and is skipped; ids < 0 are
   padding. Thread e (e = tid, tid + 256, ...) then appends, in token order, every ``a`` with ``ids[a] == e`` to
   ``rows[e]``, stores ``count[e]``, and publishes ``ready[e] = cur`` with ``st.release.gpu`` (except
   ``header.stall_expert``, the test hook). For the v2 kernels it also appends each expert with rows to the call's
   active queue as it publishes it, and closes the queue with its final size once all are (`abi.active_queue`).
2. Compute. Work items, taken by CTA c as c, c + G, ...: first, with a shared expert, one item per token t < T
   (FP8 x FP8, route weight 1, output ``shared_out[t]``; no wait), then E * cpe routed items (expert e, sub-slice
   s), cpe = max(1, G // E). A routed item waits (thread 0, ``ld.acquire.gpu`` of ``ready[e]``, bounded by
   ``header.timeout_ns`` of ``%globaltimer``, left early when ``error_flag`` is set); on expiry it records the
   fault (role 2, block, epoch cur, counter e, observed ``ready[e]``) through the CAS and the CTA stops taking
   items (no trap, the context stays usable). Then rows r = s, s + cpe, ... < ``count[e]``: ``a = rows[e][r]``,
   ``t = a // k``, ``j = a % k``; the row runs the four phases below and lands in ``arena[a]``.
3. Finalize. ``error_flag != 0``: every ``y[t, h]`` (t < T) is NaN. Else ``acc = +0; acc += (ids[t, j] >= 0 ?
   f32(arena[t k + j, h]) : +0) for j in order; acc += f32(shared_out[t, h]) (with a shared expert);
   y = bf16(acc)``. Block 0 then stores ``epoch = cur`` as its last act.

**Role 2 phases of one row** (the whole CTA; ``__syncthreads`` between phases; ``Ie`` = I, or Is for shared):

* A. MXFP8 of ``x[t]``: thread per K32 block (H/32 <= 256) -> ``sAct`` (E4M3 values as int32 ``512 v``),
  ``sExp`` (UE8M0 exponent), ``sNan`` (the block held a NaN/Inf).
* B. GEMM1 + SwiGLU: thread per intermediate column i: the dot products of stored rows ``16 (i // 8) + i % 8``
  (gate) and ``+ 8`` (up), then ``a = bf16(w * bf16(silu(min(g, c)) * clip(u, -c, c)))`` -> ``sA`` (BF16 bits).
* C. MXFP8 of ``sA`` -> ``sAct``/``sExp``/``sNan`` (thread per K32 block).
* D. GEMM2: thread per output column h: ``o = bf16(dot)`` -> global.

**Exactness** (docs/semantics.md, `reference._gemm`): K32 block dots are exact int32 (FP8 ``512 v`` times FP4
``2 w``; FP8 x FP8 as four hi/lo dots); ``p = f32(D) * 2**(n >> 1) * 2**(n - (n >> 1))``; ``acc += p`` in increasing
K. Every float operation is inline PTX with an explicit rounding mode (``mul.rn.ftz``/``add.rn.ftz``: never
contracted into FMA) and flushes subnormals, as XLA does on CPU where the oracle runs (DAZ + FTZ: a product of a
subnormal scale factor is 0 there too). BF16 and E4M3 roundings are RNE in integer arithmetic; the UE8M0 exponent
comes from the amax's exponent and mantissa bits (`formats.scale_exponent`); SwiGLU reads the workspace's silu
table (no ``expf``); ``min``/``max`` propagate NaN (``min.NaN``), as XLA's do.

Constraints: Table 10 shapes (H, I, Is multiples of 128, H <= 8192, I, Is <= 4096), E >= 1, k >= 1, shared group
32 or 128; the workspace laid out by `abi.workspace_layout` for (E, capacity, k, H, shared), its silu table filled
and ``header.timeout_ns`` set (0 expires at the first poll); ``tokens <= capacity`` (larger values are clamped to
the capacity, negative ones to 0). Shared-expert E4M3 weights must be finite (a NaN byte would read as 480).
"""

from __future__ import annotations

import struct

import cutlass
from cutlass import Float32, Int32, Int64, Uint16, Uint64, cute

from gcmoe_jax import _config, formats
from gcmoe_jax.kernels import abi
from gcmoe_jax.kernels.build import Variant

__all__ = ["ROLE_NAMES", "THREADS", "RoleKernelsV1", "smem_bytes"]

THREADS = 256  # one CTA = 8 warps, all doing the same thing (no warp specialisation in v1)
COMBINE_COLS = abi.COMBINE_COLS  # columns of y per block of the combine (`RoleKernelsV1._combine`): 8 per thread
assert COMBINE_COLS == 8 * THREADS
MIN_CTAS_PER_SM = 1  # .minnctapersm 1: ptxas may use 255 registers at 256 threads (else it caps at 128 and spills)
POINTER_ALIGN = 16  # every pointer parameter (16-byte vector loads of weights and x rows)
ROLE_NAMES = ("gcmoe_role1_dispatch_v1", "gcmoe_role2_compute_v1", "gcmoe_role3_finalize_v1")

# ---- Formats (formats.py, docs/semantics.md) ----------------------------------------------------------------------
K32 = formats.BLOCK  # elements per scale block along K
K128 = formats.K_TILE  # elements per payload tile along K
SUBS = K128 // K32  # K32 sub-blocks per K128 tile (= scale bytes per routed scale word)
WORD_BYTES = 4
NIBBLES_PER_WORD = 8
FP4_SUB_WORDS = K32 // NIBBLES_PER_WORD  # 32 E2M1 codes = 16 bytes = 4 words
FP4_TILE_BYTES = K128 // 2
FP8_SUB_WORDS = K32 // WORD_BYTES  # 32 E4M3 bytes = 8 words
FP8_TILE_BYTES = K128
BF16_BYTES = 2
V4_BYTES = 16  # one ld.global.nc.v4.u32
BYTE_BITS = 8
X_SUB_WORDS = K32 // 2  # 32 BF16 activations = 16 words
V4_WORDS = 4  # words per 16-byte vector load
GATE_UP_GROUP = 8  # W13 stores gate rows 8q..8q+7, then up rows 8q..8q+7, as rows 16q..16q+15 (formats.py)

# ---- Float32 bit patterns -----------------------------------------------------------------------------------------
F32_ABS = 0x7FFFFFFF
F32_INF = 0x7F800000  # |bits| >= this: Inf or NaN
F32_SIGN = -0x80000000  # 0x80000000 as int32
F32_MANT = 0x7FFFFF
F32_HIDDEN = 0x800000
F32_MANT_BITS = 23
F32_QNAN = 0x7FC00000  # jnp.nan
F32_HIGH_HALF = -0x10000  # 0xFFFF0000 as int32: the BF16 in the high half of a word
BF16_QNAN = 0x7FC0
BF16_MASK = 0xFFFF
BF16_SIGN = 0x8000
BF16_SHIFT = 16  # a BF16 is the high half of a float32
BF16_ROUND = 0x7FFF  # RNE: add 0x7FFF + lsb, truncate
F32_BIAS = 127
F32_MIN_EXP = -126  # smallest normal exponent; 2**-127 .. 2**-149 are subnormal
F32_SUBNORMAL_BASE = 149  # 2**e = bit (e + 149) for subnormal e
F32_MAX_BIASED = 254

# ---- MX scales ------------------------------------------------------------------------------------------------------
UE8M0_BIAS = formats.UE8M0_BIAS
UE8M0_CLAMP = 127  # scale exponents are clamped to [-127, 127]
BYTE_MASK = 0xFF
SCALES_PER_WORD = 4  # UE8M0 bytes per int32 scale word (little-endian: byte i = bits 8i..8i+7)
# scale_exponent(amax, 448) for amax = (1 + F / 2**23) * 2**(E - 127): frexp gives p = E - 126, m = 1/2 + F / 2**24,
# and e = p - 9 + (m > 0.875) (frexp(448) = (0.875, 9)) = E - 135 + (F > 0x600000).
E4M3_SCALE_OFFSET = 126 + 9
E4M3_FREXP_MANT_LIMIT = 0x600000
E4M3_MAX_BITS = 0x43E00000  # 448.0: saturation of finite values
# E4M3 as int32 512 v from float32 bits (E, M = 1.F): v * 512 = M * 2**(E - 141); the quantum is 2**max(E - 121, 0)
# in units of 2**-9 (normals from 2**-6, whose float32 biased exponent is 121, have 3 mantissa bits).
E4M3_INT_SHIFT = F32_BIAS + F32_MANT_BITS - 9
E4M3_MIN_NORMAL_BIASED = F32_BIAS - 6
E4M3_MAX_SHIFT = 25  # M < 2**24: any shift >= 25 rounds to 0 (keeps LLVM shifts < 32)
# Decode of an E4M3 byte (weights) to 512 v: exponent field E, mantissa m: E = 0 -> m; else (8 + m) << (E - 1).
E4M3_MANT_BITS = 3
E4M3_EXP_MASK = 0xF
E4M3_MANT_MASK = 0x7
E4M3_HIDDEN = 8
E4M3_SIGN_BIT = 0x80
E4M3_ONE = 512  # |512 v| >= 512: the "hi" part of the FP8 x FP8 split (reference._e4m3_split)
E4M3_HI_SHIFT = 6  # hi = 8 v = (512 v) >> 6
# E2M1 magnitudes times 2 (0, 1, 2, 3, 4, 6, 8, 12), one nibble each, indexed by the code's low 3 bits.
E2M1_X2_TABLE = 0xC8643210
NIBBLE_BITS = 4
NIBBLE_MASK = 0xF
E2M1_SIGN = 0x8
E2M1_MAG_MASK = 0x7
FP4_DOT_SHIFT = -10  # (512 x) (2 w) = 2**10 x w
FP8_PART_SCALES = (-6, -12, -18)  # Shh, Shl + Slh, Sll (hi = 8 v, lo = 512 v)


def _i32(u: int) -> int:
  """An unsigned 32-bit constant as the int32 with the same bits."""
  return u - (1 << 32) if u >= 1 << 31 else u


def _f32_bits(v: float) -> int:
  return struct.unpack("<i", struct.pack("<f", v))[0]


F32_ONE = _f32_bits(1.0)
FP8_PART_BITS = tuple(_f32_bits(2.0**s) for s in FP8_PART_SCALES)


CTL_WORDS = 4  # role 2's broadcast slots: [ok, count]
SPIN_SLEEP_NS = 64  # nanosleep between polls of ready[e]: keeps the spinning CTAs off the memory system


def smem_bytes(variant: Variant) -> int:
  """Static SMEM of role 2 (sAct, sExp, sNan, sA, sCtl); roles 1 and 3 use none. At most 43,024 B (Table 10)."""
  k_max = max(variant.hidden, variant.intermediate, variant.shared_intermediate or 0)
  i_max = max(variant.intermediate, variant.shared_intermediate or 0)
  return 4 * k_max + 2 * 4 * (k_max // K32) + BF16_BYTES * i_max + 4 * CTL_WORDS


# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////////
# Scalar helpers: straight-line code on int32 bit patterns (floats never travel as DSL floats, so no DSL or NVVM
# rewrite can change a rounding).
# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////////


def _ptx1(code: str, *args) -> Int32:
  return cute.arch.inline_ptx(code, write_only_types=[Int32], read_only_args=list(args))


def _float_op(op: str, *args) -> Int32:
  """``op d, a[, b]`` on float32 bit patterns held in int32 values.

  The operands are first moved into .b32 registers inside the asm: a constant operand would otherwise reach the
  float instruction as an integer immediate, which ptxas rejects.
  """
  regs = ", ".join(f"_gm{i}" for i in range(len(args)))
  moves = " ".join(f"mov.b32 _gm{i}, {{$r{i}}};" for i in range(len(args)))
  return _ptx1(f"{{ .reg .b32 {regs}; {moves} {op} {{$w0}}, {regs}; }}", *args)


def _fmul(a, b) -> Int32:
  """float32 a * b, RNE, subnormals flushed (PTX: an explicit .rn is never fused into an FMA)."""
  return _float_op("mul.rn.ftz.f32", a, b)


def _fadd(a, b) -> Int32:
  return _float_op("add.rn.ftz.f32", a, b)


def _i2f(d) -> Int32:
  """float32(int32), RNE."""
  return _float_op("cvt.rn.f32.s32", d)


def _fmin_nan(a, b) -> Int32:
  return _float_op("min.NaN.f32", a, b)


def _fmax_nan(a, b) -> Int32:
  return _float_op("max.NaN.f32", a, b)


def _float_bits(v: Float32) -> Int32:
  return _ptx1("mov.b32 {$w0}, {$r0};", v)


def _bf16_rne(f) -> Int32:
  """BF16 bits (in the low 16 bits) of float32 bits ``f``, round to nearest even; NaN stays NaN."""
  lsb = (f >> BF16_SHIFT) & 1
  rounded = ((f + (BF16_ROUND + lsb)) >> BF16_SHIFT) & BF16_MASK
  is_nan = (f & F32_ABS) > F32_INF
  return cutlass.select_(is_nan, Int32(BF16_QNAN) | ((f >> BF16_SHIFT) & BF16_SIGN), rounded)


def _exp2_bits(e) -> Int32:
  """float32 bits of ``2**e`` for int e in [-149, 127], as `formats._exp2` (subnormal below 2**-126)."""
  normal = cutlass.min(cutlass.max(e + F32_BIAS, 1), F32_MAX_BIASED) << F32_MANT_BITS
  subnormal = Int32(1) << cutlass.min(cutlass.max(e + F32_SUBNORMAL_BASE, 0), F32_MANT_BITS - 1)
  return cutlass.select_(e >= F32_MIN_EXP, normal, subnormal)


def _scale_pow2(v, n) -> Int32:
  """``v * 2**(n // 2) * 2**(n - n // 2)`` (`formats._scale_by_pow2`; ``>>`` is floor division)."""
  half = n >> 1
  return _fmul(_fmul(v, _exp2_bits(half)), _exp2_bits(n - half))


def _e4m3_scale_exp(amax) -> Int32:
  """UE8M0 exponent of a block with largest finite magnitude bits ``amax`` (`formats.scale_exponent`, 448)."""
  exp = amax >> F32_MANT_BITS
  e = exp - E4M3_SCALE_OFFSET + cutlass.select_((amax & F32_MANT) > E4M3_FREXP_MANT_LIMIT, Int32(1), Int32(0))
  e = cutlass.min(cutlass.max(e, -UE8M0_CLAMP), UE8M0_CLAMP)
  return cutlass.select_(exp == 0, Int32(0), e)  # zero or subnormal amax (subnormals count as zero)


def _e4m3_int(q) -> Int32:
  """``512 * e4m3_rne(q)`` for finite float32 bits q (saturating at 448; a float32 zero or subnormal gives 0)."""
  a = cutlass.min(q & F32_ABS, E4M3_MAX_BITS)
  exp = a >> F32_MANT_BITS
  mant = (a & F32_MANT) | F32_HIDDEN
  qe = cutlass.max(exp - E4M3_MIN_NORMAL_BIASED, 0)
  shift = cutlass.min(E4M3_INT_SHIFT + qe - exp, E4M3_MAX_SHIFT)
  r = mant >> shift
  rem = mant & ((Int32(1) << shift) - 1)
  half = Int32(1) << (shift - 1)
  up = (rem > half) | ((rem == half) & ((r & 1) == 1))
  n = (r + cutlass.select_(up, Int32(1), Int32(0))) << qe
  n = cutlass.select_(exp == 0, Int32(0), n)
  return cutlass.select_(q < 0, -n, n)


def _e2m1_x2(word, i: int) -> Int32:
  """``2 w`` of the E2M1 code in nibble i (0..7) of a payload word (element 2m low nibble of byte m)."""
  code = (word >> (NIBBLE_BITS * i)) & NIBBLE_MASK
  mag = (Int32(_i32(E2M1_X2_TABLE)) >> ((code & E2M1_MAG_MASK) * NIBBLE_BITS)) & NIBBLE_MASK
  return cutlass.select_((code & E2M1_SIGN) != 0, -mag, mag)


def _e4m3_byte_int(word, i: int) -> Int32:
  """``512 v`` of the E4M3 byte i (0..3) of a word. (Weights are finite; the NaN byte would read as 480.)"""
  b = (word >> (BYTE_BITS * i)) & BYTE_MASK
  exp = (b >> E4M3_MANT_BITS) & E4M3_EXP_MASK
  m = b & E4M3_MANT_MASK
  mag = cutlass.select_(exp == 0, m, (m + E4M3_HIDDEN) << cutlass.max(exp - 1, 0))
  return cutlass.select_((b & E4M3_SIGN_BIT) != 0, -mag, mag)


def _split(v) -> tuple[Int32, Int32]:
  """``512 v`` -> (``8 v`` if |v| >= 1 else 0, ``512 v`` if |v| < 1 else 0) (`reference._e4m3_split`)."""
  big = (v >= E4M3_ONE) | (v <= -E4M3_ONE)
  return cutlass.select_(big, v >> E4M3_HI_SHIFT, Int32(0)), cutlass.select_(big, Int32(0), v)


def _block_p_fp4(xs, words, ex, ew, xnan) -> Int32:
  """float32 bits of one K32 block's contribution, FP8 activations x FP4 weights."""
  d = Int32(0)
  for w in range(FP4_SUB_WORDS):
    for i in range(NIBBLES_PER_WORD):
      d = d + xs[NIBBLES_PER_WORD * w + i] * _e2m1_x2(words[w], i)
  p = _scale_pow2(_i2f(d), ex + ew + FP4_DOT_SHIFT)
  return cutlass.select_(xnan != 0, Int32(F32_QNAN), p)


def _block_p_fp8(xs, words, ex, ew, xnan) -> Int32:
  """float32 bits of one K32 block's contribution, FP8 x FP8 (four exact hi/lo dots)."""
  shh = Int32(0)
  sx = Int32(0)
  sll = Int32(0)
  for w in range(FP8_SUB_WORDS):
    for i in range(WORD_BYTES):
      xh, xl = _split(xs[WORD_BYTES * w + i])
      wh, wl = _split(_e4m3_byte_int(words[w], i))
      shh = shh + xh * wh
      sx = sx + (xh * wl + xl * wh)
      sll = sll + xl * wl
  return cutlass.select_(xnan != 0, Int32(F32_QNAN), _fp8_block_p(shh, sx, sll, ex + ew))


def _fp8_block_p(shh, sx, sll, e) -> Int32:
  """float32 bits of an FP8 x FP8 block's contribution from its exact split dots (hi hi, hi lo + lo hi, lo lo) and
  its exponent e: the oracle's three rounded partial sums, then the scale (`reference` module doc)."""
  p = _fadd(_fmul(_i2f(shh), FP8_PART_BITS[0]), _fmul(_i2f(sx), FP8_PART_BITS[1]))
  p = _fadd(p, _fmul(_i2f(sll), FP8_PART_BITS[2]))
  return _scale_pow2(p, e)


def _quantize_block(vals, blk, sAct, sExp, sNan) -> None:
  """MXFP8 of 32 float32 bit patterns (`formats.quantize_mx`, e4m3) into ``sAct[32 blk:]``, ``sExp``, ``sNan``."""
  amax = Int32(0)
  bad = Int32(0)
  for i in range(K32):
    a = vals[i] & F32_ABS
    finite = a < F32_INF
    amax = cutlass.max(amax, cutlass.select_(finite, a, Int32(0)))
    bad = bad | cutlass.select_(finite, Int32(0), Int32(1))
  e = _e4m3_scale_exp(amax)
  neg = -e
  half = neg >> 1
  f1 = _exp2_bits(half)
  f2 = _exp2_bits(neg - half)
  for i in range(K32):
    q = _fmul(_fmul(vals[i], f1), f2)
    n = _e4m3_int(q)
    sAct[blk * K32 + i] = cutlass.select_((vals[i] & F32_ABS) < F32_INF, n, Int32(0))
  sExp[blk] = e
  sNan[blk] = bad


def _ballot(pred) -> Int32:
  """The warp's lanes (all 32 converged) where ``pred`` holds, as a bit mask."""
  return _ptx1("{ .reg .pred _p; setp.ne.s32 _p, {$r0}, 0; vote.sync.ballot.b32 {$w0}, _p, -1; }", Int32(pred))


def _popc(bits) -> Int32:
  return _ptx1("popc.b32 {$w0}, {$r0};", Int32(bits))


def _ld_nc_v4(addr) -> tuple[Int32, Int32, Int32, Int32]:
  """16 bytes of read-only global memory (weights, x, the silu table: constant while the kernels run)."""
  return cute.arch.inline_ptx("ld.global.nc.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                              write_only_types=[Int32] * 4, read_only_args=[addr])


def _ld_nc(addr) -> Int32:
  return _ptx1("ld.global.nc.u32 {$w0}, [{$r0}];", addr)


def _ld_cg_v4(addr) -> tuple[Int32, Int32, Int32, Int32]:
  """16 bytes through L2 only (another GPU or partition wrote them during this call)."""
  return cute.arch.inline_ptx("ld.global.cg.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                              write_only_types=[Int32] * 4, read_only_args=[addr])


def _st_v4(addr, w0, w1, w2, w3) -> None:
  cute.arch.inline_ptx("st.global.v4.u32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                       read_only_args=[addr, Int32(w0), Int32(w1), Int32(w2), Int32(w3)])


def _bf16_half(word, hi: int) -> Int32:
  """float32 bits of the BF16 in the low (hi 0: the lower address) or high half of a 32-bit word."""
  return word & Int32(-(1 << BF16_SHIFT)) if hi else word << BF16_SHIFT


def _ld_nc_bf16(addr) -> Int32:
  """float32 bits of the BF16 at ``addr`` (read-only while this kernel runs)."""
  return _ptx1("ld.global.nc.u16 {$w0}, [{$r0}];", addr) << BF16_SHIFT


def _gate_row(i):
  """The W13 row of activation column i's gate (`formats` interleave: gate rows 8q..8q+7, then up rows, of 16q..);
  its up row is `GATE_UP_GROUP` further."""
  return (i // GATE_UP_GROUP) * (2 * GATE_UP_GROUP) + i % GATE_UP_GROUP


def _gptr(addr, dtype=Int32):
  return cutlass.inttoptr(addr, cute.AddressSpace.gmem, dtype)


def _ld(addr, dtype=Int32):
  """A plain (weak, coherent) global load: for data another kernel of the same call wrote."""
  return cute.arch.load(_gptr(addr, dtype), dtype)


def _st(addr, value, dtype=Int32) -> None:
  cute.arch.store(_gptr(addr, dtype), dtype(value))


def _st_u64(addr, value) -> None:
  cute.arch.inline_ptx("st.global.u64 [{$r0}], {$r1};", write_only_types=[], read_only_args=[Int64(addr), value])


def _queue_append(queue: Int64, e) -> None:
  """Appends expert ``e`` to the call's active queue at ``queue`` (`abi.active_queue`), after its rows and count
  were published: an atomic add takes the position, a release store fills the entry (e + 1)."""
  pos = _ptx1("atom.relaxed.gpu.global.add.u32 {$w0}, [{$r0}], 1;", queue)
  cute.arch.store(_gptr(queue + Int64(2 + pos) * WORD_BYTES), Int32(e + 1), sem="release", scope="gpu")


def _queue_close(queue: Int64) -> None:
  """Publishes the active queue's final size (+ 1) once every expert of the call was appended (the caller's CTA
  barrier orders the appends before this thread's fence)."""
  n = _ptx1("atom.relaxed.gpu.global.add.u32 {$w0}, [{$r0}], 0;", queue)
  cute.arch.fence_acq_rel_gpu()
  cute.arch.store(_gptr(queue + WORD_BYTES), n + 1, sem="release", scope="gpu")


def _st_bf16(addr, bits) -> None:
  cute.arch.store(_gptr(addr, Uint16), Uint16(bits))


@cute.jit
def _record_fault(wsb: Int64, role: cutlass.Constexpr, block: Int32, epoch: Int32, counter: Int32,
                  observed: Int32) -> None:
  """The error record of `abi.HEADER`, written once: the first fault wins the CAS of ``error_flag`` from 0 to
  `abi.FAULT_WRITING`, writes the record and then stores 1 (release), so `_mirror_fault` never copies a record
  half written (every nonzero flag is a fault to the waits)."""
  old = cute.arch.atomic_cas(_gptr(wsb + abi.HEADER["error_flag"]), cmp=Int32(0), val=Int32(abi.FAULT_WRITING),
                             sem="relaxed", scope="gpu")
  if old == 0:
    _st(wsb + abi.HEADER["error_role"], role)
    _st(wsb + abi.HEADER["error_block"], block)
    _st(wsb + abi.HEADER["error_epoch"], epoch)
    _st(wsb + abi.HEADER["error_counter"], counter)
    _st(wsb + abi.HEADER["error_observed"], observed)
    cute.arch.store(_gptr(wsb + abi.HEADER["error_flag"]), Int32(1), sem="release", scope="gpu")


@cute.jit
def _mirror_fault(wsb: Int64) -> None:
  """Copies the fault record into the runtime's pinned host mirror (mapped memory), error_flag last (release at
  system scope), so the host reads a complete record without synchronising and the graph needs no copy node."""
  host = _ld(wsb + abi.HEADER["host_mirror"], Int64)
  if host != 0:
    # The record may be another CTA's, still being written (`_record_fault`): wait (bounded: a few stores away)
    # until its flag says complete. Without this, role 3 once mirrored a record with only its last word written.
    flag = _gptr(wsb + abi.HEADER["error_flag"])
    start = cute.arch.globaltimer()
    seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
    elapsed = cutlass.Uint64(0)
    while (seen == abi.FAULT_WRITING) & (elapsed < abi.FAULT_WRITE_NS):
      seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
      elapsed = cutlass.Uint64(cute.arch.globaltimer() - start)
    for name in abi.MIRROR_WORDS[1:]:
      cute.arch.store(_gptr(host + abi.HEADER[name]), _ld(wsb + abi.HEADER[name]), sem="relaxed", scope="sys")
    cute.arch.store(_gptr(host + abi.HEADER["error_flag"]), Int32(1), sem="release", scope="sys")


# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////////
# The kernels
# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////////


class RoleKernelsV1:
  """The three role kernels of one `Variant`; ``launch_role{1,2,3}`` are the host entries `cute.compile` takes.

  Holds only static configuration (the variant, the workspace offsets); nothing is mutated while tracing.
  """

  GENERATION = "v1"  # the workspace layout this class indexes (`Variant.workspace`)

  def __init__(self, variant: Variant):
    if variant.ranks > 1 and self.GENERATION == "v1":
      raise ValueError(f"roles_v1: the fused transport (ranks = {variant.ranks}) needs the v2 kernels "
                       f"(GCMOE_KERNELS=v2)")
    self.v = variant
    self.ws = variant.workspace(self.GENERATION)
    self.k_max = max(variant.hidden, variant.intermediate, variant.shared_intermediate or 0)
    self.i_max = max(variant.intermediate, variant.shared_intermediate or 0)
    # `GCMOE_ABLATION=timeline`: %globaltimer stamps after the workspace (`abi.TIMELINE_BYTES`), results exact.
    self.timeline = _config.timeline_build()

  @cute.jit
  def _tl_put(self, wsb: Int64, cur: Int32, word: Int32, value: Int64) -> None:
    """Timeline build: ``value`` into word ``word`` of this call's slot (`abi.TL_CALLS`) after the workspace."""
    slot = Int64(wsb) + self.ws.total + Int64(cur % abi.TL_CALLS) * (abi.TL_CALL_WORDS * 8)
    _st_u64(slot + Int64(word) * 8, value)

  @cute.jit
  def _tl_stamp(self, wsb: Int64, cur: Int32, word: Int32) -> None:
    """Timeline build: the current %globaltimer into word ``word`` of this call's slot."""
    self._tl_put(wsb, cur, word, cute.arch.globaltimer())

  def _counter(self, wsb: Int64, cur: Int32, at) -> Int64:
    """The address of word ``at`` of call ``cur``'s parity of the v2 ``counters`` section (`abi.counter_words`) in
    the workspace at ``wsb`` (this rank's or a peer's: the layout is the same on every rank)."""
    v = self.v
    words = abi.counter_words(v.experts, v.capacity, v.shared, v.ranks, v.relay)
    return wsb + self.ws.counters + (Int64(cur & 1) * words + at) * WORD_BYTES

  def _active_queue(self, wsb: Int64, cur: Int32) -> Int64:
    """The address of call ``cur``'s active queue (v2 workspaces: `abi.active_queue` in the parity's counters)."""
    v = self.v
    return self._counter(wsb, cur, abi.active_queue(v.experts, v.capacity, v.shared, v.ranks, v.relay))

  @cute.jit
  def _clear_next_counters(self, wsb: Int64, epoch: Int32) -> None:
    """A CTA zeroes the counters of the next call (parity ``epoch & 1``, as this call is ``epoch + 1``): the previous
    call, which used that parity, is done, and the next call's kernels cannot start before this one ends. (With the
    fused transport, peers count into this rank's next parity only after its next call published: see
    `RoleKernelsV2._await_returns`.)"""
    v = self.v
    tid, _, _ = cute.arch.thread_idx()
    for i in range(tid, abi.counter_words(v.experts, v.capacity, v.shared, v.ranks, v.relay), THREADS):
      _st(self._counter(wsb, epoch, i), 0)

  def dynamic_smem(self, role: int) -> int:
    """Dynamic SMEM bytes of role ``role`` (1-3): v1 uses static SMEM only."""
    return 0

  def ctas_per_sm(self, role: int) -> int:
    """CTAs of role ``role`` built to share an SM (.minnctapersm): one."""
    return MIN_CTAS_PER_SM

  # ---- host entries (the launch configuration here only fixes .reqntid; the runtime launches the cubins) --------

  @cute.jit
  def launch_role1(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
                   w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
                   s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
                   workspace: cute.Pointer, tokens: Int32, clamp: Float32):
    self.role1_dispatch(x, ids, route_weights, w13, w13_scale, w2, w2_scale, s13, s13_scale, s2, s2_scale, y,
                        workspace, tokens, clamp).launch(
      grid=[1, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=MIN_CTAS_PER_SM)

  @cute.jit
  def launch_role2(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
                   w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
                   s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
                   workspace: cute.Pointer, tokens: Int32, clamp: Float32):
    self.role2_compute(x, ids, route_weights, w13, w13_scale, w2, w2_scale, s13, s13_scale, s2, s2_scale, y,
                       workspace, tokens, clamp).launch(
      grid=[1, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=MIN_CTAS_PER_SM)

  @cute.jit
  def launch_role3(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
                   w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
                   s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
                   workspace: cute.Pointer, tokens: Int32, clamp: Float32):
    self.role3_finalize(x, ids, route_weights, w13, w13_scale, w2, w2_scale, s13, s13_scale, s2, s2_scale, y,
                        workspace, tokens, clamp).launch(
      grid=[1, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=MIN_CTAS_PER_SM)

  # ////////////////////////////////////////////////////////////////////////////////////////////////////////////////
  # Role 1: dispatch
  # ////////////////////////////////////////////////////////////////////////////////////////////////////////////////

  @cute.kernel
  def role1_dispatch(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
                     w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
                     s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
                     workspace: cute.Pointer, tokens: Int32, clamp: Float32):
    """Block 0: fault scan, then a warp per expert lists rows[e] in token order, then a thread per expert
    publishes count[e] and ready[e] (v2: and appends the expert to the active queue, which thread 0 closes)."""
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    wsb = workspace.toint()
    idb = ids.toint()
    n_assign = cutlass.min(cutlass.max(tokens, 0), v.capacity) * v.top_k
    sCount = cute.make_tensor(cute.arch.alloc_smem(Int32, v.experts, alignment=16),
                              cute.make_layout(v.experts))  # (E,) the rows listed per expert
    if bid == 0:
      cur = _ld(wsb + abi.HEADER["epoch"]) + 1
      if cutlass.const_expr(self.timeline):
        if tid == 0:
          self._tl_stamp(wsb, cur, Int32(0))
      stall = _ld(wsb + abi.HEADER["stall_expert"])
      # Ids >= E: the fault record, once (CAS on error_flag); the id is skipped below (it matches no thread).
      for a in range(tid, n_assign, THREADS):
        eid = _ld_nc(idb + Int64(a) * WORD_BYTES)
        if eid >= v.experts:
          _record_fault(wsb, 1, bid, cur, eid, a)
      # rows[e] = the assignments routed to e, in token order; ids < 0 (padding) match no expert. A warp per
      # expert compacts 32 assignments per step by ballot (a thread per expert reading all the ids one at a time
      # took ~30 us at B = 256, k = 8), each lane's row at the count of matching lanes below it.
      warp = tid // 32
      lane = tid % 32
      below = Int32(cute.arch.lanemask_lt())
      for e in range(warp, v.experts, THREADS // 32):
        rows_e = wsb + ws.rows + Int64(e) * (v.capacity * v.top_k * WORD_BYTES)
        count = Int32(0)
        for a0 in range(0, n_assign, 32):
          a = a0 + lane
          eid = Int32(-1)
          if a < n_assign:
            eid = _ld_nc(idb + Int64(a) * WORD_BYTES)
          hits = _ballot(eid == e)
          if eid == e:
            _st(rows_e + Int64(count + _popc(hits & below)) * WORD_BYTES, a)
          count = count + _popc(hits)
        if lane == 0:
          sCount[e] = count
      # Then a thread per expert publishes it, all at once: a warp publishing its experts one after another put a
      # fence, a release and the queue's atomic per expert in a chain (role 1 took 4-10 us at B = 1).
      cute.arch.sync_threads()  # every lane's rows and the counts, before each publishing thread's fence
      for e in range(tid, v.experts, THREADS):
        count = sCount[e]
        _st(wsb + ws.count + Int64(e) * WORD_BYTES, count)
        if e != stall:
          # Release: count[e] and rows[e] are visible to whoever acquires ready[e] == cur.
          cute.arch.fence_acq_rel_gpu()
          cute.arch.store(_gptr(wsb + ws.ready + Int64(e) * WORD_BYTES), cur, sem="release", scope="gpu")
          if cutlass.const_expr(self.GENERATION == "v2"):
            if count > 0:  # v2's role 2 takes the experts hit from the active queue
              _queue_append(self._active_queue(wsb, cur), e)
      if cutlass.const_expr(self.GENERATION == "v2"):
        cute.arch.sync_threads()
        if (tid == 0) & ((stall < 0) | (stall >= v.experts)):  # a withheld expert keeps the queue open
          _queue_close(self._active_queue(wsb, cur))
      if cutlass.const_expr(self.timeline):
        cute.arch.sync_threads()
        if tid == 0:
          self._tl_stamp(wsb, cur, Int32(1))

  # ////////////////////////////////////////////////////////////////////////////////////////////////////////////////
  # Role 2: compute
  # ////////////////////////////////////////////////////////////////////////////////////////////////////////////////

  @cute.kernel
  def role2_compute(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
                    w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
                    s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
                    workspace: cute.Pointer, tokens: Int32, clamp: Float32):
    """Shared-expert items, then (expert, sub-slice) items after a bounded wait on ready[e]."""
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    sAct = cute.make_tensor(cute.arch.alloc_smem(Int32, self.k_max, alignment=16),
                            cute.make_layout(self.k_max))  # (K,) E4M3 activations as 512 v
    sExp = cute.make_tensor(cute.arch.alloc_smem(Int32, self.k_max // K32, alignment=16),
                            cute.make_layout(self.k_max // K32))  # (K/32,) UE8M0 exponents
    sNan = cute.make_tensor(cute.arch.alloc_smem(Int32, self.k_max // K32, alignment=16),
                            cute.make_layout(self.k_max // K32))  # (K/32,) 1: the block held NaN/Inf
    sA = cute.make_tensor(cute.arch.alloc_smem(Uint16, self.i_max, alignment=16),
                          cute.make_layout(self.i_max))  # (I,) BF16 bits of the SwiGLU output
    sCtl = cute.make_tensor(cute.arch.alloc_smem(Int32, CTL_WORDS, alignment=16),
                            cute.make_layout(CTL_WORDS))  # (4,) thread 0 -> CTA: [ok, count]
    wsb = workspace.toint()
    n_tok = cutlass.min(cutlass.max(tokens, 0), v.capacity)
    cur = _ld(wsb + abi.HEADER["epoch"]) + 1
    c_bits = _bf16_rne(_float_bits(clamp)) << BF16_SHIFT  # c = bf16(clamp), as float32 bits
    grid32 = Int32(grid)
    cpe = cutlass.max(grid32 // v.experts, 1)
    n_shared = Int32(0)
    if cutlass.const_expr(v.shared):
      n_shared = n_tok
    n_items = n_shared + v.experts * cpe
    # Bytes of one expert in each routed weight tensor (payload [E, K/128, N, 64], scales [E, K/128, N] int32).
    w13_bytes = (v.hidden // K128) * 2 * v.intermediate * FP4_TILE_BYTES
    w13_scale_bytes = 2 * v.intermediate * (v.hidden // K128) * WORD_BYTES
    w2_bytes = (v.intermediate // K128) * v.hidden * FP4_TILE_BYTES
    w2_scale_bytes = v.hidden * (v.intermediate // K128) * WORD_BYTES
    failed = Int32(0)
    for w in range(bid, n_items, grid32):
      if cutlass.const_expr(v.shared):  # noqa: SIM102 (a compile-time test cannot be and-ed with a runtime one)
        if w < n_shared:
          self._row(True, x.toint(), w, Int32(F32_ONE), s13.toint(), s13_scale.toint(), s2.toint(),
                    s2_scale.toint(), wsb + ws.shared_out + Int64(w) * (v.hidden * BF16_BYTES), wsb, c_bits,
                    sAct, sExp, sNan, sA)
      if (w >= n_shared) & (failed == 0):
        item = w - n_shared
        e = item // cpe
        s = item - e * cpe
        if tid == 0:
          ok, count = self._wait_ready(wsb, e, cur, bid)
          sCtl[0] = ok
          sCtl[1] = count
        cute.arch.sync_threads()
        ok = sCtl[0]
        count = sCtl[1]
        cute.arch.sync_threads()  # sCtl is rewritten by the next item's thread 0
        if ok == 0:
          failed = Int32(1)
        rows_e = wsb + ws.rows + Int64(e) * (v.capacity * v.top_k * WORD_BYTES)
        for r in range(s, count, cpe):
          a = _ld(rows_e + Int64(r) * WORD_BYTES)
          t = a // v.top_k
          rw = _ld_nc(route_weights.toint() + Int64(a) * WORD_BYTES)  # route_weights[t, j], [T, k] f32
          self._row(False, x.toint(), t, rw, w13.toint() + Int64(e) * w13_bytes,
                    w13_scale.toint() + Int64(e) * w13_scale_bytes, w2.toint() + Int64(e) * w2_bytes,
                    w2_scale.toint() + Int64(e) * w2_scale_bytes,
                    wsb + ws.arena + Int64(a) * (v.hidden * BF16_BYTES), wsb, c_bits, sAct, sExp, sNan, sA)

  @cute.jit
  def _wait_ready(self, wsb: Int64, e: Int32, cur: Int32, bid: Int32):
    """Thread 0: bounded acquire-spin on ready[e] == cur; returns (ok, count[e]); records a timeout."""
    ready = _gptr(wsb + self.ws.ready + Int64(e) * WORD_BYTES)
    flag = _gptr(wsb + abi.HEADER["error_flag"])
    timeout = _ld(wsb + abi.HEADER["timeout_ns"], Uint64)
    start = cute.arch.globaltimer()
    seen = cute.arch.load(ready, Int32, sem="acquire", scope="gpu")
    fault = cute.arch.load(flag, Int32, sem="relaxed", scope="gpu")
    elapsed = Uint64(0)
    while (seen != cur) & (fault == 0) & (elapsed <= timeout):
      cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(SPIN_SLEEP_NS)])
      seen = cute.arch.load(ready, Int32, sem="acquire", scope="gpu")
      fault = cute.arch.load(flag, Int32, sem="relaxed", scope="gpu")
      elapsed = Uint64(cute.arch.globaltimer() - start)
    ok = Int32(0)
    count = Int32(0)
    if seen == cur:
      ok = Int32(1)
      cute.arch.fence_acq_rel_gpu()  # the CTA reads rows[e] after the barrier that follows
      count = _ld(wsb + self.ws.count + Int64(e) * WORD_BYTES)
    elif fault == 0:  # the bound expired: record it once (the first fault wins)
      _record_fault(wsb, 2, bid, cur, e, seen)
    return ok, count

  @cute.jit
  def _row(self, shared: cutlass.Constexpr, xb: Int64, t: Int32, rw_bits: Int32, p13: Int64, sc13: Int64,
           p2: Int64, sc2: Int64, out: Int64, wsb: Int64, c_bits: Int32, sAct: cute.Tensor, sExp: cute.Tensor,
           sNan: cute.Tensor, sA: cute.Tensor):
    """One row through phases A-D (the whole CTA); p13/sc13/p2/sc2 point at the expert's weights."""
    v = self.v
    tid, _, _ = cute.arch.thread_idx()
    inter = v.shared_intermediate if cutlass.const_expr(shared) else v.intermediate
    # A. MXFP8 of x[t] ([T, H] bf16): thread per K32 block.
    self._quantize_x(xb, t, sAct, sExp, sNan)
    cute.arch.sync_threads()
    # B. GEMM1 (N = 2 Ie stored rows, gate/up interleaved by 8) + SwiGLU + route weight: thread per column i.
    for i in range(tid, inter, THREADS):
      sA[i] = Uint16(self._swiglu_column(shared, i, rw_bits, p13, sc13, wsb, c_bits, sAct, sExp, sNan))
    cute.arch.sync_threads()
    # C. MXFP8 of the Ie activations: thread per K32 block.
    for blk in range(tid, inter // K32, THREADS):
      self._quantize_act_block(sA, blk, blk, sAct, sExp, sNan)
    cute.arch.sync_threads()
    # D. GEMM2 (N = H): thread per output column; o = bf16(acc) -> out[h].
    for h in range(tid, v.hidden, THREADS):
      acc, _ = self._gemm(shared, False, inter, v.hidden, p2, sc2, h, h, sAct, sExp, sNan)
      _st_bf16(out + Int64(h) * BF16_BYTES, _bf16_rne(acc))
    cute.arch.sync_threads()  # sAct and sA are rewritten by the next row

  @cute.jit
  def _quantize_x(self, xb: Int64, t: Int32, sAct: cute.Tensor, sExp: cute.Tensor, sNan: cute.Tensor):
    """Phase A: MXFP8 of x[t] into sAct/sExp/sNan, a thread per K32 block (no barrier)."""
    v = self.v
    tid, _, _ = cute.arch.thread_idx()
    for blk in range(tid, v.hidden // K32, THREADS):
      base = xb + (Int64(t) * v.hidden + Int64(blk) * K32) * BF16_BYTES
      vals = []
      for q in cutlass.range_constexpr(X_SUB_WORDS // V4_WORDS):
        quad = _ld_nc_v4(base + q * V4_BYTES)
        for wd in cutlass.range_constexpr(V4_WORDS):
          vals.append(quad[wd] << BF16_SHIFT)  # element 2m: low half
          vals.append(quad[wd] & F32_HIGH_HALF)  # element 2m + 1: high half
      _quantize_block(vals, blk, sAct, sExp, sNan)

  @cute.jit
  def _swiglu_column(self, shared: cutlass.Constexpr, i: Int32, rw_bits: Int32, p13: Int64, sc13: Int64,
                     wsb: Int64, c_bits: Int32, sAct: cute.Tensor, sExp: cute.Tensor, sNan: cute.Tensor) -> Int32:
    """Phase B for activation column i: BF16 bits of bf16(rw * bf16(silu(min(g, c)) * clip(u, -c, c)))."""
    v = self.v
    inter = v.shared_intermediate if cutlass.const_expr(shared) else v.intermediate
    gate_row = _gate_row(i)
    up_row = gate_row + GATE_UP_GROUP
    hg, hu = self._gemm(shared, True, v.hidden, 2 * inter, p13, sc13, gate_row, up_row, sAct, sExp, sNan)
    return self._swiglu_bits(hg, hu, rw_bits, wsb, c_bits)

  @cute.jit
  def _swiglu_bits(self, hg: Int32, hu: Int32, rw_bits: Int32, wsb: Int64, c_bits: Int32) -> Int32:
    """Steps 3-4 of the semantics on float32 bits of gate ``hg`` and up ``hu``: BF16 bits of
    bf16(rw * bf16(silu(min(g, c)) * clip(u, -c, c)))."""
    neg_c = c_bits ^ F32_SIGN
    g = _bf16_rne(hg) << BF16_SHIFT
    u = _bf16_rne(hu) << BF16_SHIFT
    g = _fmin_nan(g, c_bits)
    u = _fmin_nan(_fmax_nan(u, neg_c), c_bits)
    silu = _ld_nc(wsb + self.ws.silu_table + Int64((g >> BF16_SHIFT) & BF16_MASK) * WORD_BYTES)
    act = _bf16_rne(_fmul(silu, u)) << BF16_SHIFT
    return _bf16_rne(_fmul(rw_bits, act))

  @cute.jit
  def _quantize_act_block(self, sA: cute.Tensor, src: Int32, blk: Int32, act: cute.Tensor, exps: cute.Tensor,
                          nans: cute.Tensor):
    """Phase C for one K32 block: MXFP8 of the BF16 activations ``sA[32 src:]`` into block ``blk`` of act/exps/nans
    (SMEM, or the workspace for the shared expert's split path)."""
    vals = []
    for q in cutlass.range_constexpr(K32):
      vals.append(Int32(sA[src * K32 + q]) << BF16_SHIFT)
    _quantize_block(vals, blk, act, exps, nans)

  @cute.jit
  def _gemm(self, fp8: cutlass.Constexpr, two_rows: cutlass.Constexpr, k: cutlass.Constexpr,
            n: cutlass.Constexpr, payload: Int64, scales: Int64, row0: Int32, row1: Int32, sAct: cute.Tensor,
            sExp: cute.Tensor, sNan: cute.Tensor):
    """float32 bits of the dot of rows row0 (and row1) with sAct: ``acc = 0; acc += p_b`` for K32 blocks b.

    Routed (FP4): payload [K/128, N, 64] B, scales [K/128, N] int32 (byte s = sub-block s). Shared (FP8): payload
    [K/128, N, 128] B, scales [N, ceil(K / (4 group))] int32 (four group scales per word).
    """
    k_tiles = k // K128
    acc0 = Int32(0)
    acc1 = Int32(0)
    for kb in range(k_tiles):
      if cutlass.const_expr(not fp8):
        sw0 = _ld_nc(scales + (Int64(kb) * n + row0) * WORD_BYTES)
        sw1 = sw0
        if cutlass.const_expr(two_rows):
          sw1 = _ld_nc(scales + (Int64(kb) * n + row1) * WORD_BYTES)
      for sub in cutlass.range_constexpr(SUBS):
        b = kb * SUBS + sub
        xs = []
        for i in cutlass.range_constexpr(K32):
          xs.append(sAct[b * K32 + i])
        ex = sExp[b]
        xnan = sNan[b]
        if cutlass.const_expr(fp8):
          group = self.v.shared_group
          per_word = SCALES_PER_WORD * group // K32  # K32 blocks per scale word
          word = b // per_word
          byte_id = (b - word * per_word) // (group // K32)
          scale_words = -(-k // (SCALES_PER_WORD * group))
          addr0 = payload + (Int64(kb) * n + row0) * FP8_TILE_BYTES + sub * FP8_SUB_WORDS * WORD_BYTES
          words0 = list(_ld_nc_v4(addr0)) + list(_ld_nc_v4(addr0 + V4_BYTES))
          sw0 = _ld_nc(scales + (Int64(row0) * scale_words + word) * WORD_BYTES)
          ew0 = (sw0 >> (byte_id * BYTE_BITS)) & BYTE_MASK
          acc0 = _fadd(acc0, _block_p_fp8(xs, words0, ex, ew0 - UE8M0_BIAS, xnan))
          if cutlass.const_expr(two_rows):
            addr1 = payload + (Int64(kb) * n + row1) * FP8_TILE_BYTES + sub * FP8_SUB_WORDS * WORD_BYTES
            words1 = list(_ld_nc_v4(addr1)) + list(_ld_nc_v4(addr1 + V4_BYTES))
            sw1 = _ld_nc(scales + (Int64(row1) * scale_words + word) * WORD_BYTES)
            ew1 = (sw1 >> (byte_id * BYTE_BITS)) & BYTE_MASK
            acc1 = _fadd(acc1, _block_p_fp8(xs, words1, ex, ew1 - UE8M0_BIAS, xnan))
        else:
          addr0 = payload + (Int64(kb) * n + row0) * FP4_TILE_BYTES + sub * FP4_SUB_WORDS * WORD_BYTES
          ew0 = ((sw0 >> (BYTE_BITS * sub)) & BYTE_MASK) - UE8M0_BIAS
          acc0 = _fadd(acc0, _block_p_fp4(xs, list(_ld_nc_v4(addr0)), ex, ew0, xnan))
          if cutlass.const_expr(two_rows):
            addr1 = payload + (Int64(kb) * n + row1) * FP4_TILE_BYTES + sub * FP4_SUB_WORDS * WORD_BYTES
            ew1 = ((sw1 >> (BYTE_BITS * sub)) & BYTE_MASK) - UE8M0_BIAS
            acc1 = _fadd(acc1, _block_p_fp4(xs, list(_ld_nc_v4(addr1)), ex, ew1, xnan))
    return acc0, acc1

  # ////////////////////////////////////////////////////////////////////////////////////////////////////////////////
  # Role 3: finalize
  # ////////////////////////////////////////////////////////////////////////////////////////////////////////////////

  @cute.kernel
  def role3_finalize(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
                     w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
                     s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
                     workspace: cute.Pointer, tokens: Int32, clamp: Float32):
    """y[t] = bf16(sum_j o_j + shared) for tokens t = block, block + grid, ...; NaN after a fault; epoch += 1 (and,
    in a fused variant's first call, the steady spin bound into ``header.timeout_ns``)."""
    v = self.v
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    wsb = workspace.toint()
    yb = y.toint()
    idb = ids.toint()
    n_tok = cutlass.min(cutlass.max(tokens, 0), v.capacity)
    epoch = _ld(wsb + abi.HEADER["epoch"])  # (only this kernel's block 0 advances it, at its end)
    if cutlass.const_expr(self.timeline):
      if (bid == 0) & (tid == 0):
        self._tl_stamp(wsb, epoch + 1, Int32(2))
    if cutlass.const_expr(v.ranks > 1):
      self._await_returns(wsb, idb, n_tok, bid)  # the peers' GEMM2 rows of this rank's tokens (fused transport)
    if cutlass.const_expr(self.GENERATION == "v2"):
      if bid == 0:
        self._clear_next_counters(wsb, epoch)
      if cutlass.const_expr(v.ranks == 1):
        self._await_role2(wsb, bid, epoch + 1)  # (beside role 2: until its CTAs are done)
    fault = _ld(wsb + abi.HEADER["error_flag"])  # (after role 2's faults, also where role 3 waited for them)
    # A CTA per token (tokens bid, bid + grid, ...), all of its column blocks.
    for t in range(bid, n_tok, Int32(grid)):
      self._combine(t, 0, abi.combine_blocks(v.hidden), wsb, idb, yb, fault)
    if bid == 0:
      cute.arch.sync_threads()
      if tid == 0:
        if cutlass.const_expr(self.timeline):
          self._tl_stamp(wsb, epoch + 1, Int32(3))
          self._tl_put(wsb, epoch + 1, Int32(4), Int64(epoch + 1))
        if cutlass.const_expr(v.ranks > 1):
          if epoch == 0:  # a group across processes waits longer in its first call only (abi.HEADER)
            _st(wsb + abi.HEADER["timeout_ns"], _ld(wsb + abi.HEADER["steady_timeout_ns"], Uint64), Uint64)
        _st(wsb + abi.HEADER["epoch"], epoch + 1)
        if fault != 0:
          _mirror_fault(wsb)

  @cute.jit
  def _combine(self, t: Int32, cb0, n_cb: cutlass.Constexpr, wsb: Int64, idb: Int64, yb: Int64, fault: Int32):
    """y[t] = bf16(sum_j o_j + shared) (NaN after a fault) over the ``n_cb`` blocks of `COMBINE_COLS` columns from
    block ``cb0``: a thread sums 8 adjacent columns with 16-byte accesses in each block, all k rows of every block
    loaded before the first sum, so a token takes one round trip, not one per block (one CTA per token took 24
    dependent round trips at H = 6144: 15 us; a block at a time, 2.8 us at B = 1 on the H200: docs/kernels_v2.md)."""
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    cols = COMBINE_COLS
    valid = [_ld_nc(idb + Int64(t * v.top_k + j) * WORD_BYTES) >= 0 for j in range(v.top_k)]
    loaded = []
    for cb in cutlass.range_constexpr(n_cb):
      h = cutlass.min((cb0 + cb) * cols + tid * 8, v.hidden - 8)  # (past H: a valid address, its sums not stored)
      rows = []
      for j in cutlass.range_constexpr(v.top_k):
        row = wsb + ws.arena + (Int64(t * v.top_k + j) * v.hidden + h) * BF16_BYTES  # arena[t k + j, h .. h + 7]
        # Written during this kernel's life (by the peers, or by role 2 beside it): not the read-only path.
        if cutlass.const_expr(self.GENERATION == "v2"):
          rows.append(_ld_cg_v4(row))
        else:
          rows.append(_ld_nc_v4(row))
      if cutlass.const_expr(v.shared):
        so = wsb + ws.shared_out + (Int64(t) * v.hidden + h) * BF16_BYTES  # shared_out[t, h ..]
        rows.append(_ld_cg_v4(so) if cutlass.const_expr(self.GENERATION == "v2") else _ld_nc_v4(so))
      loaded.append(rows)
    for cb in cutlass.range_constexpr(n_cb):
      h = (cb0 + cb) * cols + tid * 8
      acc = cute.make_rmem_tensor(8, Int32)
      for i in cutlass.range_constexpr(8):
        acc[i] = Int32(0)  # +0.0
      for j in cutlass.range_constexpr(v.top_k):
        o = loaded[cb][j]
        for i in cutlass.range_constexpr(8):
          acc[i] = _fadd(acc[i], cutlass.select_(valid[j], _bf16_half(o[i // 2], i % 2), Int32(0)))
      if cutlass.const_expr(v.shared):
        so = loaded[cb][v.top_k]
        for i in cutlass.range_constexpr(8):
          acc[i] = _fadd(acc[i], _bf16_half(so[i // 2], i % 2))
      out = [cutlass.select_(fault != 0, Int32(BF16_QNAN), _bf16_rne(acc[i])) for i in range(8)]
      if h < v.hidden:
        _st_v4(yb + (Int64(t) * v.hidden + h) * BF16_BYTES,
               *(out[2 * i] | (out[2 * i + 1] << BF16_SHIFT) for i in range(4)))

for _kernel, _name in zip((RoleKernelsV1.role1_dispatch, RoleKernelsV1.role2_compute, RoleKernelsV1.role3_finalize),
                          ROLE_NAMES):
  # PTX entry = the name plus the DSL's per-trace suffix ("_0"); build.py reads the exact symbol from the PTX.
  _kernel.set_name_prefix(_name, remove_cutlass_symbol=True, keep_mangled_name=False)
