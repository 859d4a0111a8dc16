"""MX codecs, packing and the weight transforms (formats.py)."""

import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcmoe_jax import formats

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
SETTINGS = settings(max_examples=60, deadline=None)


def _ref_exponent(amax: float, max_elem: float) -> int:
  """ceil(log2(amax / max_elem)) in exact rational arithmetic (Python floats are doubles: amax/max_elem exact?)."""
  if amax == 0:
    return 0
  # Smallest e with amax <= max_elem * 2**e, found by walking: exact since both sides are exact doubles.
  e = math.floor(math.log2(amax / max_elem)) - 2
  while amax > max_elem * 2.0**e:
    e += 1
  return max(-127, min(127, e))


def _ref_quantize(block: np.ndarray, fmt: str) -> tuple[np.ndarray, int]:
  """Reference quantization of one block with ml_dtypes' own RNE casts (saturating by clipping first)."""
  max_elem, dtype = {"e2m1": (6.0, ml_dtypes.float4_e2m1fn), "e4m3": (448.0, ml_dtypes.float8_e4m3fn)}[fmt]
  block = np.where(np.abs(block) < np.finfo(np.float32).tiny, 0.0, block)  # subnormal inputs flush to zero
  finite = np.isfinite(block)
  amax = float(np.max(np.abs(np.where(finite, block, 0)))) if block.size else 0.0
  e = _ref_exponent(amax, max_elem)
  q = np.clip(block.astype(np.float64) / 2.0**e, -max_elem, max_elem)
  vals = q.astype(np.float32).astype(dtype).astype(np.float32)
  return np.where(finite, vals, np.nan), e


def _blocks(draw_shape=(4, 32)):
  return hnp.arrays(np.float32, draw_shape, elements=finite_f32)


@given(_blocks())
@SETTINGS
def test_e2m1_roundtrip_matches_convention(v):
  codes, sb = formats.quantize_mx(v, fmt="e2m1")
  got = np.asarray(formats.decode_e2m1(codes)).reshape(4, 32)
  for r in range(4):
    want, e = _ref_quantize(v[r], "e2m1")
    assert int(sb[r, 0]) == e + 127, f"row {r}: scale byte {int(sb[r, 0])}, want {e + 127}"
    np.testing.assert_array_equal(np.abs(got[r]), np.abs(want), err_msg=f"row {r}")


@given(_blocks())
@SETTINGS
def test_e4m3_roundtrip_matches_convention(v):
  codes, sb = formats.quantize_mx(v, fmt="e4m3")
  got = np.asarray(formats.decode_e4m3(codes)).reshape(4, 32)
  for r in range(4):
    want, e = _ref_quantize(v[r], "e4m3")
    assert int(sb[r, 0]) == e + 127
    np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}")


def test_special_blocks():
  rng = np.random.default_rng(1)
  zero = np.zeros(32, np.float32)
  sub = (rng.standard_normal(32) * 1e-40).astype(np.float32)  # float32 subnormals
  huge = (rng.standard_normal(32) * 1e38).astype(np.float32)
  mixed = rng.standard_normal(32).astype(np.float32) * np.where(rng.random(32) < 0.5, -1, 1)
  v = np.stack([zero, sub, huge, mixed])
  for fmt in ("e2m1", "e4m3"):
    codes, sb = formats.quantize_mx(v, fmt=fmt)
    assert int(sb[0, 0]) == 127  # all-zero block: scale 2**0
    decode = formats.decode_e2m1 if fmt == "e2m1" else formats.decode_e4m3
    got = np.asarray(decode(codes)).reshape(4, 32) * np.asarray(formats.decode_ue8m0(sb))
    np.testing.assert_array_equal(got[0], 0)
    assert int(sb[1, 0]) == 127  # float32 subnormals flush to zero, as XLA does on CPU and GPU
    assert np.all(np.sign(got[3][got[3] != 0]) == np.sign(mixed[got[3] != 0]))
    # Saturation: the block max lands exactly on or below max_elem * scale.
    amax = np.max(np.abs(got[2]))
    assert np.isfinite(amax) and amax <= 2 * np.max(np.abs(huge).astype(np.float64))


