"""The BF16 wide pass's decode and operand maps (`gcmoe_jax.kernels.bf16fold`), checked on the CPU over every code.

Role 2 runs the pass on sm_90a (`abi.bf16_passes`, docs/kernels_v2.md "Session 59"; its GPU check is
tests/test_cuda.py's ``bf16_wide_passes`` test); these pin down the contract it is built to: every E2M1 code decodes
to its folded BF16 value, the fragment's K order is a permutation that the activation plane can follow, so a block's dot
through the maps is the block's dot, and the stage's B area is wgmma's core-matrix layout.
"""

import ml_dtypes
import numpy as np
import pytest

from gcmoe_jax import formats
from gcmoe_jax.kernels import bf16fold as bf

E2M1 = np.asarray(formats.decode_e2m1(np.arange(16, dtype=np.uint8)), np.float64)


def _halves(bits: int) -> tuple[float, float]:
  v = np.array([bits & 0xFFFF, bits >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
  return float(v[0]), float(v[1])


def test_fragment_k_order_is_a_permutation_of_the_block():
  assert sorted(bf.B_PLANE_ORDER.tolist()) == list(range(32))
  for t4 in range(4):
    assert sorted(bf.fragment_positions(t4)) == sorted({2 * t4, 2 * t4 + 1, 2 * t4 + 8, 2 * t4 + 9} |
                                                       {16 + 2 * t4, 17 + 2 * t4, 24 + 2 * t4, 25 + 2 * t4})
    # The lane's K are those of its payload word t4 (bytes 4 t4 .. 4 t4 + 3: K 8 t4 .. 8 t4 + 7).
    assert sorted(bf.fragment_k(t4)) == list(range(8 * t4, 8 * t4 + 8))


@pytest.mark.parametrize("ew", [-63, -20, -9, -1, 0, 1])
def test_every_code_pair_decodes_to_its_folded_weight(ew):
  scale2 = bf.fold_scale(ew)
  for r in range(4):
    for c0 in range(16):
      for c1 in range(16):
        # Nibbles r and r + 4 carry the pair; the other nibbles hold other codes, which must not leak in.
        word = (c0 << (4 * r)) | (c1 << (4 * (r + 4)))
        other = 0x9ABCDEF1 & ~((0xF << (4 * r)) | (0xF << (4 * (r + 4)))) & 0xFFFFFFFF
        lo, hi = _halves(bf.decode_pair(word | other, r, scale2))
        assert (lo, hi) == (E2M1[c0] * 2.0**ew, E2M1[c1] * 2.0**ew), (r, c0, c1, ew)
        assert np.signbit(lo) == (c0 >= 8) and np.signbit(hi) == (c1 >= 8)


def test_fold_scale_of_a_scale_byte_is_the_fold_scale_of_its_exponent():
  for byte in range(0, bf.E2M1_MAX_SCALE_BYTE + 1):
    assert bf.fold_scale_of_byte(byte) == bf.fold_scale(byte - 127), byte
  with pytest.raises(ValueError, match="byte must be in"):
    bf.fold_scale_of_byte(bf.E2M1_MAX_SCALE_BYTE + 1)


def test_plane_position_inverts_the_plane_order():
  assert np.array_equal(bf.B_PLANE_ORDER[bf.B_PLANE_POSITION], np.arange(32))
  assert np.array_equal(bf.B_PLANE_POSITION[bf.B_PLANE_ORDER], np.arange(32))
  assert np.array_equal(bf.plane_position(np.arange(32)), bf.B_PLANE_POSITION)  # the writers' arithmetic


def test_fold_scale_rejects_a_weight_scale_beyond_bf16():
  with pytest.raises(ValueError, match="ew must be <= 1"):
    bf.fold_scale(2)
  assert bf.fold_scale(1) == ((254 << 7) | (254 << 23))


def test_a_block_dot_through_the_maps_is_the_block_dot():
  rng = np.random.default_rng(0)
  for _ in range(50):
    codes = rng.integers(0, 16, 32)
    payload = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)  # byte i: K 2i low, 2i + 1 high
    ew = int(rng.integers(-12, 2))
    x = rng.normal(size=32) * 2.0 ** rng.integers(-8, 8)
    x = np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn), np.float64)  # E4M3 values
    plane = x[bf.B_PLANE_ORDER]  # the activation plane in the fragment's K order
    got = 0.0
    for t4 in range(4):
      word = bf.lane_word(payload, t4)
      vals = [v for r in range(4) for v in _halves(bf.decode_pair(word, r, bf.fold_scale(ew)))]
      got += sum(a * plane[p] for a, p in zip(vals, bf.fragment_positions(t4)))
    want = float(np.sum(E2M1[codes] * 2.0**ew * x))
    assert got == want  # every product and partial sum is exact in float64


