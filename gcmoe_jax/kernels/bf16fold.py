"""The BF16 wide pass of role 2 (docs/kernels_v2.md "Session 58"): its operand maps and weight decode, as a model.

Role 2's wide passes may run on BF16 ``wgmma`` with the block scales folded into the operands: an E2M1 weight times
its block's ``2**ew`` and an E4M3 activation times its ``2**ex`` are exact in BF16, their products exact in FP32,
and each K32 block summed on its own by the tensor cores then added in FP32 meets the numerics bar (measured: worst
cosine 0.9999999999 to ``reference.moe_emulated``; one sum over all of K does not). This module is the contract
the kernel is built to, checked on the CPU (``tests/test_bf16fold.py``):

- **The lane's word.** A (row, K32 block) of the routed payload is 16 bytes, byte i holding the codes of K 2i (low
  nibble) and 2i + 1. Lane t4 of a quad takes word t4 of it (`lane_word`: K 8 t4 .. 8 t4 + 7, nibble n = K 8 t4 +
  n), the word role 2's int8 bodies already get from their ldmatrix loads of the stage's weight tile
  (`roles_v2._weight_words`: word t4 of rows g and g + 8 of each block).
- **The decode** (`decode_pair`): register j of the lane's four per row takes the codes in nibbles j and j + 4; one
  shift puts them at bits 6-9 and 22-25, where their magnitudes are BF16 patterns of ``2**-126`` times the E2M1
  value (0.5 is the BF16 subnormal ``2**-127``), an integer multiply-add moves the signs to bits 15 and 31, and one
  ``mul.rn.bf16x2`` by ``2**(126 + ew)`` (`fold_scale`) gives the folded weights exactly: 5 instructions per
  register, for ``ew <= E2M1_MAX_EW``.
- **The K order.** wgmma's A fragment gives lane t4 the positions `fragment_positions(t4)` of the block's 32;
  register j's pair is ``lane_word``'s nibbles (j, j + 4), so the fragment holds the physical K `fragment_k(t4)`.
  Over the four lanes that is a permutation of the block's K (`B_PLANE_ORDER`), so the activation plane (B, written
  by phase 0 and the GEMM1 requant) is stored in that order and the weights keep their layout.

The shared expert's MXFP8 weights take the same pass with their own decode (`decode_e4m3_pair`): lane t4 reads
words 2 t4 and 2 t4 + 1 of a (row, K32 block)'s 32 E4M3 bytes (`shared_lane_words`: K 8 t4 .. 8 t4 + 7, byte n of
the pair = K 8 t4 + n, the routed word's nibble order), register j takes bytes (j, j + 4) by one prmt, the 7 exponent
and mantissa bits at BF16 bits 4-10 are ``2**-120`` times the E4M3 value (subnormals included), the sign moves to
bit 15, and one ``mul.rn.bf16x2`` by ``2**(120 + ew)`` (`fold_scale_e4m3`, ``ew <= E4M3_MAX_EW``) gives the folded
weight: 6 instructions per register, and the same `B_PLANE_ORDER`, so the routed GEMM1's activation plane serves the
shared expert's too. (E4M3 NaN codes decode to finite values: weights are finite by construction, `formats`.)

Role 2's sm_90a build imports these constants (`roles_v2._bf16_decode`, `_fold_mult`), so this file is one of
`build._KERNEL_SOURCES` (the cubins' key).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["B_PLANE_ORDER", "B_PLANE_POSITION", "E2M1_MAX_EW", "E2M1_MAX_SCALE_BYTE", "E2M1_MAG_MASK",
           "E2M1_SIGN_MASK", "E4M3_MAX_EW", "decode_e4m3_pair", "decode_pair", "fold_scale", "fold_scale_e4m3",
           "fold_scale_bits", "fold_scale_of_byte", "fragment_k", "fragment_positions", "lane_word", "plane_position",
           "prmt",
           "shared_lane_words"]

E2M1_MAG_MASK = 0x01C001C0  # after the shift: the two codes' magnitude bits (BF16 bits 6-8 of each half)
E2M1_SIGN_MASK = 0x02000200  # ... and their sign bits, 6 below the halves' sign bits 15 and 31
E2M1_PLACED_EXP = -126  # a placed magnitude is 2**-126 times the E2M1 value
E2M1_MAX_EW = 1  # 2**(126 + ew) must be a finite BF16: larger weight scales take the int8 path
BF16_EXP_BIAS = 127
UE8M0_BIAS = 127
E2M1_MAX_SCALE_BYTE = E2M1_MAX_EW + UE8M0_BIAS  # the UE8M0 byte of the largest weight scale the fold takes
E4M3_PLACED_EXP = -120  # a placed E4M3 (its 7 low bits at BF16 bits 4-10) is 2**-120 times its value
E4M3_MAX_EW = 7  # 2**(120 + ew) a finite BF16


def fragment_positions(t4: int) -> list[int]:
  """wgmma m64nNk16's A fragment columns of lane t4 over a K32 block's two k16 steps, in register-half order."""
  base = [2 * t4, 2 * t4 + 1, 2 * t4 + 8, 2 * t4 + 9]
  return base + [16 + f for f in base]


def lane_word(block: np.ndarray, t4: int) -> int:
  """The 32-bit word of lane t4 from a (row, K32 block)'s 16 payload bytes: word t4 (bytes 4 t4 .. 4 t4 + 3)."""
  b = np.asarray(block, np.uint8).reshape(16)
  return sum(int(b[4 * t4 + i]) << (8 * i) for i in range(4))


