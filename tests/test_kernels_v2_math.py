"""The arithmetic of the v2 compute role's exact Hopper seam (docs/kernels_v2.md), checked on the CPU.

The GPU tests prove the kernels bit-exact on sampled inputs; these check the invariants the exactness argument
rests on, over every E2M1 code and E4M3 value and the worst-case sums: the prmt decode tables, the digit planes, the
magic-number conversion bounds, and the fast path's exponent window.
"""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("cutlass")  # roles_v2 imports CuTe DSL (its constants are what the kernel uses)

from gcmoe_jax.kernels import abi  # noqa: E402
from gcmoe_jax.kernels.bf16fold import prmt as _prmt  # noqa: E402
from gcmoe_jax.kernels import roles_v2 as r2  # noqa: E402

E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12], np.int64)  # 2 w of the codes 0..7 (formats.py)
E4M3_INTS = np.round(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 512)
E4M3_INTS = E4M3_INTS[np.isfinite(E4M3_INTS)].astype(np.int64)  # 512 v of every finite E4M3 value


def _dec4(w: int) -> list[int]:
  """`roles_v2._dec4` on a 32-bit word: the int8 values of the E2M1 codes in nibbles 0-3."""
  u = lambda v: v & 0xFFFFFFFF  # noqa: E731
  sel = w & 0x7777
  pos = _prmt(u(r2.POS_LO), u(r2.POS_HI), sel)
  neg = _prmt(u(r2.NEG_LO), u(r2.NEG_HI), sel)
  m = _prmt(u(r2.SIGN_SELECT), 0, (w >> 3) & 0x1111)
  v = (pos & ~m | neg & m) & 0xFFFFFFFF
  return [int(np.int8(np.uint8((v >> (8 * i)) & 0xFF))) for i in range(4)]


def test_e2m1_decode_tables_give_2w_for_every_code():
  rng = np.random.default_rng(0)
  for _ in range(2000):
    codes = rng.integers(0, 16, 4)
    word = sum(int(c) << (4 * i) for i, c in enumerate(codes)) | (int(rng.integers(0, 1 << 16)) << 16)
    want = [int(E2M1_X2[c & 7]) * (-1 if c & 8 else 1) for c in codes]
    assert _dec4(word) == want, (hex(word), codes)


def test_split_decode_of_narrow_passes_gives_2w_for_every_code():
  """Passes of at most 16 tokens decode 2 w = P + N (`roles_v2._stage`): P on the raw nibbles (a set sign bit picks
  prmt's sign-replicate mode, so a negative code gives 0), N = -|2 w| on the magnitudes; the two MMAs into one
  accumulator then sum to the one-plane operand."""
  u = lambda v: v & 0xFFFFFFFF  # noqa: E731
  signed = lambda v, i: int(np.int8(np.uint8((v >> (8 * i)) & 0xFF)))  # noqa: E731
  rng = np.random.default_rng(2)
  for _ in range(2000):
    codes = rng.integers(0, 16, 4)
    word = sum(int(c) << (4 * i) for i, c in enumerate(codes)) | (int(rng.integers(0, 1 << 16)) << 16)
    p = _prmt(u(r2.POS2_LO), u(r2.POS2_HI), word)
    n = _prmt(u(r2.NEG_LO), u(r2.NEG_HI), word & 0x7777)
    want = [int(E2M1_X2[c & 7]) * (-1 if c & 8 else 1) for c in codes]
    assert [signed(p, i) + signed(n, i) for i in range(4)] == want, (hex(word), codes)
    assert all(0 <= signed(p, i) <= 24 and -12 <= signed(n, i) <= 0 for i in range(4))


def test_digit_planes_rebuild_every_e4m3_value_within_int8():
  n = np.concatenate([E4M3_INTS, -E4M3_INTS])
  m = np.abs(n)
  sgn = np.where(n < 0, -1, 1)
  bits = abi.DIGIT_BITS
  d = [sgn * (m & ((1 << bits) - 1)), sgn * ((m >> bits) & ((1 << bits) - 1)), sgn * (m >> (2 * bits))]
  np.testing.assert_array_equal(d[0] + (d[1] << bits) + (d[2] << (2 * bits)), n)
  assert max(np.abs(p).max() for p in d) <= 127 and abi.PLANES == 3
  assert np.abs(d[2]).max() == 229376 >> 12 == 56  # the top digit of 448 * 512


def test_magic_number_conversion_is_exact_at_the_worst_case_sums():
  top = 32 * 12  # 32 products per K32 block, |2 w| <= 12
  t_max = top * 63 + 64 * top * 63  # |S0 + 64 S1| with every digit at 63
  s2_max = top * 56
  assert t_max < 2**21 and s2_max < 2**15  # the documented bounds; the magic trick needs < 2**22
  rng = np.random.default_rng(1)
  t = np.concatenate([[t_max, -t_max, 0, 1, -1], rng.integers(-t_max, t_max + 1, 20000)])
  s2 = np.concatenate([[s2_max, -s2_max, 0, 1, -1], rng.integers(-s2_max, s2_max + 1, 20000)])
  as_f32 = lambda v: (np.int64(r2.MAGIC) + v).astype(np.int32).view(np.float32)  # noqa: E731
  magic = np.int32(r2.MAGIC_NEG).view(np.float32)
  tf = as_f32(t) + magic  # float32 arithmetic, as add.rn.f32
  sf = as_f32(s2) + magic
  np.testing.assert_array_equal(tf, t.astype(np.float32))
  np.testing.assert_array_equal(sf, s2.astype(np.float32))
  # fma(sf, 4096, tf): 4096 sf + tf is an exact integer below 2**27 in float64, rounded once to float32 = cvt.rn(D).
  d = t + 4096 * s2
  np.testing.assert_array_equal((sf.astype(np.float64) * 4096 + tf).astype(np.float32), d.astype(np.float32))


def test_fast_path_window_keeps_the_scaled_block_exact_and_normal():
  lo_exp, hi_exp = abi.FAST_EXP
  nb = np.array([64 + lo_exp, 191 + hi_exp])  # byte in [64, 191] (bits 7 and 6 differ) plus e - 10
  assert nb.min() >= 1 and nb.max() <= 226
  for byte in range(256):  # the stage check: bits 7 and 6 of every scale byte differ
    word = byte * 0x01010101
    ok = ((word ^ (word << 1)) & 0x80808080) == 0x80808080
    assert ok == (64 <= byte <= 191), byte
  # f32(D) * 2**n with |D| < 2**27 and n + 127 in [1, 226]: no overflow, and normal unless D == 0.
  for n in (1 - 127, 226 - 127):
    for d in (1.0, 3.0, 2.0**27 - 1):
      fd = np.float32(d)  # f32(D), already rounded
      p = fd * np.float32(2.0**n)
      assert np.isfinite(p) and abs(p) >= np.finfo(np.float32).tiny and float(p) == float(fd) * 2.0**n


# ---- the sm_120a seam (block-scaled QMMA) ----------------------------------------------------------------------


