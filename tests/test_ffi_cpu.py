"""The C++ CPU handler (csrc/) through `gcmoe_jax.moe(..., backend="cpu")`: bit for bit `reference.moe_emulated`.

Comparisons are of the BF16 bit patterns (``view(np.uint16)``), NaN positions compared separately (NaN payloads are
not part of the contract). Skipped, with the library's own reason, when libgcmoe_jax_ffi.so is not built.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gcmoe_jax as gm
from gcmoe_jax import ffi, formats, reference
from gcmoe_jax.ffi import _library
from gcmoe_jax.kernels import abi

_SUPPORT = ffi.platform_support("cpu")
pytestmark = pytest.mark.skipif(not _SUPPORT.ok, reason=_SUPPORT.reason)

E, H, I, IS = 8, 512, 256, 256
T, K = 16, 4
CLAMP = 10.0


# ---------------------------------------------------------------------------------------------------------------
# Inputs (random, never zeros) and the oracle
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _quantized(shared_group: int | None) -> gm.ExpertWeights:
  """Weights through `quantize_experts` (jit-compiled: the eager transform takes seconds)."""
  rng = np.random.default_rng(7)
  w13 = rng.standard_normal((E, H, 2 * I), np.float32) / np.sqrt(H)
  w2 = rng.standard_normal((E, I, H), np.float32) / np.sqrt(I)
  s13 = rng.standard_normal((H, 2 * IS), np.float32) / np.sqrt(H)
  s2 = rng.standard_normal((IS, H), np.float32) / np.sqrt(IS)
  quantize = jax.jit(gm.quantize_experts, static_argnames="shared_group")
  w = quantize(w13, w2, shared=(s13, s2), shared_group=shared_group or 128)
  return w if shared_group else dataclasses.replace(w, shared=None)


@functools.cache
def _random_codes() -> gm.ExpertWeights:
  """Weights made of random payload bytes (every E2M1 code, every finite E4M3 byte) and random scale bytes."""
  rng = np.random.default_rng(11)

  def scales(shape, lo, hi):
    b = rng.integers(lo, hi + 1, (*shape, 4), dtype=np.uint32)
    return (b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24).view(np.int32)

  def e4m3(shape):
    b = rng.integers(0, 256, shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 1  # weights are finite: no E4M3 NaN
    return b.view(np.int8)

  group = 32
  shared = formats.SharedWeights(
    e4m3((H // 128, 2 * IS, 128)), scales((2 * IS, -(-H // (4 * group))), 110, 114),
    e4m3((IS // 128, H, 128)), scales((H, -(-IS // (4 * group))), 110, 114), H, IS, group)
  return gm.ExpertWeights(
    rng.integers(-128, 128, (E, H // 128, 2 * I, 64), dtype=np.int8), scales((E, H // 128, 2 * I), 119, 123),
    rng.integers(-128, 128, (E, I // 128, H, 64), dtype=np.int8), scales((E, I // 128, H), 119, 123),
    shared, E, H, I)


def _x(t: int, seed: int = 0, scale: float = 1.0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).standard_normal((t, H), np.float32) * scale, jnp.bfloat16)


def _weights(t: int, k: int, seed: int = 1) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).uniform(0.05, 1.0, (t, k)), jnp.float32)


def _distinct_ids(t: int, k: int, seed: int = 2, p: np.ndarray | None = None) -> jax.Array:
  rng = np.random.default_rng(seed)
  return jnp.asarray(np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(t)]).reshape(t, k), jnp.int32)


_reference = jax.jit(reference.moe_emulated, static_argnames="clamp")


def _cpu(x, w, ids, weights, clamp, jit: bool) -> jax.Array:
  f = lambda x, w, ids, weights: gm.moe(x, w, gm.Routes(ids, weights), clamp=clamp, backend="cpu")
  return (jax.jit(f) if jit else f)(x, w, ids, weights)


def assert_bitwise_equal(y: jax.Array, expected: jax.Array, ids: jax.Array) -> None:
  """Equal BF16 bits, NaN where and only where the oracle has NaN; names the first mismatch and its routes."""
  y, expected = np.asarray(y), np.asarray(expected)
  assert y.shape == expected.shape and y.dtype == expected.dtype == jnp.bfloat16, (y.shape, expected.shape)
  y_nan, e_nan = np.isnan(y.astype(np.float32)), np.isnan(expected.astype(np.float32))
  bad = (y.view(np.uint16) != expected.view(np.uint16)) & ~(y_nan & e_nan)
  if bad.any():
    t, n = (int(v) for v in np.argwhere(bad)[0])
    raise AssertionError(f"{int(bad.sum())} of {bad.size} outputs differ; first at token {t}, column {n}: "
                         f"got {y[t, n]} (0x{y.view(np.uint16)[t, n]:04x}), expected {expected[t, n]} "
                         f"(0x{expected.view(np.uint16)[t, n]:04x}); routes {np.asarray(ids)[t].tolist()}")


def _check(x, w, ids, weights, clamp=CLAMP, modes=("eager", "jit")) -> jax.Array:
  expected = _reference(x, w, ids, weights, clamp=clamp)
  for mode in modes:
    assert_bitwise_equal(_cpu(x, w, ids, weights, clamp, jit=mode == "jit"), expected, ids)
  return expected


# ---------------------------------------------------------------------------------------------------------------
# Bit-exactness
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared_group", [None, 32, 128], ids=["no_shared", "shared_g32", "shared_g128"])
@pytest.mark.parametrize("clamp", [None, CLAMP], ids=["no_clamp", "clamp10"])
def test_random_routing(shared_group, clamp):
  _check(_x(T), _quantized(shared_group), _distinct_ids(T, K), _weights(T, K), clamp=clamp)


def test_random_codes_and_scales():
  w = _random_codes()
  _check(_x(T, seed=3), w, _distinct_ids(T, K, seed=4), _weights(T, K, seed=5))


_ROUTINGS = {
  "all_to_expert_0": lambda: jnp.zeros((T, K), jnp.int32),
  "all_to_expert_E-1": lambda: jnp.full((T, K), E - 1, jnp.int32),
  "same_k_experts": lambda: jnp.tile(jnp.asarray([5, 1, 6, 2], jnp.int32), (T, 1)),
  "zipf_skewed": lambda: _distinct_ids(T, K, seed=9, p=(1.0 / np.arange(1, E + 1) ** 1.5) / np.sum(
    1.0 / np.arange(1, E + 1) ** 1.5)),
  "padding": lambda: _distinct_ids(T, K, seed=10).at[::3, 1].set(-1).at[5].set(-1).at[7, 3].set(-7),
}


@pytest.mark.parametrize("routing", list(_ROUTINGS))
def test_routing_patterns(routing):
  _check(_x(T, seed=6), _quantized(128), _ROUTINGS[routing](), _weights(T, K, seed=8))


@pytest.mark.parametrize("k", [1, E], ids=["k1", "k_max"])
def test_top_k_bounds(k):
  _check(_x(T), _quantized(32), _distinct_ids(T, k), _weights(T, k), modes=("jit",))


def test_zero_tokens():
  y = _check(_x(0), _quantized(128), jnp.zeros((0, K), jnp.int32), jnp.zeros((0, K), jnp.float32))
  assert y.shape == (0, H)


def test_several_token_chunks():
  # The handler works in chunks of 64 tokens; 150 tokens with padding cross two chunk boundaries.
  t, k = 150, 2
  _check(_x(t, seed=12), _quantized(128), _distinct_ids(t, k, seed=13).at[64, 0].set(-1), _weights(t, k),
         modes=("jit",))


@pytest.mark.parametrize("k, shared_group", [(1, None), (1, 128), (4, 32)])
def test_calls_in_chunks_equal_one_call(k, shared_group):
  # The CUDA path runs T > 256 as chunks of 256 (`_moe.in_chunks`); here the CPU handler in chunks of 8 rows. k = 1
  # (the expert-parallel local op) sorts rows by expert first; padding and an unsorted id order are included.
  from gcmoe_jax.ffi import _moe

  t = 37
  w = _quantized(shared_group)
  x, weights = _x(t, seed=31), _weights(t, k, seed=32)
  ids = _distinct_ids(t, k, seed=33).at[5, 0].set(-1).at[20, k - 1].set(-1)
  call = lambda x, ids, weights: _moe.moe_call(x, w, ids, weights, clamp=CLAMP, backend="cpu")
  chunked = jax.jit(lambda x, ids, weights: _moe.in_chunks(call, x, ids, weights, 8))
  assert_bitwise_equal(chunked(x, ids, weights), _reference(x, w, ids, weights, clamp=CLAMP), ids)
  hlo = jax.jit(lambda x, ids, weights: _moe.in_chunks(call, x, ids, weights, 8)).lower(x, ids, weights).as_text()
  assert hlo.count("gcmoe_moe_v1") == 1, "the chunks must share one call site (a loop), not one each"


def test_nan_propagates_to_exactly_the_affected_tokens():
  x = _x(T, seed=14)
  x = x.at[3, 17].set(jnp.nan).at[11, 500].set(jnp.inf)  # an Inf becomes an E4M3 NaN as well
  expected = _check(x, _quantized(128), _distinct_ids(T, K), _weights(T, K))
  y = np.asarray(_cpu(x, _quantized(128), _distinct_ids(T, K), _weights(T, K), CLAMP, jit=True), np.float32)
  assert np.isnan(y).any(axis=1).nonzero()[0].tolist() == [3, 11]
  assert np.isnan(y[[3, 11]]).all()
  assert not np.isnan(np.asarray(expected, np.float32)[[0, 1, 2, 4]]).any()


# ---------------------------------------------------------------------------------------------------------------
# The codecs, exhaustively (through the library's test entry points)
# ---------------------------------------------------------------------------------------------------------------


def _hook(name: str):
  fn = getattr(ffi.library(), name, None)
  if fn is None:
    pytest.skip(f"{ffi.library_info().path} has no {name} (rebuild the library)")
  return fn


def test_silu_table_is_the_references_for_every_bf16():
  out = np.empty(1 << 16, np.float32)
  _hook("gcmoe_test_silu_table")(out.ctypes.data_as(ctypes.c_void_p))
  expected = reference.silu_table()
  nan = np.isnan(expected)
  assert (np.isnan(out) == nan).all()
  bad = np.flatnonzero(out.view(np.uint32)[~nan] != expected.view(np.uint32)[~nan])
  assert bad.size == 0, f"{bad.size} entries differ, first at bf16 0x{np.flatnonzero(~nan)[bad[0]]:04x}"


@pytest.mark.parametrize("n", [0, 1, 55, 56, 63, 64, 65, 119, 1000, 100_003])
def test_sha256_of_the_graph_cache_is_hashlibs(n):
  data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
  out = (ctypes.c_uint8 * 32)()
  _hook("gcmoe_test_sha256")(data, ctypes.c_int64(n), out)
  assert bytes(out).hex() == hashlib.sha256(data).hexdigest()


def test_workspace_header_of_the_runtime_is_abis():
  fn = _hook("gcmoe_workspace_header_offsets")
  room = len(abi.HEADER) + 8  # (room to spare: a field the runtime has and abi lacks shows in the count)
  out = (ctypes.c_int64 * room)()
  count = fn(out, room)
  assert count == len(abi.HEADER)
  assert dict(zip(abi.HEADER, out[:count])) == abi.HEADER


@pytest.mark.parametrize("layout", ["sorted", "shuffled"])
def test_mxfp8_is_the_references_for_every_bf16(layout):
  # Every bf16 bit pattern except the subnormals (XLA:CPU flushes those to zero, the handler does not), in blocks of
  # similar magnitudes (sorted) and of mixed ones (shuffled).
  bits = np.arange(1 << 16, dtype=np.uint16)
  bits = bits[((bits >> 7) & 0xFF != 0) | ((bits & 0x7F) == 0)]
  if layout == "shuffled":
    bits = np.random.default_rng(0).permutation(bits)
  k = 512
  pad = (-bits.size) % k
  bits = np.concatenate([bits, np.full(pad, 0x3F80, np.uint16)]).reshape(-1, k)
  m = bits.shape[0]
  ints, exps, nans = np.empty((m, k), np.int32), np.empty((m, k // 32), np.int32), np.empty((m, k // 32), np.uint8)
  ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
  _hook("gcmoe_test_mxfp8")(ptr(bits), ctypes.c_int64(m), ctypes.c_int64(k), ptr(ints), ptr(exps), ptr(nans))
  e_ints, e_nans, e_exps = (np.asarray(a) for a in jax.jit(reference.mxfp8)(jnp.asarray(bits.view(jnp.bfloat16))))
  np.testing.assert_array_equal(exps, e_exps)
  np.testing.assert_array_equal(nans.astype(bool), e_nans)
  np.testing.assert_array_equal(ints, e_ints)


# ---------------------------------------------------------------------------------------------------------------
# Lowering, errors, transformations
# ---------------------------------------------------------------------------------------------------------------


def test_lowered_hlo_names_the_custom_call():
  w = _quantized(32)
  f = jax.jit(lambda x, w, r: gm.moe(x, w, r, clamp=CLAMP, backend="cpu"))
  text = f.lower(_x(T), w, gm.Routes(_distinct_ids(T, K), _weights(T, K))).as_text()
  assert ffi.TARGET in text
  for attr in ("H = 512", "I = 256", "E = 8", "k = 4", "Is = 256", "group = 32", "flags = 3"):
    assert attr in text, attr


def test_out_of_range_id_under_jit_raises_naming_the_id():
  ids = _distinct_ids(T, K).at[3, 1].set(E + 1)  # traced under jit: the Python pre-check cannot see it
  f = jax.jit(lambda x, w, r: gm.moe(x, w, r, backend="cpu"))
  with pytest.raises(Exception, match=r"expert id 9 at token 3, slot 1 is out of range \[0, E = 8\)"):
    np.asarray(f(_x(T), _quantized(None), gm.Routes(ids, _weights(T, K))))


def test_out_of_range_id_eagerly_is_caught_before_the_handler():
  ids = _distinct_ids(T, K).at[0, 2].set(E)
  with pytest.raises(ValueError, match=r"routes.ids must be < E = 8"):
    gm.moe(_x(T), _quantized(None), gm.Routes(ids, _weights(T, K)), backend="cpu")


def _raw_operands(w: gm.ExpertWeights, t: int = 4) -> list:
  s = w.shared
  shared = ffi.no_shared_operands() if s is None else [s.s13, s.s13_scale, s.s2, s.s2_scale]
  return [_x(t), w.w13, w.w13_scale, w.w2, w.w2_scale, _distinct_ids(t, K), _weights(t, K), *shared]


def test_mismatched_buffer_reaching_the_handler():
  w = _quantized(None)
  ops = _raw_operands(w)
  ops[2] = jnp.zeros((E, H // 128 + 1, 2 * I), jnp.int32) + 0x7F7F7F7F
  attrs = ffi.MoeAttrs.from_weights(w, K, CLAMP)
  with pytest.raises(Exception, match=r"gcmoe_moe: w13_scale: expected \[8, 4, 512\] int32, got \[8, 5, 512\] int32"):
    np.asarray(ffi.moe_ffi(*ops, attrs=attrs))


def test_wrong_dtype_reaching_the_handler():
  w = _quantized(128)
  ops = _raw_operands(w)
  ops[0] = ops[0].astype(jnp.float32)
  with pytest.raises(Exception, match=r"gcmoe_moe: x: expected \[4, 512\] bfloat16, got \[4, 512\] float32"):
    np.asarray(ffi.moe_ffi(*ops, attrs=ffi.MoeAttrs.from_weights(w, K, None)))


def test_bad_attribute_reaching_the_handler():
  w = _quantized(128)
  attrs = dataclasses.replace(ffi.MoeAttrs.from_weights(w, K, CLAMP), shared_group=64)
  with pytest.raises(Exception, match=r"gcmoe_moe requires attribute group to be 32 or 128, got 64"):
    np.asarray(ffi.moe_ffi(*_raw_operands(w), attrs=attrs))


def test_missing_shared_placeholders_are_checked():
  w = _quantized(128)
  attrs = dataclasses.replace(ffi.MoeAttrs.from_weights(w, K, CLAMP), shared_intermediate=0, shared_group=0)
  with pytest.raises(Exception, match=r"gcmoe_moe: s13: expected \[0, 0, 0\] int8, got \[4, 512, 128\] int8"):
    np.asarray(ffi.moe_ffi(*_raw_operands(w), attrs=attrs))


def test_vmap_is_sequential_and_exact():
  # vmap_method="sequential": each batch element is one unbatched call (here: batched tokens and routes).
  w, b = _quantized(128), 3
  xs = jnp.stack([_x(T, seed=20 + i) for i in range(b)])
  ids = jnp.stack([_distinct_ids(T, K, seed=30 + i) for i in range(b)])
  wts = jnp.stack([_weights(T, K, seed=40 + i) for i in range(b)])
  f = jax.vmap(lambda x, i, wt: gm.moe(x, w, gm.Routes(i, wt), clamp=CLAMP, backend="cpu"))
  ys = jax.jit(f)(xs, ids, wts)
  assert ys.shape == (b, T, H)
  for i in range(b):
    assert_bitwise_equal(ys[i], _reference(xs[i], w, ids[i], wts[i], clamp=CLAMP), ids[i])
  text = jax.jit(f).lower(xs, ids, wts).as_text()
  assert "stablehlo.while" in text and text.count(ffi.TARGET) == 1  # one call inside a loop over the batch


def test_grad_raises_forward_only():
  w, ids, wts = _quantized(None), _distinct_ids(T, K), _weights(T, K)
  loss = lambda x: gm.moe(x, w, gm.Routes(ids, wts), backend="cpu").astype(jnp.float32).sum()
  with pytest.raises(TypeError, match="gcmoe_jax.moe is forward-only"):
    jax.grad(loss)(_x(T).astype(jnp.float32).astype(jnp.bfloat16))
  with pytest.raises(TypeError, match="gcmoe_jax.moe is forward-only"):
    jax.jvp(loss, (_x(T),), (jnp.ones((T, H), jnp.bfloat16),))


def test_forward_under_grad_of_something_else_runs():
  # Only differentiating *through* the op is an error; a call whose inputs carry no tangent runs normally.
  w, ids, wts, x = _quantized(None), _distinct_ids(T, K), _weights(T, K), _x(T)
  g = jax.grad(lambda s: s * gm.moe(x, w, gm.Routes(ids, wts), backend="cpu").astype(jnp.float32).sum())(2.0)
  assert np.isfinite(g)


# ---------------------------------------------------------------------------------------------------------------
# Library, registration, support
# ---------------------------------------------------------------------------------------------------------------


def test_sync_check_lowers_to_the_target_xla_keeps_out_of_command_buffers():
  """GCMOE_SYNC_CHECK=1 calls `_library.TARGET_SYNC`: the same op (its CPU handler is the same symbol; on CUDA its
  execute handler lacks the command-buffer trait, so XLA calls it at every execution and a fault is raised by its
  own call). Declared for every platform of the plain target, registered, and bit-identical on CPU."""
  from gcmoe_jax.ffi import _moe
  targets = ffi.library_info().build["targets"]
  assert set(targets[_library.TARGET_SYNC]) == set(targets[_library.TARGET])
  assert targets[_library.TARGET_SYNC]["cpu"] == targets[_library.TARGET]["cpu"]
  if "CUDA" in targets[_library.TARGET]:
    plain, sync = targets[_library.TARGET]["CUDA"], targets[_library.TARGET_SYNC]["CUDA"]
    assert sync["instantiate"] == plain["instantiate"] and sync["execute"] != plain["execute"]
  assert _library.TARGET_SYNC in ffi.library_info().registered["cpu"].reason
  w = _quantized(32)
  x, ids, wts = _x(T), _distinct_ids(T, K), _weights(T, K)
  ys = {}
  for sync in (False, True):
    attrs = _moe.MoeAttrs.from_weights(w, K, CLAMP, sync_check=sync)
    f = jax.jit(lambda x, ids, wts, attrs=attrs: _moe._moe_on(x, w, ids, wts, attrs))
    text = f.lower(x, ids, wts).as_text()
    want, other = (_library.TARGET_SYNC, _library.TARGET) if sync else (_library.TARGET, _library.TARGET_SYNC)
    assert f"@{want}(" in text and f"@{other}(" not in text, text[:2000]
    assert f"flags = {int(attrs.flags)}" in text and bool(attrs.flags & ffi.Flag.SYNC_CHECK) == sync
    ys[sync] = np.asarray(f(x, ids, wts)).view(np.uint16)
  assert np.isfinite(np.asarray(ys[False].view(jnp.bfloat16), np.float32)).all() and ys[False].any()
  np.testing.assert_array_equal(ys[True], ys[False])


def test_a_library_without_the_sync_target_is_named_stale(monkeypatch):
  """A library built before `_library.TARGET_SYNC` existed: GCMOE_SYNC_CHECK's calls say so (XLA would only say that
  the target has no implementation); plain calls still run."""
  from gcmoe_jax.ffi import _moe
  info = ffi.library_info()
  old = {t: p for t, p in info.build["targets"].items() if t != _library.TARGET_SYNC}
  monkeypatch.setattr(_library, "library_info", lambda: dataclasses.replace(info, build={**info.build, "targets": old}))
  w = _quantized(None)
  x, ids, wts = _x(T), _distinct_ids(T, K), _weights(T, K)
  with pytest.raises(RuntimeError, match=rf"does not declare the target {_library.TARGET_SYNC} .* rebuild it"):
    _moe._moe_on(x, w, ids, wts, _moe.MoeAttrs.from_weights(w, K, CLAMP, sync_check=True))
  assert _moe._moe_on(x, w, ids, wts, _moe.MoeAttrs.from_weights(w, K, CLAMP)).shape == x.shape


def test_flags_mirror_the_cpp_enum():
  assert ffi.library_info().build["flags"] == {"has_shared": int(ffi.Flag.HAS_SHARED),
                                               "has_clamp": int(ffi.Flag.HAS_CLAMP)}


def test_library_info_describes_the_cpu_target():
  info = ffi.library_info()
  assert info.error is None and info.path is not None
  assert info.registered["cpu"].ok
  assert info.compiled_ffi_api <= info.runtime_ffi_api
  assert ffi.TARGET in str(info)


def test_cuda_support_follows_the_build():
  info = ffi.library_info()
  s = ffi.platform_support("cuda")
  if info.build.get("cuda"):
    assert s.ok and "CUDA runtime" in s.reason
  else:
    assert not s.ok and "declares no CUDA target" in s.reason


def test_debug_trace_says_how_to_turn_it_on():
  if not ffi.library_info().build.get("cuda"):
    pytest.skip("the trace is part of the CUDA handler")
  if os.environ.get("GCMOE_DEBUG_TRACE") == "1":
    pytest.skip("the trace is on in this process")
  from gcmoe_jax.ffi import _cuda  # noqa: PLC0415 - only where the CUDA handler is built
  with pytest.raises(RuntimeError, match="GCMOE_DEBUG_TRACE=1"):
    _cuda.debug_trace()


def test_auto_never_picks_cuda_without_a_gpu():
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU machine's answer")
  e = gm.explain("cuda")
  assert e.backend is None and "needs a CUDA GPU" in dict(e.reasons)["cuda"].reason


def test_unknown_platform_is_a_value_error():
  with pytest.raises(ValueError, match="platform must be 'cpu' or 'cuda', got 'tpu'"):
    ffi.platform_support("tpu")


def test_library_override_that_does_not_exist(monkeypatch, tmp_path):
  monkeypatch.setattr(_library, "_STATE", _library._State())
  monkeypatch.setenv(_library.ENV_LIBRARY, str(tmp_path / "missing.so"))
  s = ffi.platform_support("cpu")
  assert not s.ok and f"$GCMOE_FFI_LIBRARY={tmp_path / 'missing.so'} is not a loadable library (absent)" in s.reason


def test_library_override_that_is_not_a_library(monkeypatch, tmp_path):
  bogus = tmp_path / "libgcmoe_jax_ffi.so"
  bogus.write_text("not an ELF file")
  monkeypatch.setattr(_library, "_STATE", _library._State())
  monkeypatch.setenv(_library.ENV_LIBRARY, str(bogus))
  s = ffi.platform_support("cpu")
  assert not s.ok and "cannot load" in s.reason


def test_kernels_support_says_where_cubins_come_from(monkeypatch):
  from gcmoe_jax.ffi import _cuda
  monkeypatch.setenv("GCMOE_CUBIN_DIR", "/some/dir")
  assert _cuda.kernels_support() == (True, "prebuilt cubins from GCMOE_CUBIN_DIR=/some/dir")
  monkeypatch.delenv("GCMOE_CUBIN_DIR")
  monkeypatch.setattr(_cuda.importlib.util, "find_spec", lambda name: None)
  s = _cuda.kernels_support()
  assert not s.ok and "install nvidia-cutlass-dsl" in s.reason and "GCMOE_CUBIN_DIR" in s.reason


def test_virtual_ranks_reject_bad_arguments_and_need_a_gpu(small_problem):
  """The fused transport's one-GPU harness: arguments are checked first, naming the value; without a GPU it says
  so instead of running anything."""
  w = formats.quantize_experts(small_problem.w13, small_problem.w2)
  with pytest.raises(ValueError, match=r"ranks must be in \[2, 16\] and divide E = 8, got 3"):
    ffi.VirtualRanks(w, top_k=4, ranks=3, capacity=16, tokens=[1, 1, 1])
  with pytest.raises(ValueError, match=r"tokens must hold 2 values in \[0, capacity = 16\], got \[1, 17\]"):
    ffi.VirtualRanks(w, top_k=4, ranks=2, capacity=16, tokens=[1, 17])
  if jax.default_backend() == "cpu":
    with pytest.raises(RuntimeError, match="CUDA backend cannot run here"):
      ffi.VirtualRanks(w, top_k=4, ranks=2, capacity=16, tokens=[1, 1])


def _register_or_refuse(name: str, config: tuple[int, ...], refused: str | None) -> None:
  """Registers a variant of empty cubins with ``config``; ``refused``: the message (a regex) it must fail with."""
  from gcmoe_jax.ffi import _cuda
  call = lambda: _cuda.register_raw(name, config, (0, 256, 0) * 3, [b"\0"] * 3, reference.silu_table())
  if refused is None:
    call()
  else:
    with pytest.raises(RuntimeError, match=refused):
      call()


@pytest.mark.parametrize("ranks, devices, ok", [
  (2, (0, 1), True), (2, (0, 1, 2, 3), True), (4, (3, 2, 1, 0), True),
  # Devices of other processes, -(1 + process): one of this process's per group (CUDA IPC connects the others).
  (2, (-1, 0), True), (2, (0, -2, 1, -2), True), (4, (-1, 0, -3, -4), True), (2, (-2, -3), True),
  (2, (0, 1, 2), False), (2, (0, 0), False), (1, (0, 1), False), (17, tuple(range(17)), False),
  (2, (-1, 0, -1, 0), False),  # this process's device 0 in two groups
  (3, (0, 1, -2), False),  # two of this process's devices beside another process's
  (3, (0, -2, -2), False),  # one other process twice in a group
])
def test_fused_variant_registration_checks_its_peer_groups(ranks, devices, ok):
  """The fused transport across GPUs registers R and its peer groups' devices (group-major: this process's CUDA
  ordinals, another process's device as -(1 + process index)); the library refuses a ragged group, a device twice,
  a group mixing two of this process's devices with another process's, ordinals without R > 1 and R past
  abi.MAX_RANKS, naming what it got."""
  _register_or_refuse(f"fused-registration-{ranks}-{devices}", (8, 6, 10**9, 4096, 256, 0, ranks, 0, 0, 0, 0,
                                                                 0, *devices),
                      None if ok else rf"the fused transport needs R in \[2, {abi.MAX_RANKS}\] and its peer groups' "
                                      rf"devices .* got R = {ranks} and {len(devices)} devices")


@pytest.mark.parametrize("solo_tokens, per_token, ranks, ok", [
  (0, 0, 1, True), (4, 3, 1, True), (8, 1, 1, True), (4, 0, 1, False), (9, 1, 1, False), (-1, 1, 1, False),
  (2, -3, 1, False),
  (0, 1, 1, False),  # combining CTAs without role 2 alone: the layout before config[8:10] (peer devices from 8)
  (4, 3, 2, False),  # role 2 alone is one GPU's
])
def test_role2_alone_registration_checks_its_sizes(solo_tokens, per_token, ranks, ok):
  """config[8:10]: the tokens up to which the graph holds role 2 alone (at most the capacity, 8 here) and its
  combining CTAs per token (`abi.solo_ctas`), both 0 or both > 0, and only on one GPU; anything else is refused,
  naming it."""
  devices = (0, 1) if ranks > 1 else ()
  _register_or_refuse(f"solo-registration-{solo_tokens}-{per_token}-{ranks}",
                      (8, 6, 10**9, 4096, 256, 0, ranks, 8, solo_tokens, per_token, 0, 0, *devices),
                      None if ok else rf"role 2 alone needs .* got solo tokens {solo_tokens}, combining CTAs per "
                                      rf"token {per_token}, capacity 8, R = {ranks}")


@pytest.mark.parametrize("solo_tokens, all_sms, ok", [(4, 0, True), (4, 1, True), (0, 1, False), (4, 2, False),
                                                      (4, -1, False)])
def test_role2_alone_over_every_sm_registration(solo_tokens, all_sms, ok):
  """config[10] (`GCMOE_SOLO_SMS`): role 2 alone on the compute partition (0) or over every SM (1), and 1 only
  where role 2 runs alone; anything else is refused, naming it."""
  _register_or_refuse(f"solo-all-registration-{solo_tokens}-{all_sms}",
                      (8, 6, 10**9, 4096, 256, 0, 1, 8, solo_tokens, 3 if solo_tokens else 0, all_sms),
                      None if ok else rf"where role 2 runs alone is 0 .* got {all_sms} with solo tokens {solo_tokens}")


def test_solo_sms_reaches_the_registration(monkeypatch):
  """`GCMOE_SOLO_SMS=all` (the default) registers role 2 alone over every SM (config[10] = 1, under its own key);
  `compute` keeps it on the compute partition (0); without role 2 alone there is nothing to place (0); a value other
  than compute or all is refused naming the variable."""
  from gcmoe_jax import _config
  from gcmoe_jax.ffi import _cuda
  from gcmoe_jax.kernels import build
  seen = {}
  monkeypatch.setattr(_cuda, "register_raw", lambda key, config, *a, **k: seen.update({key: config}))
  monkeypatch.setattr(build, "load_or_build", lambda arch, variant: _FakeBuilt())
  monkeypatch.setattr(build, "generation", lambda: "v2")
  monkeypatch.delenv("GCMOE_SOLO_SMS", raising=False)
  assert _config.get("GCMOE_SOLO_SMS") == "all"  # (the default since session 38: measured faster on the H200)
  variant = build.Variant(512, 256, 8, 4, 8)
  _cuda._register.cache_clear()
  keys = {}
  for solo, sms in ((True, "compute"), (True, "all"), (False, "all")):
    keys[solo, sms] = key = _cuda._register("sm_90a", variant, 6, 128, 10**9, solo=solo, solo_sms=sms)
    assert seen[key][8:11] == ((8, 1, int(sms == "all")) if solo else (0, 0, 0)), (solo, sms, seen[key])
  assert len(set(keys.values())) == 3 and ":all" in keys[True, "all"] and ":all" not in keys[True, "compute"]
  _cuda._register.cache_clear()
  monkeypatch.setenv("GCMOE_SOLO_SMS", "most")
  with pytest.raises(ValueError, match="GCMOE_SOLO_SMS.*expected compute or all"):
    _config.get("GCMOE_SOLO_SMS")


@pytest.mark.parametrize("on_stream, ranks, ok", [(0, 1, True), (1, 1, True), (1, 2, False), (2, 1, False),
                                                  (-1, 1, False)])
def test_graph_on_the_stream_context_registration(on_stream, ranks, ok):
  """config[11] (`GCMOE_GRAPH_CONTEXT`): the three-node graph on the green contexts (0) or on the stream's own
  context (1), and 1 only on one GPU; anything else is refused, naming it (peer devices follow from config[12])."""
  devices = (0, 1) if ranks > 1 else ()
  _register_or_refuse(f"graph-context-registration-{on_stream}-{ranks}",
                      (8, 6, 10**9, 4096, 256, 0, ranks, 0, 0, 0, 0, on_stream, *devices),
                      None if ok else rf"where the three-node graph runs is 0 .* got {on_stream} with R = {ranks}")


def test_graph_context_reaches_the_registration(monkeypatch):
  """`GCMOE_GRAPH_CONTEXT=stream` (the default) registers the three-node graph on the stream's own context (config[11]
  = 1, under its own key) on one GPU only; `green` keeps the green contexts; a value other than green or stream is
  refused naming the variable."""
  from gcmoe_jax import _config
  from gcmoe_jax.ffi import _cuda
  from gcmoe_jax.kernels import build
  seen = {}
  monkeypatch.setattr(_cuda, "register_raw", lambda key, config, *a, **k: seen.update({key: config}))
  monkeypatch.setattr(build, "load_or_build", lambda arch, variant: _FakeBuilt())
  monkeypatch.setattr(build, "generation", lambda: "v2")
  monkeypatch.delenv("GCMOE_GRAPH_CONTEXT", raising=False)
  assert _config.get("GCMOE_GRAPH_CONTEXT") == "stream"
  _cuda._register.cache_clear()
  keys = {}
  for ranks in (1, 2):
    variant = build.Variant(512, 256, 8, 4, 16, ranks=ranks)
    for where in ("green", "stream"):
      keys[ranks, where] = key = _cuda._register("sm_90a", variant, 6, 128, 10**9, peer_devices=(0, 1)[:ranks],
                                                 graph_context=where)
      assert seen[key][11] == int(ranks == 1 and where == "stream"), (ranks, where, seen[key])
  assert keys[1, "stream"].endswith(":stream") and keys[1, "green"] != keys[1, "stream"]
  assert keys[2, "green"] == keys[2, "stream"]  # the fused transport's ranks keep their partitions
  _cuda._register.cache_clear()
  monkeypatch.setenv("GCMOE_GRAPH_CONTEXT", "primary")
  with pytest.raises(ValueError, match="GCMOE_GRAPH_CONTEXT.*expected green or stream"):
    _config.get("GCMOE_GRAPH_CONTEXT")


class _FakeBuilt:
  """A `build.BuiltVariant` stand-in for registration tests: launch shapes and empty cubins."""

  def launch(self, r: int, compute_sms: int = 0) -> tuple[int, int, int]:
    return (2 * compute_sms if r == 2 else 0, 256, 0)

  def cubin(self, r: int) -> bytes:
    return b"\0"

  def tensormap_fields(self) -> tuple[int, ...]:
    return ()

  def dispatch_grid(self, sms: int) -> int:
    return max(1, sms)


def _w13_map(**change) -> dict:
  m = dict(name="w13_map", param="w13", dtype="uint8", dims=[64, 8 * 4 * 512], row_stride=64, box=[64, 128],
           swizzle=64)
  m.update(change)
  return m


@pytest.mark.parametrize("maps, message", [
  ([_w13_map()], None),
  ([_w13_map(), _w13_map(param="w2")], None),
  ([_w13_map(dtype="u4x16_align16", dims=[128, 16384], box=[128, 128], swizzle=128)], None),
  ([_w13_map(box=[64, 300])], r"TensorMap 0 is malformed \(param 3, dtype 0, dims 64 x 16384, row stride 64, box 64 x "
                              r"300"),
  ([_w13_map(dtype="u4x16_align16", dims=[128, 16384], box=[64, 128], swizzle=128)],
   r"TensorMap 0 is malformed \(param 3, dtype 14, .* box 64 x 128, swizzle 3; accepted: .*box\[0\] 128"),
  ([_w13_map(dtype="u4x16_align16", dims=[128, 16384], box=[128, 128], swizzle=64)],
   r"TensorMap 0 is malformed .*dtype 14, .*swizzle 2;"),
  ([_w13_map(row_stride=72)], r"TensorMap 0 is malformed .* row stride 72,"),
  ([_w13_map(dims=[64, 0])], r"TensorMap 0 is malformed .* dims 64 x 0,"),
])
def test_tensormap_registration_checks_each_map(maps, message):
  """Role 2's TensorMaps reach the library as `abi.tensormap_fields` rows; a malformed row is refused at
  registration, naming the map and its fields (a CUDA encode would otherwise fail at the first call)."""
  from gcmoe_jax.ffi import _cuda
  fields = tuple(f for m in maps for f in abi.tensormap_fields(m))
  call = lambda: _cuda.register_raw(f"tensormaps-{fields}", (8, 6, 10**9, 4096, 256), (0, 256, 0) * 3, [b"\0"] * 3,
                                    reference.silu_table(), fields)
  if message is None:
    call()
  else:
    with pytest.raises(RuntimeError, match=message):
      call()


def test_tensormap_rows_must_be_whole():
  from gcmoe_jax.ffi import _cuda
  with pytest.raises(RuntimeError, match=r"role 2's TensorMaps take 8 values each, at most 4 maps; got 7 values"):
    _cuda.register_raw("tensormaps-ragged", (8, 6, 10**9, 4096, 256), (0, 256, 0) * 3, [b"\0"] * 3,
                       reference.silu_table(), tuple(range(7)))


def test_connect_processes_hands_every_rank_its_peers_handles_in_rank_order(monkeypatch):
  """`_cuda.connect_processes`, the fused transport across processes: each process exports its ranks' workspace
  handles, the exchange hands every process's round, and each rank opens its peers' in rank order. Two processes
  of two GPUs each with the EP axis across them (two groups), simulated one after the other with the library's
  export/connect replaced by recorders."""
  import collections

  from gcmoe_jax.ffi import _cuda

  groups = {0: ((0, -2), (1, -2)), 1: ((-1, 0), (-1, 1))}  # process p's view: its device, the other's as -(1 + p)
  handle = lambda p, device, rank: bytes([p, device, rank, 7]) * (_cuda.IPC_HANDLE_BYTES // 4)
  payloads, opened, names = {}, {}, []

  class Stop(Exception):
    pass

  def run(p, exchange, key=None):
    monkeypatch.setattr(_cuda, "_ipc_export", lambda key, device, rank: handle(p, device, rank))
    monkeypatch.setattr(_cuda, "_ipc_connect", lambda key, device, hs: opened.setdefault((p, device), hs))
    _cuda.connect_processes(key or f"variant-as-seen-by-{p}", "variant.g2", groups[p], exchange)

  def fresh():
    monkeypatch.setattr(_cuda, "_connected", set())
    monkeypatch.setattr(_cuda, "_exchanges", collections.Counter())

  def record(p):
    def exchange(name, payload):
      names.append(name)
      payloads[p] = payload
      raise Stop
    return exchange

  for p in (0, 1):  # first what each process would publish
    fresh()
    with pytest.raises(Stop):
      run(p, record(p))
  assert names == ["variant.g2.0", "variant.g2.0"]  # the same name in every process
  for p in (0, 1):
    fresh()
    run(p, lambda name, payload: [payloads[0], payloads[1]])
  assert opened == {(p, d): [handle(0, d, 0), handle(1, d, 1)] for p in (0, 1) for d in (0, 1)}
  run(1, None)  # connected once per variant: no second exchange
  fresh()
  with pytest.raises(RuntimeError, match=r"process 1 sent no workspace handle for rank 1 of peer group 0"):
    run(0, lambda name, payload: [payloads[0], b""])
  with pytest.raises(ValueError, match=r"needs an exchange of their workspace handles .* got exchange=None"):
    run(0, None, key="another-variant")

  def timing_out(name, payload):
    raise TimeoutError(f"exchange: process 1 did not publish {name!r} within 5 ms")

  fresh()
  with pytest.raises(TimeoutError, match=r"process 1 did not publish 'variant\.g2\.0' .* names the exchange by the "
                     r"kernel variant, here 'variant\.g2': .* GCMOE_ABLATION"):
    run(0, timing_out)


def test_release_waits_meets_the_other_processes_then_retires_and_reconnects_later(monkeypatch):
  """`_cuda.release_processes` (the collective `gm.release_fused_workspaces`): the library waits for this process's
  devices (phase 0), the processes meet through the exchange (a fresh name per release), then the library retires
  the groups (phase 1) and the next trace exchanges handles again. The library's entry points are recorded."""
  import collections
  import types

  from gcmoe_jax.ffi import _cuda

  calls = []

  def release(phase, error, size):
    calls.append(f"phase {phase}")
    return 0 if phase == 0 else 3

  monkeypatch.setattr(_library, "library", lambda: types.SimpleNamespace(gcmoe_ipc_release=release))
  monkeypatch.setattr(_cuda, "_connected", {"variant"})
  monkeypatch.setattr(_cuda, "_exchanges", collections.Counter())
  monkeypatch.setattr(_cuda, "_releases", 0)
  monkeypatch.setattr(_cuda, "_ipc_export", lambda key, device, rank: bytes(_cuda.IPC_HANDLE_BYTES))
  monkeypatch.setattr(_cuda, "_ipc_connect", lambda key, device, hs: calls.append(f"connect {device}"))

  def exchange(name, payload):
    calls.append(name)
    return [payload, b"".join(_cuda._RECORD.pack(0, 1) + bytes(_cuda.IPC_HANDLE_BYTES) for _ in [0])]

  _cuda.connect_processes("variant", "v", ((0, -2),), exchange)  # connected before: nothing happens
  assert _cuda.release_processes(exchange) == 3
  assert _cuda.release_processes(exchange) == 3
  assert calls == ["phase 0", "gcmoe_jax.release.0", "phase 1", "phase 0", "gcmoe_jax.release.1", "phase 1"]
  calls.clear()
  _cuda.connect_processes("variant", "v", ((0, -2),), exchange)  # the next trace connects anew
  assert calls == ["v.0", "connect 0"]
  calls.clear()

  def timing_out(name, payload):
    calls.append(name)
    raise TimeoutError("exchange: process 1 did not publish")

  with pytest.raises(TimeoutError, match="process 1 did not publish"):
    _cuda.release_processes(timing_out)  # nothing retired
  assert _cuda.release_processes(exchange) == 3  # the retry meets under a fresh name (names are single-use)
  assert calls == ["phase 0", "gcmoe_jax.release.2", "phase 0", "gcmoe_jax.release.3", "phase 1"]
  calls.clear()
  failing = lambda phase, error, size: calls.append(f"phase {phase}") or -1
  monkeypatch.setattr(_library, "library", lambda: types.SimpleNamespace(gcmoe_ipc_release=failing))
  with pytest.raises(RuntimeError, match=r"release_fused_workspaces: waiting for this process's devices failed"):
    _cuda.release_processes(exchange)
  assert calls == ["phase 0"]  # no barrier, nothing retired


def test_release_with_no_groups_across_processes_only_waits():
  """One process, no CUDA: the real library finds no group to wait for or retire (nothing needs a GPU)."""
  import gcmoe_jax as gm

  if _library.library() is None:
    pytest.skip("needs the FFI library")
  assert gm.release_fused_workspaces() == 0


def test_ipc_entry_points_refuse_an_unregistered_variant():
  """The library's export/connect name the variant they do not know (no GPU needed to get there)."""
  from gcmoe_jax.ffi import _cuda

  if _library.library() is None:
    pytest.skip("needs the FFI library")
  with pytest.raises(RuntimeError, match=r"opening the peers' workspaces on device 0 failed: gcmoe_ipc_connect: no "
                                         r"variant registered as never-registered"):
    _cuda._ipc_connect("never-registered", 0, [b"\0" * 64] * 2)