E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
FINITE = [c for c in range(256) if np.isfinite(E4M3[c])]


@pytest.mark.parametrize("r,ew,stride", [(0, 0, 1), (1, -30, 5), (2, 7, 5), (3, -1, 5)])
def test_every_e4m3_code_decodes_to_its_folded_shared_weight(r, ew, stride):
  scale2 = bf.fold_scale_e4m3(ew)
  for c0 in FINITE:
    for c1 in FINITE[::stride]:
      # Bytes r of the two words carry the pair; the others hold other codes, which must not leak in.
      w0 = (0x3A5CD17E & ~(0xFF << (8 * r))) | (c0 << (8 * r))
      w1 = (0xB2E4096F & ~(0xFF << (8 * r))) | (c1 << (8 * r))
      lo, hi = _halves(bf.decode_e4m3_pair(w0, w1, r, scale2))
      assert (lo, hi) == (E4M3[c0] * 2.0**ew, E4M3[c1] * 2.0**ew), (r, c0, c1, ew)
      assert np.signbit(lo) == (c0 >= 128) and np.signbit(hi) == (c1 >= 128)


def test_fold_scale_e4m3_rejects_a_weight_scale_beyond_bf16():
  with pytest.raises(ValueError, match="ew must be in"):
    bf.fold_scale_e4m3(8)


def test_a_shared_block_dot_through_the_maps_is_the_block_dot():
  rng = np.random.default_rng(1)
  for _ in range(50):
    codes = rng.choice(FINITE, 32)  # K 0..31 of one (row, block), one E4M3 byte each
    ew = int(rng.integers(-12, 8))
    x = rng.normal(size=32) * 2.0 ** rng.integers(-8, 8)
    x = np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn), np.float64)
    plane = x[bf.B_PLANE_ORDER]  # the same activation plane as the routed GEMM's
    got = 0.0
    for t4 in range(4):
      w0, w1 = bf.shared_lane_words(codes.astype(np.uint8), t4)
      vals = [v for r in range(4) for v in _halves(bf.decode_e4m3_pair(w0, w1, r, bf.fold_scale_e4m3(ew)))]
      got += sum(a * plane[p] for a, p in zip(vals, bf.fragment_positions(t4)))
    want = float(np.sum(E4M3[codes] * 2.0**ew * x))
    assert got == want


def test_the_kernels_fold_multiplier_is_the_models():
  """`fold_scale_bits` (the kernel's IMAD, `roles_v2._fold_mult`) equals `fold_scale` for every byte the fold takes."""
  for byte in range(bf.E2M1_MAX_SCALE_BYTE + 1):
    if byte - bf.UE8M0_BIAS >= 1 - bf.BF16_EXP_BIAS + bf.E2M1_PLACED_EXP:
      assert bf.fold_scale_of_byte(byte) == bf.fold_scale(byte - bf.UE8M0_BIAS), byte
  with pytest.raises(ValueError, match="byte must be in"):
    bf.fold_scale_of_byte(bf.E2M1_MAX_SCALE_BYTE + 1)


def test_the_bf16_stages_b_chunks_land_in_wgmmas_core_matrix_layout():
  """`roles_v2.bf16_b_chunk` (where `_issue_x_bf16` copies a slot's 16-B chunk) puts plane position p of block b of
  slot n where wgmma m64n(8 nt)k16 reads B at k16 step p // 16 of block b from the descriptors `_stage_bf16` passes
  (no swizzle, K-major: core matrix (k8 group, n8 group) at k8 group * LBO + n8 group * SBO, LBO = 128 nt, SBO =
  128; row n % 8 at 16 (n % 8), K at 2 (p % 8)), and the chunks tile the area once."""
  roles_v2 = pytest.importorskip("gcmoe_jax.kernels.roles_v2", reason="CuTe DSL is not importable")
  for nt in (3, 4, 6, 8):
    lbo, sbo, block = 128 * nt, 128, nt * roles_v2.BF16_B_BLOCK_BYTES
    seen = set()
    for n in range(8 * nt):
      for q in range(16):
        b, c = divmod(q, 4)
        for e in range(8):
          p = 8 * c + e
          step, kk = divmod(p, 16)
          want = b * block + 2 * step * lbo + (kk // 8) * lbo + (n // 8) * sbo + (n % 8) * 16 + (kk % 8) * 2
          assert roles_v2.bf16_b_chunk(n, q, nt) + 2 * e == want, (nt, n, q, e)
          seen.add(want)
    assert seen == set(range(0, 4 * 8 * nt * roles_v2.BF16_PLANE_BYTES, 2))  # 4 blocks of 8 nt slots