def test_qmma_expansion_puts_every_nibble_in_its_8bit_container():
  """`roles_v2._exp4`: byte i of the expanded word holds nibble i of the 16-bit input at bits 5..2 (the E2M1
  encoding of kind::mxf8f6f4), for every input."""
  w = np.arange(1 << 16, dtype=np.int64)
  out = np.array([(_prmt(int(v), int(v) >> 4, r2.EXPAND_SELECT) & 0x0F0F0F0F) << 2 for v in w], np.int64)
  for i in range(4):
    assert np.array_equal((out >> (8 * i)) & 0xFF, ((w >> (4 * i)) & 0xF) << 2)


def test_e4m3_codes_of_the_quantized_ints_are_exact():
  """`roles_v2._e4m3_code`: f32(n) * 2**-9 is exactly the E4M3 value n / 512, so the RNE conversion returns its
  own code, for every finite E4M3 value (the sign of zero aside)."""
  codes = np.arange(256, dtype=np.uint8)
  values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  keep = np.isfinite(values) & (codes != 0x80)
  n = np.round(values[keep].astype(np.float64) * 512).astype(np.int64)
  f = n.astype(np.float32) * np.float32(2.0 ** -9)
  assert np.array_equal(f.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), codes[keep])


def test_qmma_scale_bytes_cover_every_block_exponent():
  """The UE8M0 byte e + 127 of `_quantize_lane` is a finite scale for every clamped block exponent."""
  from gcmoe_jax.kernels import roles_v1 as r1

  e = np.arange(-r1.UE8M0_CLAMP, r1.UE8M0_CLAMP + 1)
  assert ((e + r1.F32_BIAS >= 0) & (e + r1.F32_BIAS <= 254)).all()


def _c_fragment(c):
  """The m16n8k32 accumulator of lane (g, t4): C[g][2 t4], C[g][2 t4 + 1], C[g + 8][2 t4], C[g + 8][2 t4 + 1]."""
  return {(g, t4): [c(g, 2 * t4), c(g, 2 * t4 + 1), c(g + 8, 2 * t4), c(g + 8, 2 * t4 + 1)]
          for g in range(8) for t4 in range(4)}


def _start(n: int) -> str:
  """What column n of the one-, two- and four-row bodies' MMA pairs starts at (`_stage`'s ``c_row``, the
  fragment (MAGIC, 0, MAGIC, 0)): "M" in the even columns, "0" in the odd ones."""
  return "M" if n % 2 == 0 else "0"


def _biased(planes) -> None:
  """The words a lane's epilogue takes as S0 and S2 started at MAGIC, S1 at zero: MAGIC + T = 64 S1 + (MAGIC + S0)
  and MAGIC + S2 come out of the MMAs and one IMAD (`roles_v2._row_update`)."""
  assert [p[-1] for p in planes] == ["M", "0", "M"], planes


def test_row_bodies_start_their_mma_pairs_at_the_words_the_epilogue_reads():
  """The one-, two- and four-row bodies' MMA pairs start at (MAGIC, 0, MAGIC, 0): the int32 words MAGIC + S, and
  64 S1 + (MAGIC + S0) = MAGIC + T, are those the adds of the form before (`GCMOE_ABLATION=unbiased`) gave: every
  step of the chains stays far from wrapping (the split decode's P half is up to 24 per weight), and the words are
  the float32 1.5 2**23 + S exactly."""
  rng = np.random.default_rng(46)
  digits = rng.integers(-32, 33, size=(4096, 3, 32))
  digits[0] = 32
  digits[1] = -32
  p_half = rng.choice([0, 2, 4, 6, 8, 12, 16, 24], size=(4096, 32))
  w2 = rng.choice([-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12], size=(4096, 32))
  w2[0], w2[1] = 12, -12
  p_half[0] = 24
  partial = np.einsum("npk,nk->np", digits, p_half)  # the P MMA's sums before the N MMA's
  sums = np.einsum("npk,nk->np", digits, w2)  # S0, S1, S2
  assert np.abs(partial).max() < 2**15 and np.abs(sums).max() < 2**15
  i32 = lambda v: ((np.asarray(v, np.int64) + 2**31) % 2**32 - 2**31).astype(np.int32)  # noqa: E731
  s0, s1, s2 = (i32(r2.MAGIC + sums[:, 0]), i32(sums[:, 1]), i32(r2.MAGIC + sums[:, 2]))
  t_new = i32(s1.astype(np.int64) * 64 + s0)
  t_old = i32(sums[:, 0] + sums[:, 1] * 64 + r2.MAGIC)
  assert np.array_equal(t_new, t_old)
  as_f32 = lambda v: v.view(np.float32).astype(np.float64) - 1.5 * 2**23  # noqa: E731
  assert np.array_equal(as_f32(t_new), sums[:, 0] + 64.0 * sums[:, 1])
  assert np.array_equal(as_f32(s2), sums[:, 2].astype(np.float64))


def _shfl_xor(lanes, values, mask):
  return {(g, t4): values[(g, t4 ^ mask)] for g, t4 in lanes}


def test_one_row_body_gives_each_lane_the_three_planes_of_its_row():
  """`roles_v2._stage` with one row: lane t4 = 0 takes row g, t4 = 1 row g + 8; after the K loop row g + 8 moves to
  lane t4 = 0's accumulator 2 (slot 0's), where the pass epilogue reads it."""
  r = _c_fragment(lambda row, n: ("S%d" % r2.PLANE_COLUMNS[n], row, _start(n)))
  lanes = list(r)
  s2 = _shfl_xor(lanes, {k: v[2] if k[1] == 3 else v[0] for k, v in r.items()}, 2)
  for (g, t4), v in r.items():
    if t4 > 1:
      continue  # lanes t4 = 2, 3 compute padding
    upper = t4 == 1
    row = g + 8 if upper else g
    planes = (v[2] if upper else v[0], v[3] if upper else v[1], s2[(g, t4)])
    assert [p[:2] for p in planes] == [("S0", row), ("S1", row), ("S2", row)], (g, t4, planes)
    _biased(planes)
  acc = {(g, t4): ("acc", g + 8 * (t4 == 1)) for g, t4 in lanes}
  moved = _shfl_xor(lanes, acc, 1)
  assert all(acc[(g, 0)] == ("acc", g) and moved[(g, 0)] == ("acc", g + 8) for g in range(8))