def test_e2m1_ties_and_saturation():
  q = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.25, -5.0, -100.0], np.float32)
  want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.0, -4.0, -6.0], np.float32)
  got = np.asarray(formats.decode_e2m1(formats.encode_e2m1(q)))
  np.testing.assert_array_equal(got, want)
  ml = np.clip(q, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np.testing.assert_array_equal(np.abs(got), np.abs(ml))


def test_e4m3_nonfinite_becomes_nan_and_saturates():
  q = np.array([np.nan, np.inf, -np.inf, 1000.0, -1000.0, 1.0], np.float32)
  got = np.asarray(formats.decode_e4m3(formats.encode_e4m3(q)))
  assert np.isnan(got[:3]).all()
  np.testing.assert_array_equal(got[3:], [448.0, -448.0, 1.0])


@given(hnp.arrays(np.uint8, (3, 8), elements=st.integers(0, 254)))
@SETTINGS
def test_scale_packing_is_identity(b):
  words = formats.pack_scales(b)
  assert words.dtype == jnp.int32 and words.shape == (3, 2)
  np.testing.assert_array_equal(np.asarray(formats.unpack_scales(words, 8)), b)
  # byte i of a word is group 4w + i (little-endian)
  assert int(np.asarray(words).view(np.uint32)[0, 0]) & 0xFF == b[0, 0]


def test_scale_packing_pads_ragged_tail_with_127():
  words = formats.pack_scales(np.array([[1, 2, 3, 4, 5]], np.uint8))
  np.testing.assert_array_equal(np.asarray(formats.unpack_scales(words)), [[1, 2, 3, 4, 5, 127, 127, 127]])


def test_gate_up_interleave_layout():
  i = 32
  w = np.arange(2 * i)  # gate 0..31, up 32..63
  got = np.asarray(formats.gate_up_interleave(w))
  np.testing.assert_array_equal(got[:8], np.arange(8))
  np.testing.assert_array_equal(got[8:16], i + np.arange(8))
  np.testing.assert_array_equal(got[16:24], 8 + np.arange(8))
  np.testing.assert_array_equal(np.asarray(formats.gate_up_deinterleave(got)), w)


def _weights(rng, e=4, h=512, i=256, scale=0.05):
  w13 = (rng.standard_normal((e, h, 2 * i)) * scale).astype(np.float32)
  w2 = (rng.standard_normal((e, i, h)) * scale).astype(np.float32)
  return w13, w2


def test_quantize_dequantize_requantize_is_identity():
  rng = np.random.default_rng(2)
  w13, w2 = _weights(rng)
  shared = ((rng.standard_normal((512, 512)) * 0.05).astype(np.float32),
            (rng.standard_normal((256, 512)) * 0.05).astype(np.float32))
  for group in (32, 128):
    w = formats.quantize_experts(w13, w2, shared=shared, shared_group=group)
    d13, d2, ds = formats.dequantize_experts(w)
    assert d13.shape == w13.shape and d2.shape == w2.shape and ds[0].shape == shared[0].shape
    # Dequantized values are close (FP4 / FP8 error) and quantize back to the same values.
    assert np.abs(np.asarray(d13) - w13).max() <= np.abs(w13).max() / 4
    w_again = formats.quantize_experts(d13, d2, shared=ds, shared_group=group)
    # Values, not bytes: a block whose largest code rounded down to half the range requantizes with a smaller
    # exponent and doubled codes, which decode to the same values.
    again = formats.dequantize_experts(w_again)
    for a, b in zip((*again[:2], *again[2]), (d13, d2, *ds)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_payload_layout_matches_table10():
  rng = np.random.default_rng(3)
  w13, w2 = _weights(rng, e=2)
  w = formats.quantize_experts(w13, w2)
  assert w.w13.shape == (2, 512 // 128, 512, 64) and w.w13.dtype == jnp.int8
  assert w.w13_scale.shape == (2, 512 // 128, 512) and w.w13_scale.dtype == jnp.int32  # MN-major
  assert w.w2.shape == (2, 256 // 128, 512, 64) and w.w2_scale.shape == (2, 2, 512)
  # Element (expert 1, K index 130, stored row 3): K128 block 1, byte (130 % 128) // 2 = 1, low nibble.
  codes, sb = formats.quantize_mx(np.swapaxes(np.asarray(formats.gate_up_interleave(w13)), 1, 2), fmt="e2m1")
  byte = int(np.asarray(w.w13).view(np.uint8)[1, 1, 3, 1])
  assert byte & 0xF == int(codes[1, 3, 130]) and byte >> 4 == int(codes[1, 3, 131])
  # Its scale: K32 block 130 // 32 = 4, so byte 0 of the word of (expert 1, K128 block 1, row 3); the words of a
  # K128 block are contiguous over the rows.
  words = np.asarray(w.w13_scale).view(np.uint32)
  assert [int(words[1, 1, 3] >> (8 * j)) & 0xFF for j in range(4)] == [int(b) for b in np.asarray(sb)[1, 3, 4:8]]


def test_from_mxfp4_equals_quantize_of_dequantized():
  rng = np.random.default_rng(4)
  w13, w2 = _weights(rng)
  # A canonical checkpoint: one that our quantizer reproduces byte for byte from its own dequantized values.
  # (One round trip canonicalises: a block whose largest code rounded down to 3 comes back with code 6 and an
  # exponent one lower, same values; see test_quantize_dequantize_requantize_is_identity.)
  w = formats.quantize_experts(*formats.dequantize_experts(formats.quantize_experts(w13, w2))[:2])
  for order in ("interleaved", "concatenated"):
    ckpt = formats.to_mxfp4(w, gate_up=order)
    assert ckpt[0].shape == (4, 512, 512 // 32, 16) and ckpt[1].shape == (4, 512, 16)
    back = formats.from_mxfp4(*ckpt, gate_up=order)
    d13, d2, _ = formats.dequantize_experts(back)
    requant = formats.quantize_experts(d13, d2)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
      np.testing.assert_array_equal(np.asarray(getattr(back, name)), np.asarray(getattr(requant, name)), name)


def test_from_mxfp4_keeps_noncanonical_codes():
  """A checkpoint whose scales are not ours (e.g. one exponent too high) is repacked, not requantized."""
  rng = np.random.default_rng(5)
  e, h, i = 2, 512, 256
  b13 = rng.integers(0, 256, (e, 2 * i, h // 32, 16), dtype=np.uint8)
  s13 = rng.integers(110, 130, (e, 2 * i, h // 32), dtype=np.uint8)
  b2 = rng.integers(0, 256, (e, h, i // 32, 16), dtype=np.uint8)
  s2 = rng.integers(110, 130, (e, h, i // 32), dtype=np.uint8)
  w = formats.from_mxfp4(b13, s13, b2, s2, gate_up="interleaved")
  back = formats.to_mxfp4(w, gate_up="interleaved")
  for a, b in zip(back, (b13, s13, b2, s2)):
    np.testing.assert_array_equal(np.asarray(a), b)
  # gpt-oss interleave: even rows are gate. Dequantized gate column 0 is checkpoint row 0.
  d13 = np.asarray(formats.dequantize_experts(w)[0])
  codes = np.stack([b13[0, 0] & 0xF, b13[0, 0] >> 4], -1).reshape(-1)
  vals = np.asarray(formats.decode_e2m1(codes)) * 2.0 ** (np.repeat(s13[0, 0].astype(np.int32), 32) - 127)
  np.testing.assert_array_equal(d13[0, :, 0], vals)


def test_weight_containers_are_pytrees_and_check_shapes():
  rng = np.random.default_rng(6)
  w = formats.quantize_experts(*_weights(rng))
  leaves, tree = jax.tree_util.tree_flatten(w)
  assert len(leaves) == 4
  w2 = jax.tree_util.tree_unflatten(tree, leaves)
  assert w2.config == w.config == (4, 512, 256, None, None)
  with pytest.raises(ValueError, match=r"ExpertWeights: w2_scale must have shape \[4, 2, 512\], got \[4, 512, 2\]"):
    formats.ExpertWeights(w.w13, w.w13_scale, w.w2, jnp.zeros((4, 512, 2), jnp.int32), None, 4, 512, 256)
  with pytest.raises(TypeError, match="ExpertWeights: w13 must have dtype int8, got uint8"):
    formats.ExpertWeights(w.w13.astype(jnp.uint8), w.w13_scale, w.w2, w.w2_scale, None, 4, 512, 256)
  with pytest.raises(ValueError, match=r"SharedWeights: group must be 32 or 128, got 64"):
    formats.SharedWeights(None, None, None, None, 512, 256, 64)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_rejects_non_finite_weights(bad):
  rng = np.random.default_rng(7)
  w13, w2 = _weights(rng)
  w2[1, 3, 5] = bad
  with pytest.raises(ValueError, match=r"quantize_experts: w2 must be finite, got 1 non-finite value\(s\), "
                                       r"the first at index \(1, 3, 5\)"):
    formats.quantize_experts(w13, w2)


@pytest.mark.parametrize("shape13, shape2, match", [
  ((2, 384, 512), (2, 256, 384), r"H \(w13.shape\[1\]\) must be a multiple of 128 in \[512, 8192\].*got 384"),
  ((2, 8320, 512), (2, 256, 8320), r"H \(w13.shape\[1\]\) must be a multiple of 128 in \[512, 8192\].*got 8320"),
  ((2, 512, 2 * 192), (2, 192, 512), r"I \(w13.shape\[2\] / 2\) must be a multiple of 128 in \[256, 4096\].*got 192"),
  ((2, 512, 2 * 4224), (2, 4224, 512), r"I \(w13.shape\[2\] / 2\) must be a multiple of 128 .*got 4224"),
  ((2, 512, 512), (2, 256, 640), r"w2 must have shape \[E, I, H\] = \[2, 256, 512\] to match w13"),
  ((512, 512), (256, 512), r"w13 must be \[E, H, 2I\] and w2 \[E, I, H\]"),
])
def test_quantize_rejects_table10_violations(shape13, shape2, match):
  with pytest.raises(ValueError, match=match):
    formats.quantize_experts(np.ones(shape13, np.float32), np.ones(shape2, np.float32))


def test_quantize_rejects_bad_shared():
  rng = np.random.default_rng(8)
  w13, w2 = _weights(rng, e=2)
  with pytest.raises(ValueError, match="shared_group must be 32 or 128, got 64"):
    formats.quantize_experts(w13, w2, shared=(np.ones((512, 512)), np.ones((256, 512))), shared_group=64)
  with pytest.raises(ValueError, match=r"shared s2 must have shape \[Is, H\] = \[256, 512\]"):
    formats.quantize_experts(w13, w2, shared=(np.ones((512, 512)), np.ones((512, 256))))
  with pytest.raises(TypeError, match="w13 must be a floating array"):
    formats.quantize_experts(w13.astype(np.int32), w2)