def _word_k(t4: int) -> list[int]:
  """Physical K of `lane_word`'s nibbles 0..7: K 8 t4 + n (byte i holds K 8 t4 + 2i low and + 1 high)."""
  return [8 * t4 + n for n in range(8)]


def fragment_k(t4: int) -> list[int]:
  """Physical K held at lane t4's fragment positions (`fragment_positions` order).

  Register r of a row (r = 0, 1: the first k16 step's pairs at 2 t4 and 2 t4 + 8; r = 2, 3: the second's) is
  decoded from nibbles (r, r + 4) of the lane's word: its low half from nibble r, its high half from r + 4.
  """
  k = _word_k(t4)
  return [k[n] for r in range(4) for n in (r, r + 4)]


def _b_plane_order() -> np.ndarray:
  order = np.full(32, -1, np.int64)
  for t4 in range(4):
    for pos, k in zip(fragment_positions(t4), fragment_k(t4)):
      order[pos] = k
  return order


B_PLANE_ORDER = _b_plane_order()  # B_PLANE_ORDER[f] = the physical K whose activation the plane holds at position f
B_PLANE_POSITION = np.argsort(B_PLANE_ORDER)  # where the writers (phase 0, the requant) put K k of a block


def plane_position(k):
  """`B_PLANE_POSITION` as the writers compute it for the lane holding K ``k`` of a block (int or array): position
  8a + 2 t4 + p holds K 8 t4 + 4p + a, so K k goes to ``8 (k % 4) + 2 (k // 8) + (k % 8) // 4``."""
  return 8 * (k % 4) + 2 * (k // 8) + (k % 8) // 4


def fold_scale(ew: int) -> int:
  """bf16x2 bits of ``2**(126 + ew)`` in both halves, the multiplier of `decode_pair`."""
  if ew > E2M1_MAX_EW:
    raise ValueError(f"fold_scale: ew must be <= {E2M1_MAX_EW} (2**(126 + ew) a finite BF16), got {ew}")
  e = -E2M1_PLACED_EXP + ew + BF16_EXP_BIAS
  if e < 1:
    raise ValueError(f"fold_scale: ew must be >= {1 - BF16_EXP_BIAS + E2M1_PLACED_EXP}, got {ew}")
  h = e << 7
  return h | (h << 16)


def fold_scale_bits(byte):
  """The kernel's arithmetic of `fold_scale_of_byte`, unchecked (an int or a DSL value): ``(byte + 126)`` times
  ``0x800080`` puts ``(byte + 126) << 7`` in both halves (one IMAD per (row, block) after the byte's prmt)."""
  return (byte + (BF16_EXP_BIAS - E2M1_PLACED_EXP - UE8M0_BIAS)) * 0x800080


def fold_scale_of_byte(byte: int) -> int:
  """`fold_scale` from a weight block's UE8M0 scale byte, as the kernel computes it (`fold_scale_bits`)."""
  if not 0 <= byte <= E2M1_MAX_SCALE_BYTE:
    raise ValueError(f"fold_scale_of_byte: byte must be in [0, {E2M1_MAX_SCALE_BYTE}], got {byte}")
  return fold_scale_bits(byte) & 0xFFFFFFFF


def _bf16_of_bits(bits: int) -> float:
  return float(np.array([bits], np.uint16).view(ml_dtypes.bfloat16)[0])


def _bf16_mul(a_bits: int, b_bits: int) -> int:
  """One half of ``mul.rn.bf16x2``: the product of two BF16 values rounded to BF16 (exact here: checked)."""
  p = _bf16_of_bits(a_bits) * _bf16_of_bits(b_bits)
  out = np.array([p], np.float32).astype(ml_dtypes.bfloat16)
  if float(out[0]) != p:
    raise ArithmeticError(f"the BF16 product {p} is not exact")
  return int(out.view(np.uint16)[0])


def decode_pair(word: int, r: int, scale2: int) -> int:
  """bf16x2 bits of register r's two folded weights from the lane's word (the kernel's 5 instructions)."""
  s = 6 - 4 * r
  x = ((word << s) if s > 0 else (word >> -s)) & 0xFFFFFFFF
  placed = ((x & E2M1_SIGN_MASK) * 64 + (x & E2M1_MAG_MASK)) & 0xFFFFFFFF  # IMAD: the signs to bits 15, 31
  lo = _bf16_mul(placed & 0xFFFF, scale2 & 0xFFFF)
  hi = _bf16_mul(placed >> 16, scale2 >> 16)
  return lo | (hi << 16)


def shared_lane_words(block: np.ndarray, t4: int) -> tuple[int, int]:
  """Lane t4's two words of a shared-expert (row, K32 block)'s 32 E4M3 bytes: words 2 t4 and 2 t4 + 1."""
  b = np.asarray(block, np.uint8).reshape(32)
  w = [sum(int(b[4 * (2 * t4 + h) + i]) << (8 * i) for i in range(4)) for h in range(2)]
  return w[0], w[1]


def fold_scale_e4m3(ew: int) -> int:
  """bf16x2 bits of ``2**(120 + ew)`` in both halves, the multiplier of `decode_e4m3_pair`."""
  if not -247 <= ew <= E4M3_MAX_EW:
    raise ValueError(f"fold_scale_e4m3: ew must be in [-247, {E4M3_MAX_EW}] (2**(120 + ew) a normal BF16), got {ew}")
  h = (-E4M3_PLACED_EXP + ew + BF16_EXP_BIAS) << 7
  return h | (h << 16)


def prmt(a: int, b: int, c: int) -> int:
  """PTX prmt.b32 (default mode): output byte i = byte (c >> 4 i) & 7 of {b, a}, or its sign if bit 3 is set (the
  CPU models' prmt: this module's and the int8 decode's in tests/test_kernels_v2_math.py)."""
  pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  out = 0
  for i in range(4):
    sel = (c >> (4 * i)) & 0xF
    byte = pool[sel & 7]
    if sel & 8:
      byte = 0xFF if byte & 0x80 else 0
    out |= byte << (8 * i)
  return out


def decode_e4m3_pair(w0: int, w1: int, r: int, scale2: int) -> int:
  """bf16x2 bits of register r's two folded shared-expert weights (bytes r of ``w0`` and of ``w1``): prmt, 2 LOP3,
  IMAD, SHF, ``mul.rn.bf16x2``."""
  x = prmt(w0, w1, r | (r << 4) | ((4 + r) << 8) | ((4 + r) << 12))  # bytes (r, r, 4 + r, 4 + r): halves' low bytes
  placed = ((((x & 0x00800080) * 16 + (x & 0x007F007F)) << 4)) & 0xFFFFFFFF  # sign to 15 / 31, 7 bits to 4-10
  lo = _bf16_mul(placed & 0xFFFF, scale2 & 0xFFFF)
  hi = _bf16_mul(placed >> 16, scale2 >> 16)
  return lo | (hi << 16)