def test_two_row_body_gives_each_lane_the_three_planes_of_its_slot_and_row():
  """`roles_v2._stage` with two rows: lane t4 takes (slot t4 % 2, row g + 8 (t4 // 2)) and after the K loop lane
  t4 = 0 gathers the four, accumulator c = (slot c % 2, row g + 8 (c // 2)) as the pass epilogue reads them."""
  r = _c_fragment(lambda row, n: ("S%d" % r2.PLANE_COLUMNS[n], r2.PAIR_SLOT_COLUMNS[n], row, _start(n)))
  lanes = list(r)
  x = _shfl_xor(lanes, {k: v[2] if k[1] < 2 else v[0] for k, v in r.items()}, 2)
  y = _shfl_xor(lanes, {k: v[3] for k, v in r.items()}, 2)
  for (g, t4), v in r.items():
    lo = t4 < 2
    slot, row = t4 % 2, g + 8 * (t4 // 2)
    planes = (v[0] if lo else x[(g, t4)], v[1] if lo else y[(g, t4)], x[(g, t4)] if lo else v[2])
    assert [p[:3] for p in planes] == [("S0", slot, row), ("S1", slot, row), ("S2", slot, row)], (g, t4, planes)
    _biased(planes)
  acc = {(g, t4): (t4 % 2, g + 8 * (t4 // 2)) for g, t4 in lanes}
  for c in range(1, 4):
    moved = _shfl_xor(lanes, acc, c)
    assert all(moved[(g, 0)] == (c % 2, g + 8 * (c // 2)) for g in range(8))


def test_four_row_body_gives_each_lane_the_three_planes_of_its_slot_for_both_rows():
  """`roles_v2._stage` with 3 or 4 rows: B fragment X (column n = slot n >> 1, plane n & 1) and Y (column n = slot
  n >> 1, plane 2) leave lane t4 the planes of (slot t4, row g) and (slot t4, row g + 8) in its own registers; after
  the K loop lanes t4 = 0, 1 gather the 1-tile layout, accumulator c = (slot 2 t4 + c % 2, row g + 8 (c // 2))."""
  x = _c_fragment(lambda row, n: ("S%d" % r2.QUAD_X_PLANES[n], r2.QUAD_SLOT_COLUMNS[n], row, _start(n)))
  y = _c_fragment(lambda row, n: ("S2", r2.QUAD_SLOT_COLUMNS[n], row, _start(n)))
  for (g, t4), v in x.items():
    w = y[(g, t4)]
    for h in range(2):
      planes = (v[2 * h], v[2 * h + 1], w[2 * h])
      assert [p[:3] for p in planes] == [("S0", t4, g + 8 * h), ("S1", t4, g + 8 * h), ("S2", t4, g + 8 * h)]
      _biased(planes)
  acc = {(g, t4): [(t4, g), (t4, g + 8)] for g in range(8) for t4 in range(4)}
  for g in range(8):
    for t4 in range(2):  # lanes t4 = 2, 3 gather padding slots 4-7
      even, odd = (2 * t4) & 3, (2 * t4 + 1) & 3  # `_chunk`'s source lanes in the quad
      moved = [acc[(g, even)][0], acc[(g, odd)][0], acc[(g, even)][1], acc[(g, odd)][1]]
      assert moved == [(2 * t4 + c % 2, g + 8 * (c // 2)) for c in range(4)], (g, t4)


def test_scale_byte_prmt_extracts_each_byte():
  rng = np.random.default_rng(3)
  for w in rng.integers(0, 1 << 32, 500, dtype=np.int64):
    for s in range(4):
      assert _prmt(int(w), 0, 0x4440 + s) == (int(w) >> (8 * s)) & 0xFF


def _e4m3_hl(code: int) -> tuple[int, int]:
  """`roles_v2._e4m3_hl` of a byte, the fma exact in float64 (its result is exact in float32)."""
  sgn, em = (code << 24) & 0x80000000, (code << 20) & 0x07F00000
  f = float(np.array([sgn | em], np.uint32).view(np.float32)[0])
  magic = float(np.array([r2.MAGIC_FP8], np.uint32).view(np.float32)[0])
  r = np.float32(f * float(np.array([r2.F32_2P127], np.uint32).view(np.float32)[0]) + magic)
  assert float(r) == f * 2.0**127 + magic, "the fma must be exact"
  n = int(np.array([r], np.float32).view(np.int32)[0]) - r2.MAGIC_FP8
  h = n >> 6 if em >= r2.E4M3_EM_ONE else 0
  return h, n - (h << 6)


def test_shared_weight_split_of_every_e4m3_byte():
  """The arithmetic split that fills the digit table (`roles_v2._e4m3_hl`) gives `reference._e4m3_split` of 512 v for
  every finite E4M3 byte."""
  values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 512
  for code in range(256):
    if not np.isfinite(values[code]):
      continue
    n = int(values[code])
    want = (n // 64, 0) if abs(n) >= 512 else (0, n)
    assert _e4m3_hl(code) == want, f"byte {code:#04x}"


def _signed_digits(v: int) -> tuple[int, int]:
  """`roles_v2._sign_digits(v, 2)`, high digit first: v = 64 d1 + d0, both digits carrying the sign of v."""
  m = abs(v)
  sgn = -1 if v < 0 else 1
  return sgn * (m >> 6), sgn * (m & 63)


def _digit_table() -> list[int]:
  """`roles_v2._digit_entry` of every byte (the decode table `SH_TAB`), from the emulated `_e4m3_hl`."""
  out = []
  for code in range(256):
    h, lo = _e4m3_hl(code)
    d = _signed_digits(h) + _signed_digits(lo)
    out.append(sum((x & 0xFF) << (8 * i) for i, x in enumerate(d)))
  return out


def _s8(byte: int) -> int:
  return byte - 256 if byte >= 128 else byte


def test_shared_digit_table_gives_hi_and_lo_of_every_e4m3_byte():
  """Each finite E4M3 byte's table word holds signed digits H1, H0, L1, L0 with 64 H1 + H0 = hi and 64 L1 + L0 = lo
  (`reference._e4m3_split` of 512 v), within the bounds the chain sums below assume."""
  values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 512
  for code, word in enumerate(_digit_table()):
    if not np.isfinite(values[code]):
      continue
    n = int(values[code])
    want = (n // 64, 0) if abs(n) >= 512 else (0, n)
    h1, h0, l1, l0 = (_s8((word >> (8 * i)) & 0xFF) for i in range(4))
    assert (64 * h1 + h0, 64 * l1 + l0) == want, f"byte {code:#04x}"
    assert abs(h1) <= 56 and abs(h0) <= 63 and abs(l1) <= 7 and abs(l0) <= 63
    assert h1 * l1 == 0 and h0 * l0 == 0  # one of hi, lo is 0, so F = H | L bytewise


def test_shared_digit_decode_transposes_four_bytes_into_planes():
  """`roles_v2._e4m3_digits`: four table words, then eight prmt, give plane p's byte i = digit p of byte i."""
  table = _digit_table()
  rng = np.random.default_rng(5)
  for w in rng.integers(0, 2**32, 2000, dtype=np.int64):
    w = int(w)
    t = [table[(w >> (8 * i)) & 0xFF] for i in range(4)]
    u0, u1 = _prmt(t[0], t[1], r2.PRMT_BYTES01), _prmt(t[0], t[1], r2.PRMT_BYTES23)
    w0, w1 = _prmt(t[2], t[3], r2.PRMT_BYTES01), _prmt(t[2], t[3], r2.PRMT_BYTES23)
    lo, hi = r2.PRMT_HALVES_LO, r2.PRMT_HALVES_HI
    planes = (_prmt(u0, w0, lo), _prmt(u0, w0, hi), _prmt(u1, w1, lo), _prmt(u1, w1, hi))
    for p in range(4):
      for i in range(4):
        assert (planes[p] >> (8 * i)) & 0xFF == (t[i] >> (8 * p)) & 0xFF
    # the table offsets the kernel ORs into the 1024-aligned table base
    offs = [(w << 2) & 0x3FC, (w >> 6) & 0x3FC, (w >> 14) & 0x3FC, (w >> 22) & 0x3FC]
    assert offs == [4 * ((w >> (8 * i)) & 0xFF) for i in range(4)]
  assert r2.SH_TAB % 1024 == 0 and r2.SH_TAB + 1024 <= r2.SH_W


def test_shared_lane_table_is_read_and_filled_without_bank_conflicts():
  """The per-lane decode table (`roles_v2.SH_LANE_TAB`, `GCMOE_ABLATION=lanetab`): lane l's lookup of byte i of its
  word (one prmt, then the lane's column plus 128 x the byte) reads word (byte, l), the code's entry, so a warp's 32
  lookups hit 32 banks whatever the codes (the single table: ~2.5 wavefronts a lookup on MXFP8 weights of a normal
  matrix); the fill (thread c stores code c's 32 copies, rotated by c) writes every word once, a warp's stores in 32
  banks."""
  table = _digit_table()
  words = [None] * (256 * 32)
  for q in range(32):
    for warp in range(8):
      banks = set()
      for lane in range(32):
        c = 32 * warp + lane
        addr = c * 128 + ((c + q) % 32) * 4  # `_shared_core`'s fill, offsets from the table
        assert words[addr // 4] is None
        words[addr // 4] = table[c]
        banks.add((addr // 4) % 32)
      assert len(banks) == 32
  assert None not in words
  rng = np.random.default_rng(6)
  single, lanes = [], []
  x = rng.standard_normal((64, 32, 128))  # MXFP8 of a normal matrix, groups of 128 (a power-of-two scale each)
  scale = 2.0 ** np.ceil(np.log2(np.abs(x).max(axis=-1, keepdims=True) / 448))
  codes = (x / scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(64, 4096)
  for r in range(0, 64, 8):
    for k in range(0, 4096, 16):
      ws = codes[r:r + 8, k:k + 16].reshape(32, 4).astype(np.int64)  # 8 rows x 4 lanes' words
      ws = [int(sum(int(b) << (8 * i) for i, b in enumerate(row))) for row in ws]
      for i in range(4):
        addrs = [lane * 4 + _prmt(w, 0, r2.PRMT_BYTE0 + i) * 128 for lane, w in enumerate(ws)]
        assert [words[a // 4] for a in addrs] == [table[(w >> (8 * i)) & 0xFF] for w in ws]
        lanes.append(_wavefronts(addrs))
        single.append(_wavefronts([4 * ((w >> (8 * i)) & 0xFF) for w in ws]))
  assert max(lanes) == 1 and np.mean(single) > 2


def _wavefronts(addrs: list[int]) -> int:
  """SMEM wavefronts of one warp's 4-byte loads: the most distinct words that fall in one bank."""
  return max(np.bincount([a // 4 % 32 for a in set(addrs)], minlength=32))


def _f32(v: float) -> np.float32:
  return np.float32(v)  # one rounding of an exact float64 value


def _sh_block_p(wb: np.ndarray, xb: np.ndarray) -> np.float32:
  """`roles_v2.RoleKernelsV2._sh_compute`'s p of one K32 block (before the scaling), emulated: the nine digit chains
  through int32 with the magic starts, the float32 conversions and the FMAs."""
  table = _digit_table()
  dw = np.array([[_s8((table[b] >> (8 * p)) & 0xFF) for p in range(4)] for b in wb], np.int64)  # [32, 4]
  dx = np.array([[_s8((table[b] >> (8 * p)) & 0xFF) for p in range(4)] for b in xb], np.int64)
  h1w, h0w, l1w, l0w = dw.T
  h1x, h0x, l1x, l0x = dx.T
  f1w, f0w, f1x, f0x = h1w + l1w, h0w + l0w, h1x + l1x, h0x + l0x
  u32 = lambda v: v & 0xFFFFFFFF  # noqa: E731
  magic = r2.MAGIC
  c = [u32(magic + int(v)) for v in (h1w @ h1x, h1w @ h0x + h0w @ h1x, h0w @ h0x)]
  d = [u32(magic + int(v)) for v in (l1w @ l1x, l1w @ l0x + l0w @ l1x, l0w @ l0x)]
  ff = (f1w @ f1x, f1w @ f0x + f0w @ f1x, f0w @ f0x)
  e = [u32(u32(r2.MAGIC3) - c[i] - d[i] + int(ff[i])) for i in range(3)]
  # `GCMOE_ABLATION=shfree`: the F chains start at 3 MAGIC (a signed int32: no MMA step wraps) and Shh's and Sll's ends
  # are subtracted after them, mod 2**32: the same words
  partial = (f1w @ f1x, f1w @ f0x, f1w @ f0x + f0w @ f1x, f0w @ f0x)
  assert all(abs(r2.MAGIC3 + int(v)) < 2**31 for v in partial)
  assert [u32(u32(r2.MAGIC3 + int(ff[i])) - c[i] - d[i]) for i in range(3)] == e
  for chain in c + d + e:  # every chain ends at the float32 bits of 1.5 2**23 + S, |S| < 2**22
    assert abs(chain - magic) < 2**22

  def f32_of(chains):
    f = [float(np.array([v], np.uint32).view(np.float32)[0]) - 1.5 * 2**23 for v in chains]
    inner = f[0] * 64 + f[1]
    assert abs(inner) < 2**24  # exact
    return _f32(inner * 64 + f[2])

  fhh, fhx, fll = f32_of(c), f32_of(e), f32_of(d)
  q = _f32(float(fhh) * 2.0**-6 + float(_f32(float(fhx) * 2.0**-12)))
  return _f32(float(fll) * 2.0**-18 + float(q))


def _oracle_block_p(wb: np.ndarray, xb: np.ndarray) -> np.float32:
  """`reference._gemm`'s FP8 x FP8 p of one block (before the scaling), in float32 as the oracle computes it."""
  wv = np.asarray(wb, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 512
  xv = np.asarray(xb, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 512
  wi, xi = wv.astype(np.int64), xv.astype(np.int64)
  split = lambda n: (np.where(np.abs(n) >= 512, n // 64, 0), np.where(np.abs(n) >= 512, 0, n))  # noqa: E731
  wh, wl = split(wi)
  xh, xl = split(xi)
  shh = np.float32(np.sum(xh * wh))
  sx = np.float32(np.sum(xh * wl + xl * wh))
  sll = np.float32(np.sum(xl * wl))
  return (shh * np.float32(2.0**-6) + sx * np.float32(2.0**-12)) + sll * np.float32(2.0**-18)


def test_shared_tensor_core_block_dots_equal_the_oracle():
  """The twelve-MMA form of an FP8 x FP8 block gives the oracle's p bit for bit: random blocks of every magnitude mix
  (all hi, all lo, subnormals, mixed signs) and the extreme blocks; every nonzero p lies in the fast path's window."""
  codes = np.array([c for c in range(256) if np.isfinite(np.uint8(c).view(ml_dtypes.float8_e4m3fn).astype(float))],
                   np.int64)
  small = codes[np.abs(np.uint8(codes).view(ml_dtypes.float8_e4m3fn).astype(float)) < 1]
  big = codes[np.abs(np.uint8(codes).view(ml_dtypes.float8_e4m3fn).astype(float)) >= 1]
  rng = np.random.default_rng(11)
  cases = [(np.full(32, 0x7E), np.full(32, 0x7E)), (np.full(32, 0x7E), np.full(32, 0xFE)),  # +-448 everywhere
           (np.full(32, 0x37), np.full(32, 0x37)),  # 0.9375: the largest lo
           (np.full(32, 0x7E), np.full(32, 0x37))]
  for _ in range(400):
    pools = [codes, small, big, rng.choice(codes, 4)]
    cases.append((rng.choice(pools[rng.integers(4)], 32), rng.choice(pools[rng.integers(4)], 32)))
  for wb, xb in cases:
    got, want = _sh_block_p(wb, xb), _oracle_block_p(wb, xb)
    assert got.view(np.uint32) == want.view(np.uint32), (wb, xb, got, want)
    assert got == 0 or 2.0**-18 <= abs(float(got)) < 2.0**23


def _sh_two_rows_p(wrows: np.ndarray, xb: np.ndarray) -> list[list[np.float32]]:
  """`roles_v2.RoleKernelsV2._sh_two_rows`'s p of one K32 block of 16 weight rows ``wrows`` [16, 32] x two tokens
  ``xb`` [2, 32] ([token][row]), emulated through its two m16n8 tiles: the columns lane g loads, the six MMAs, the
  int32 sums per lane, the shuffles of lanes t4 = 0 and 2, the float32 conversions and the FMAs."""
  table = _digit_table()
  planes = lambda b: np.array([[_s8((table[v] >> (8 * q)) & 0xFF) for q in range(4)] for v in b], np.int64)  # noqa
  dx = [planes(xb[t]) for t in range(2)]  # [32, 4] each: H1, H0, L1, L0
  bh, bl, bf = (np.zeros((32, 8), np.int64) for _ in range(3))
  for g in range(8):
    (bh if g % 4 < 2 else bl)[:, g] = dx[g // 4][:, g % 4]
    if g < 4:
      bf[:, g] = dx[(g // 2) % 2][:, g % 2] | dx[(g // 2) % 2][:, g % 2 + 2]
  dw = np.stack([planes(row) for row in wrows])  # [16, 32, 4]
  ah1, ah0, al1, al0 = (dw[:, :, q] for q in range(4))
  af1, af0 = ah1 | al1, ah0 | al0
  x, y = ah1 @ bh + al1 @ bl, ah0 @ bh + al0 @ bl  # [16 rows, 8 columns]
  xf, yf = af1 @ bf, af0 @ bf

  def lane(a, b, row, t4):  # lane t4's int32 sum of rows ``row`` from the accumulators a (X) and b (Y)
    return 4096 * a[row, 2 * t4] + 64 * (a[row, 2 * t4 + 1] + b[row, 2 * t4]) + b[row, 2 * t4 + 1]

  out = [[], []]
  for tok in range(2):
    t4 = 2 * tok  # the lane that forms p of this token
    for row in range(16):
      hl, ll = lane(x, y, row, t4), lane(x, y, row, t4 ^ 1)
      ff = lane(xf, yf, row, 0 if t4 == 0 else 1)  # its own, or t4 = 1's by the shuffle
      assert all(abs(v) < 2**31 for v in (hl, ll, ff))  # int32, no wrap
      fhh, fhx, fll = _f32(hl), _f32(ff - hl - ll), _f32(ll)
      q = _f32(float(fhh) * 2.0**-6 + float(_f32(float(fhx) * 2.0**-12)))
      out[tok].append(_f32(float(fll) * 2.0**-18 + float(q)))
  return out


def test_shared_two_token_block_dots_equal_the_oracle():
  """The two-token form (six MMAs over the two tokens' planes in the columns of two n-tiles) gives the oracle's p bit
  for bit for every row and both tokens: random rows of every magnitude mix against random token pairs (every fourth
  with a zero second token, as a one-token group runs it), and the extreme blocks."""
  codes = np.array([c for c in range(256) if np.isfinite(np.uint8(c).view(ml_dtypes.float8_e4m3fn).astype(float))],
                   np.int64)
  vals = np.abs(np.uint8(codes).view(ml_dtypes.float8_e4m3fn).astype(float))
  pools = [codes, codes[vals < 1], codes[vals >= 1], np.array([0x7E, 0xFE]), np.array([0x37, 0xB7])]
  rng = np.random.default_rng(13)
  for i in range(40):
    wrows = np.stack([rng.choice(pools[rng.integers(len(pools))], 32) for _ in range(16)])
    xb = np.stack([rng.choice(pools[rng.integers(len(pools))], 32) for _ in range(2)])
    if i % 4 == 3:
      xb[1] = 0  # a one-token group: the second token's planes are zeros (`_sh_issue`'s zero fill)
    got = _sh_two_rows_p(wrows, xb)
    for tok in range(2):
      for row in range(16):
        want = _oracle_block_p(wrows[row], xb[tok])
        assert got[tok][row].view(np.uint32) == want.view(np.uint32), (tok, wrows[row], xb[tok], got[tok][row], want)


def test_role2_pass_width_follows_the_rows_per_expert():
  """sm_90a (`abi.PASS_TIERS`): two CTAs per SM and passes of 16 rows up to r = ceil(C k / E) = 8 rows per expert
  at the token capacity C, of 32 rows up to r = 32, else one CTA and 64 rows; the 32-row variants' pipeline holds
  four stages of the 4-tile pass in the SMEM of one of two CTAs. The fused transport and sm_120a keep the rule by
  capacity (two CTAs up to 32 tokens)."""
  from gcmoe_jax.kernels.build import Variant
  want = {(6144, 2048, 32, 8): {8: (2, 2), 32: (2, 2), 64: (4, 2), 128: (4, 2), 256: (8, 1)},  # GLM5.2 per rank
          (5120, 2304, 48, 6): {8: (2, 2), 64: (2, 2), 128: (4, 2), 256: (4, 2)}}  # DSV4.1-Flash per rank
  for (h, i, e, k), tiers in want.items():
    for cap, tier in tiers.items():
      kern = r2.RoleKernelsV2(Variant(h, i, e, k, cap))
      assert (kern.nt_max, kern.ctas_per_sm(2)) == tier == abi.pass_tier(cap, k, e), (h, cap)
      if kern.ctas == 2:
        assert 2 * (kern.dynamic_smem(2) + r2.STATIC_SMEM + 1024) <= 228 * 1024  # two CTAs share the SM's SMEM
      assert r2.stages(kern.nt_max, kern.pipe_bytes) == {2: 6, 4: 4, 8: 4}[kern.nt_max]
      assert r2.stages(1, kern.pipe_bytes) == {2: 8, 4: 7, 8: 8}[kern.nt_max]
  glm = Variant(6144, 2048, 32, 8, 64)
  assert abi.pass_tier(64, 8, 32, "onecta") == (8, 1) and abi.pass_tier(32, 8, 32, "onecta") == (2, 2)
  # k = 1 (the expert-parallel local op, its chunks sorted by expert): by capacity, as before session 27.
  assert abi.pass_tier(256, 1, 32) == abi.pass_tier(64, 1, 8) == (8, 1) and abi.pass_tier(32, 1, 32) == (2, 2)
  assert (r2.RoleKernelsV2(Variant(512, 256, 8, 1, 256)).nt_max, abi.pass_tier(256, 4, 8)) == (8, (8, 1))
  assert abi.pass_tier(64, 4, 8) == abi.pass_tier(16, 8, 8) == (4, 2)  # the small shape's 32-row variants
  assert r2.RoleKernelsV2(glm, "sm_120a").ctas_per_sm(2) == 1
  assert r2.RoleKernelsV2(dataclasses.replace(glm, capacity=32), "sm_120a").ctas_per_sm(2) == 2
  fused = r2.RoleKernelsV2(dataclasses.replace(glm, ranks=2))
  assert (fused.nt_max, fused.ctas) == (8, 1)


def test_role2_runs_the_passes_wider_than_the_split_decode_on_bf16_wgmma_where_the_workspace_has_their_planes(
    monkeypatch):
  """`abi.bf16_passes` is one rule for role 2 (`RoleKernelsV2.bf16`) and the workspace (the BF16 planes `xbf`,
  ``abf``, last): sm_90a, one GPU, a widest pass of more than `SPLIT_DECODE_NT` n-tiles, with or without the shared
  expert; two block sums in flight at one CTA per SM, one at two. ``GCMOE_ABLATION=int8wide`` turns it off,
  ``bf16one`` / ``bf16two`` set the block sums everywhere."""
  from gcmoe_jax.kernels.build import Variant
  glm = Variant(6144, 2048, 32, 8, 64)
  want = {glm: True, dataclasses.replace(glm, capacity=32): False, dataclasses.replace(glm, capacity=256): True,
          dataclasses.replace(glm, shared_intermediate=2048, shared_group=128): True,
          Variant(5120, 2304, 48, 6, 64): False, Variant(5120, 2304, 48, 6, 128): True,
          dataclasses.replace(glm, ranks=2): False, Variant(512, 256, 8, 1, 256): True,
          Variant(512, 256, 8, 1, 16): False}
  for v, on in want.items():
    kern, ws = r2.RoleKernelsV2(v), v.workspace("v2")
    assert kern.bf16 == on == abi.bf16_passes(v.capacity, v.top_k, v.experts, v.ranks), v
    assert (kern.nt_max > r2.SPLIT_DECODE_NT or not on) and not r2.RoleKernelsV2(v, "sm_120a").bf16
    assert ws.total - ws.xbf == (2 * v.capacity * (v.hidden + v.top_k * v.intermediate) if on else 0), v
    if on:
      assert ws.abf - ws.xbf == 2 * v.capacity * v.hidden and kern.bf16_sets == (2 if kern.ctas == 1 else 1), v
  for ablation, sets in (("int8wide", None), ("bf16one", 1), ("bf16two", 2)):
    monkeypatch.setenv("GCMOE_ABLATION", ablation)
    for v in (glm, dataclasses.replace(glm, capacity=256)):
      kern, ws = r2.RoleKernelsV2(v), v.workspace("v2")
      assert (kern.bf16_sets if kern.bf16 else None) == sets and (ws.total > ws.xbf) == (sets is not None), v


def test_role2_runs_the_shared_experts_groups_on_bf16_wgmma_where_the_workspace_has_their_planes(monkeypatch):
  """`abi.shared_bf16` is one rule for role 2 (`RoleKernelsV2.sh_bf16`) and the workspace (``xbf``, GEMM1's B, also
  where no routed pass is wide; ``sabf`` and ``saflag``, GEMM2's, last): with a shared expert, sm_90a, one GPU,
  under ``GCMOE_ABLATION=shbf16`` (off by default)."""
  from gcmoe_jax.kernels.build import Variant
  glm = Variant(6144, 2048, 32, 8, 32, 2048, 128)  # capacity 32: no routed BF16 pass
  cases = {glm: True, dataclasses.replace(glm, capacity=256): True, Variant(6144, 2048, 32, 8, 32): False,
           dataclasses.replace(glm, ranks=2): False, Variant(512, 256, 8, 4, 16, 256, 32): True}
  for ablation in ("", "shbf16"):
    monkeypatch.setenv("GCMOE_ABLATION", ablation)
    for v, on in cases.items():
      on = on and ablation == "shbf16"
      kern, ws = r2.RoleKernelsV2(v), v.workspace("v2")
      assert kern.sh_bf16 == on == abi.shared_bf16(v.shared, v.ranks, ablation), v
      assert not r2.RoleKernelsV2(v, "sm_120a").sh_bf16
      if on:
        assert ws.abf - ws.xbf == 2 * v.capacity * v.hidden or kern.bf16, v
        assert ws.saflag - ws.sabf == 2 * v.capacity * v.shared_intermediate, v
        assert 4 * v.capacity <= ws.total - ws.saflag < 4 * v.capacity + 256, v
      else:
        assert ws.total == ws.sabf, v


def _kpair_order(n_tiles: int, per_bar: int) -> list[int]:
  """The K128 tiles in the order warps 0-3 of a `kpair` pass add their blocks (`_cpasync_mainloop`): after each
  barrier the other half's tiles of the step before (`_kpair_add`), then their own; after the loop the last step's."""
  steps = n_tiles // 2 // per_bar
  order = []
  for kq in range(steps):
    if kq:
      order += [r2.kpair_tile((kq - 1) * per_bar + r, 1, per_bar) for r in range(per_bar)]
    order += [r2.kpair_tile(kq * per_bar + q, 0, per_bar) for q in range(per_bar)]
  return order + [r2.kpair_tile((steps - 1) * per_bar + r, 1, per_bar) for r in range(per_bar)]


def test_kpair_tiles_reach_the_accumulators_in_k_order(monkeypatch):
  """`GCMOE_ABLATION=kpair`: warps 0-3 add every K128 tile of the GEMM2 item once, in increasing K, whether the
  stages meet at a barrier every one or two; the build has it in the one-GPU variants of 16-row passes whose GEMM2
  K is an even number of tiles, without the shared expert, with a stage's room left for the warps' p."""
  from gcmoe_jax.kernels.build import Variant
  for n_tiles in range(2, 41, 2):
    for per_bar in (1, 2):
      if (n_tiles // 2) % per_bar == 0:
        assert _kpair_order(n_tiles, per_bar) == list(range(n_tiles)), (n_tiles, per_bar)
  assert _kpair_order(4, 1) == [0, 1, 2, 3] and r2.kpair_tile(1, 1, 2) == 3  # stage 1 of a pair: tiles 1 and 3
  glm, dsv, small = Variant(6144, 2048, 32, 8, 8), Variant(5120, 2304, 48, 6, 16), Variant(512, 256, 8, 4, 16)
  assert not any(r2.RoleKernelsV2(v).kpair for v in (glm, dsv, small))  # only the kpair build
  monkeypatch.setenv("GCMOE_ABLATION", "kpair")
  for v in (glm, dsv, small):
    kern = r2.RoleKernelsV2(v)
    assert kern.kpair and kern.nt_max <= r2.SPLIT_DECODE_NT, v
    p_room = 2 * 2 * (r2.WARPS // 2) * r2.KPAIR_P_BYTES  # two sets of two stages' p of warps 4-7
    assert (r2.stages(1, kern.pipe_bytes) - 1) * r2.stage_bytes(1) + p_room <= kern.pipe_bytes
  for v in (dataclasses.replace(glm, capacity=64), dataclasses.replace(small, intermediate=384),
            dataclasses.replace(glm, ranks=2), dataclasses.replace(glm, shared_intermediate=2048, shared_group=128)):
    # 32-row passes; three GEMM2 K tiles; the fused transport; the shared expert (its registers)
    assert not r2.RoleKernelsV2(v).kpair, v
  assert not r2.RoleKernelsV2(glm, "sm_120a").kpair


def test_shared_expert_smem_fits_the_pipeline_area_and_sm120():
  """The shared-expert items run in the pipeline's SMEM (sm_90a) and within SM120's per-CTA budget; the one-CTA
  sm_90a variants take token groups of two n-tiles, the others one."""
  from gcmoe_jax.kernels.build import Variant
  for arch in ("sm_90a", "sm_120a"):
    for shape in ((512, 256, 8, 4, 16, 256, 128), (512, 256, 8, 4, 64, 256, 32), (512, 256, 8, 4, 256, 256, 32),
                  (6144, 2048, 32, 8, 32, 2048, 128), (6144, 2048, 32, 8, 128, 2048, 128),
                  (6144, 2048, 32, 8, 256, 2048, 128)):
      h, i, e, k, t, s, g = shape
      kern = r2.RoleKernelsV2(Variant(hidden=h, intermediate=i, experts=e, top_k=k, capacity=t,
                                      shared_intermediate=s, shared_group=g), arch)
      wide = arch == "sm_90a" and abi.pass_tier(t, k, e)[1] == 1  # more than 32 rows per expert at capacity t
      assert kern.ctas_per_sm(2) == (1 if wide or arch != "sm_90a" else 2)
      assert kern.sh.tokens == (r2.SH_TOKENS_WIDE if wide else r2.SH_TOKENS)
      assert kern.shared_smem == (r2.SH_BYTES_WIDE if wide else r2.SH_BYTES) and not kern.sh.lane_tab
      assert kern.shared_smem <= kern.pipe_bytes or arch != "sm_90a"
      assert kern.dynamic_smem(2) >= kern.pipe + kern.shared_smem
      if arch == "sm_90a":  # `GCMOE_ABLATION=lanetab`: the table per lane, still two CTAs an SM where there were two
        lt = r2.SharedSmem(kern.sh.tokens, lane_tab=True).bytes
        assert lt <= kern.pipe_bytes or (not wide and 2 * (kern.pipe + lt + r2.STATIC_SMEM + 1024) <= 228 * 1024)
  half = r2.SH_ROWS // 2  # the halves of a group of one or two tokens (`_sh_two_rows`)
  slots, blocks = r2._sh_slots(half), 4 * r2._sh_tiles_per_step(half)
  assert slots * r2.SH_STEP == blocks and blocks * r2.SH_BLOCK <= slots * r2.SH_X_STRIDE  # a token's run-on fits
  for tokens in (r2.SH_TOKENS, r2.SH_TOKENS_WIDE):
    sh = r2.SharedSmem(tokens)
    # A half's tokens run on over `slots` token slots each, and its p rows are (block, token): within a buffer.
    assert abi.HALVES_TOKENS * slots <= tokens and blocks * abi.HALVES_TOKENS <= r2.SH_STEP * tokens
    assert r2.SH_X < sh.xe < sh.p < sh.acc < sh.bytes == sh.acc + tokens * r2.SH_ROWS * 4
    assert sh.p % 16 == 0 and sh.xe % 16 == 0  # cp.async destinations, vector loads
    lt = r2.SharedSmem(tokens, lane_tab=True)
    assert (lt.xe, lt.p, lt.acc) == (sh.xe, sh.p, sh.acc) and sh.bytes == lt.tab == lt.bytes - r2.SH_LANE_TAB
    assert lt.tab % 128 == 0  # a code's 32 copies in one 128-byte row
  assert r2.SH_X_STRIDE % 16 == 0 and (r2.SH_X_STRIDE // 4) % 32 == 8  # cp.async chunks; conflict-free B loads
  assert (2 * r2.SH_P_ROWS) % 32 == 8  # the C fragments' stores: 8 t4 + g covers the banks



def _any_schedule(rows: int, kb_n: int, n_st: int, ready_step: list[int],
                  poll_pending: int = r2.ANY_POLL_PENDING) -> tuple[list[int], list[str]]:
  """A step model of a `kbany` pass (`RoleKernelsV2._any_mainloop`, `_any_pick`, `_any_poll`): K128 stage kb is
  ready from barrier step ``ready_step[kb]`` on (its two GEMM1 items done); returns the stages in the order they are
  computed, and every broken rule: a copy group computed before `cp.async.wait_group` covers it, a stage slot
  written while a group in it is still to be computed, a `CTL_ANY_SIG` entry rewritten before the barrier after its
  last read."""
  ahead = n_st - 2
  issued, snapshot = set(), set()
  sig = {}  # copy group -> its stage, or None
  order, broken = [], []

  def pick(step: int, g0: int, n: int, pending: int) -> int:
    nonlocal snapshot
    left = set(range(kb_n)) - issued
    wanted = {min(left)} if rows == 2 and left else left
    if not wanted & snapshot and left and pending <= poll_pending:
      snapshot = {kb for kb in range(kb_n) if ready_step[kb] <= step}
      if pending == 0 and not wanted & snapshot:
        step = min(ready_step[kb] for kb in wanted)  # the blocking poll sleeps until then
        snapshot = {kb for kb in range(kb_n) if ready_step[kb] <= step}
    for g in range(g0, g0 + n):
      left = set(range(kb_n)) - issued
      cand = sorted(snapshot & ({min(left)} if rows == 2 and left else left))
      sig[g] = cand[0] if cand else None
      issued.update(cand[:1])
      old = g - r2.ANY_SIG_RING  # computed at step old // 2 + 1; rewritten after barrier step - 1
      if old >= 0 and step - 1 < old // 2 + 2:
        broken.append(f"CTL_ANY_SIG entry of group {old} rewritten at step {step}")
    return step

  step = pick(0, 0, ahead, 0)
  committed = ahead
  kb = 0
  while len(order) < kb_n:
    step += 1
    landed = committed - (ahead - 2)  # groups below this have landed: `wait_group(ahead - 2)`
    step = pick(step, kb + ahead, 2, sum(sig[g] is not None for g in range(kb, kb + ahead)))
    for g in (kb + ahead, kb + ahead + 1):  # their copies, issued before this step's groups are computed
      if any(h % n_st == g % n_st for h in range(kb, g)):
        broken.append(f"the slot of group {g} still holds a group to compute")
    committed += 2
    for g in (kb, kb + 1):
      if g >= landed:
        broken.append(f"group {g} computed before it landed")
      if sig[g] is not None:
        order.append(sig[g])
    kb += 2
    if step > 4 * (kb_n + max(ready_step)) + 100:
      broken.append("no progress")
      break
  return order, broken


def test_kbany_passes_take_every_stage_once_and_keep_their_slots_and_ring(monkeypatch):
  """`GCMOE_ABLATION=kbany`: on a step model of its pass (`_any_schedule`) with the GEMM1 items done in random
  order, a one-row pass computes every K128 stage once, in the order they become ready, and a two-row pass in K
  order, no copy group is read before it landed, and no stage slot or ring entry is rewritten early; the build has
  it in the one-GPU routed variants of up to 8 tokens, whose stages (each holding what `_stage`'s body reads) and
  p fit the pipeline area."""
  from gcmoe_jax.kernels.build import Variant
  rng = np.random.default_rng(0)
  glm, dsv, small = Variant(6144, 2048, 32, 8, 8), Variant(5120, 2304, 48, 6, 8), Variant(512, 256, 8, 4, 8)
  assert not any(r2.RoleKernelsV2(v).kbany for v in (glm, dsv, small))  # only the kbany build
  monkeypatch.setenv("GCMOE_ABLATION", "kbany")
  for v in (glm, dsv, small):
    kern = r2.RoleKernelsV2(v)
    kb_n = v.intermediate // 128
    assert kern.kbany, v
    for rows in (1, 2):
      n_st = kern._any_stages(rows)
      p_bytes = kb_n * r2.ANY_P_BYTES if rows == 1 else 0
      assert 4 <= n_st <= r2.MAX_STAGES and n_st * r2.any_stage_bytes(rows) + p_bytes <= kern.pipe_bytes, (v, rows)
      assert r2.W_BYTES + r2.SC_BYTES + 8 * 16 + rows * r2.TOKEN_STRIDE <= r2.any_stage_bytes(rows)
      assert r2.any_stage_bytes(rows) % 128 == 0
      for trial in range(20):
        poll = (r2.ANY_POLL_PENDING, r2.MAX_STAGES)[trial % 2]  # (kbany, kbanyeager)
        order, broken = _any_schedule(rows, kb_n, n_st, list(rng.integers(0, 3 * kb_n, kb_n)), poll)
        assert not broken, (v, rows, broken[:3])
        assert sorted(order) == list(range(kb_n)) and (rows == 1 or order == list(range(kb_n))), (v, rows, order)
    # Stages ready in reverse K order: a one-row pass starts with the last, a two-row one waits for the first.
    backwards = list(range(kb_n))[::-1]
    assert _any_schedule(1, kb_n, kern._any_stages(1), backwards)[0][0] == kb_n - 1
    assert _any_schedule(2, kb_n, kern._any_stages(2), backwards)[0] == list(range(kb_n))
  for v in (dataclasses.replace(glm, capacity=16), dataclasses.replace(glm, ranks=2),
            dataclasses.replace(glm, shared_intermediate=2048, shared_group=128)):
    assert not r2.RoleKernelsV2(v).kbany, v
  assert not r2.RoleKernelsV2(glm, "sm_120a").kbany and r2.RoleKernelsV2(glm).kbany_rows == 2
  monkeypatch.setenv("GCMOE_ABLATION", "kbany1")  # one-row items only
  assert r2.RoleKernelsV2(glm).kbany and r2.RoleKernelsV2(glm).kbany_rows == 1
  monkeypatch.setenv("GCMOE_ABLATION", "kbanyeager")  # polls at every step with nothing to issue
  kern = r2.RoleKernelsV2(glm)
  assert kern.kbany and kern.kbany_rows == 2 and kern.any_poll_pending >= kern._any_stages(1) - 2


def test_block_lane_body_gives_lane_t4_block_t4_and_sums_each_row_in_k_order():
  """`GCMOE_ABLATION=blocklanes` (`roles_v2._stage`, `BL_X`): from a stage's B area holding garbage, the pass's zeros
  (`block_lane_kept`) and the copies of slot 0's four blocks of digit planes (`block_lane_dst`), the four blocks'
  MMAs into X and Y, in one chain per operand or in two (blocks 0-1, 2-3) added with the magic after, leave lane
  (g, t4) the words MAGIC + S0 + 64 S1 and MAGIC + S2 of block t4 for rows g and g + 8; and the three shuffles and
  selects give lane t4 = 0 row g's and lane t4 = 1 row g + 8's blocks in K order."""
  rng = np.random.default_rng(51)
  i32 = lambda v: ((np.asarray(v, np.int64) + 2**31) % 2**32 - 2**31)  # noqa: E731
  a = rng.integers(-12, 13, size=(4, 16, 32))  # 2 w of block s, row r, k
  planes = rng.integers(-32, 33, size=(4, 3, 32))  # digit plane p of block s
  area = rng.integers(-128, 128, size=r2.BL_BYTES)  # what earlier passes left there
  for c in range(r2.BL_CHUNKS):
    if not r2.block_lane_kept(c):
      area[16 * c:16 * c + 16] = 0
  src = planes.reshape(-1)  # the source row's 4 x 96 bytes, as `_issue_x` copies them
  for qq in range(4 * r2.BLOCK_BYTES // 16):
    d = r2.block_lane_dst(qq)
    area[d:d + 16] = src[16 * qq:16 * qq + 16]
  col = lambda base, s: area[base + s * r2.BL_BLOCK:base + (s + 1) * r2.BL_BLOCK].reshape(8, 32).T  # noqa: E731
  mma = lambda s, base: a[s] @ col(base, s)  # noqa: E731  (16 x 8: D[row][column])
  one = ([sum(mma(s, r2.BL_X) for s in range(4))], [r2.MAGIC + sum(mma(s, r2.BL_Y) for s in range(4))])
  two = ([mma(0, r2.BL_X) + mma(1, r2.BL_X), mma(2, r2.BL_X) + mma(3, r2.BL_X)],
         [mma(0, r2.BL_Y) + mma(1, r2.BL_Y), mma(2, r2.BL_Y) + mma(3, r2.BL_Y)])
  sums = np.einsum("srk,spk->srp", a, planes)  # S_p of block s, row r
  for xs, ys in (one, two):
    x = sum(xs)
    y = sum(ys) + (r2.MAGIC if len(ys) == 2 else 0)
    for g in range(8):
      for t4 in range(4):
        for row in (g, g + 8):
          t = i32(x[row, 2 * t4] * 64 + y[row, 2 * t4])
          assert t == i32(r2.MAGIC + sums[t4, row, 0] + 64 * sums[t4, row, 1]), (g, t4, row)
          assert i32(y[row, 2 * t4 + 1]) == i32(r2.MAGIC + sums[t4, row, 2]), (g, t4, row)
  # The gather: lane t4 holds p of (block t4, row g) and (block t4, row g + 8).
  lanes = [(g, t4) for g in range(8) for t4 in range(4)]
  p = {(g, t4): (("p", t4, g), ("p", t4, g + 8)) for g, t4 in lanes}
  odd = {k: k[1] & 1 for k in lanes}
  send = {k: p[k][0] if odd[k] else p[k][1] for k in lanes}
  own = {k: p[k][1] if odd[k] else p[k][0] for k in lanes}
  ra, rb, rc = _shfl_xor(lanes, send, 1), _shfl_xor(lanes, own, 2), _shfl_xor(lanes, send, 3)
  for k in lanes:
    seq = ([ra[k], own[k], rc[k], rb[k]] if odd[k] else [own[k], ra[k], rb[k], rc[k]])
    if k[1] < 2:
      assert seq == [("p", s, k[0] + 8 * k[1]) for s in range(4)], k
