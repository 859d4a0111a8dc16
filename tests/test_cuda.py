"""The CUDA backend on a GPU: green contexts, the role graph, replay in XLA's stream (issue 5). Marked `gpu`.

Run on the GPU machine with cubins built on a CPU machine:
  GCMOE_CUBIN_DIR=.cubins python -m pytest -m gpu tests/test_cuda.py -q -s
The figures it prints (cosine, max abs difference, exact share) are the ones reported in docs/perf.md.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gcmoe_jax as gm
from conftest import SMALL, quantized
from gcmoe_jax import ffi, reference
from gcmoe_jax.bench import accuracy
from gcmoe_jax.bench.problems import CASE_FAMILIES, make_problem

pytestmark = pytest.mark.gpu


def _cuda_or_skip():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the default device is not one)")
  reasons = gm.api.backend_support()
  if not reasons["cuda"].ok:
    pytest.skip(reasons["cuda"].reason)


@pytest.fixture(autouse=True)
def _gpu():
  _cuda_or_skip()


emulated = jax.jit(reference.moe_emulated, static_argnames=("clamp",))


def _compare(name, y, want):
  y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
  assert y.shape == want.shape
  nan_y, nan_w = np.isnan(y), np.isnan(want)
  np.testing.assert_array_equal(nan_y, nan_w, err_msg=f"{name}: NaN positions differ")
  exact = float(np.mean(y.view(np.uint32) == want.view(np.uint32))) if y.size else 1.0
  diff = float(np.max(np.abs(np.where(nan_y, 0, y - want)))) if y.size else 0.0
  cos = accuracy.cosine(np.where(nan_y, 0, y), np.where(nan_w, 0, want)) if y.size and np.any(want) else 1.0
  print(f"\n  {name}: cosine {cos:.9f}, max |diff| {diff:.3g}, bit-exact share {exact:.6f}")
  assert cos >= 0.9999999, f"{name}: cosine {cos} < 0.9999999 (max abs diff {diff})"
  return exact


SMALL_GPU = dataclasses.replace(SMALL, tokens=12)  # capacity 16: the small prebuilt variants


@pytest.mark.parametrize("shared", [None, 32, 128], ids=["routed", "shared32", "shared128"])
@pytest.mark.parametrize("family", CASE_FAMILIES)
def test_matches_the_oracle_on_every_case_family(family, shared):
  shape = SMALL_GPU if shared is None else dataclasses.replace(SMALL_GPU, shared_intermediate=256,
                                                                  shared_group=shared)
  p = make_problem(family, shape, seed=21)
  x, w, r = quantized(p)
  for clamp in (p.shape.clamp, None):
    y = gm.moe(x, w, r, clamp=clamp, backend="cuda")
    y_jit = jax.jit(lambda x, w, r: gm.moe(x, w, r, clamp=clamp, backend="cuda"))(x, w, r)
    want = emulated(x, w, r.ids, r.weights, clamp=clamp)
    _compare(f"{family}/{shared}/clamp={clamp}", y, want)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(y_jit).view(np.uint16))


def test_nan_activation_poisons_only_its_token():
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=3))
  y = np.asarray(gm.moe(x.at[5, 7].set(jnp.nan), w, r, backend="cuda"), np.float32)
  assert np.isnan(y[5]).all() and np.isfinite(np.delete(y, 5, axis=0)).all()


PAPER = {"glm5.2": (6144, 2048, 32, 8), "dsv4.1-flash": (5120, 2304, 48, 6)}
_PAPER_WEIGHTS = {}


def _paper_weights(model, shared):
  """Quantized random weights of a paper per-rank shape, generated on the GPU once per (model, shared)."""
  if (model, shared) not in _PAPER_WEIGHTS:
    _PAPER_WEIGHTS.clear()  # one model's weights at a time (several GB)
    h, i, e, _ = PAPER[model]
    k1, k2, k3, k4 = jax.random.split(jax.random.key(hash(model) % 1000), 4)
    w13 = jax.random.normal(k1, (e, h, 2 * i), jnp.float32) / np.sqrt(h)
    w2 = jax.random.normal(k2, (e, i, h), jnp.float32) / np.sqrt(i)
    sh = None
    if shared:
      sh = (jax.random.normal(k3, (h, 2 * i), jnp.float32) / np.sqrt(h),
            jax.random.normal(k4, (i, h), jnp.float32) / np.sqrt(i))
    _PAPER_WEIGHTS[(model, shared)] = gm.quantize_experts(w13, w2, shared=sh, shared_group=128)
  return _PAPER_WEIGHTS[(model, shared)]


@pytest.mark.parametrize("model", sorted(PAPER))
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_paper_per_rank_shapes(model, shared, batch):
  h, i, e, k = PAPER[model]
  w = _paper_weights(model, shared)
  rng = np.random.default_rng(batch)
  x = jnp.asarray(rng.standard_normal((batch, h)), jnp.bfloat16)
  ids = jnp.asarray(np.argsort(rng.random((batch, e)), axis=1)[:, :k], jnp.int32)
  logits = rng.standard_normal((batch, k))
  rw = jnp.asarray(np.exp(logits) / np.exp(logits).sum(1, keepdims=True), jnp.float32)
  y = gm.moe(x, w, gm.Routes(ids, rw), clamp=10.0, backend="cuda")
  want = emulated(x, w, ids, rw, clamp=10.0)
  _compare(f"{model} shared={shared} B={batch}", y, want)


def test_loop_of_1000_calls_is_correct_with_one_graph_and_flat_memory():
  p = make_problem("default", SMALL_GPU, seed=4)
  x, w, r = quantized(p)
  step = jax.jit(lambda x, ids: gm.moe(x, w, gm.Routes(ids, r.weights), clamp=10.0, backend="cuda"))
  key = jax.random.key(0)
  y = step(x, r.ids).block_until_ready()
  before = ffi.graph_instantiations()
  stats = jax.devices()[0].memory_stats() or {}
  mem0 = stats.get("bytes_in_use")
  checked = 0
  for n in range(1000):
    key, k1, k2 = jax.random.split(key, 3)
    xn = jax.random.normal(k1, x.shape, jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(k2, r.ids.shape, 0, SMALL_GPU.experts, jnp.int32)
    y = step(xn, ids)
    if n % 100 == 99:
      np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                    np.asarray(emulated(xn, w, ids, r.weights, clamp=10.0)).view(np.uint16))
      checked += 1
  y.block_until_ready()
  assert ffi.graph_instantiations() == before, "a graph was instantiated inside the loop"
  mem1 = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
  print(f"\n  1000 calls: graphs instantiated {before} (unchanged), bytes in use {mem0} -> {mem1}, {checked} checked")
  if mem0 is not None:
    assert mem1 <= mem0 + (1 << 20), f"device memory grew from {mem0} to {mem1} bytes"


def test_forced_timeout_raises_and_the_next_call_works(monkeypatch):
  monkeypatch.setenv("GCMOE_SYNC_CHECK", "1")
  monkeypatch.setenv("GCMOE_WAIT_TIMEOUT_MS", "50")
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=5))
  stalled = int(np.asarray(r.ids)[0, 0])
  step = jax.jit(lambda x, w, r: gm.moe(x, w, r, clamp=10.0, backend="cuda"))
  ffi.debug_set_stall_expert(stalled)
  try:
    with pytest.raises(Exception, match=rf"role 2, block \d+, epoch \d+, counter {stalled}, .*spin-wait exceeded"):
      step(x, w, r).block_until_ready()
  finally:
    ffi.debug_set_stall_expert(-1)
  y = step(x, w, r)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                np.asarray(emulated(x, w, r.ids, r.weights, clamp=10.0)).view(np.uint16))


def test_out_of_range_id_under_jit_raises_naming_it(monkeypatch):
  monkeypatch.setenv("GCMOE_SYNC_CHECK", "1")
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=6))
  step = jax.jit(lambda ids: gm.moe(x, w, gm.Routes(ids, r.weights), backend="cuda"))
  with pytest.raises(Exception, match=r"role 1 read expert id 99"):
    step(r.ids.at[2, 1].set(99)).block_until_ready()
  np.testing.assert_array_equal(np.asarray(step(r.ids)).view(np.uint16),
                                np.asarray(emulated(x, w, r.ids, r.weights)).view(np.uint16))


def test_a_grid_that_cannot_be_resident_is_rejected_with_the_numbers():
  from gcmoe_jax.ffi import _cuda, _moe
  from gcmoe_jax.kernels import build
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=7))
  variant = build.Variant(512, 256, 8, 4, 16)
  built = build.load_or_build("sm_90a", variant)
  ws = variant.workspace()
  _cuda.register_raw("too-big", (16, 6, 10**9, ws.total, ws.silu_table),
                     (1, 256, 0, 100000, 256, 0, 0, 256, 0),  # role 2: 100000 CTAs
                     [built.cubin(i) for i in (1, 2, 3)], reference.silu_table())
  attrs = _moe.MoeAttrs.from_weights(w, 4, None, variant="too-big")
  with pytest.raises(Exception, match=r"role 2 grid of 100000 CTAs cannot be resident: \d+ CTA\(s\) per SM .* \(eq. 6\)"):
    _moe.moe_ffi(x, w.w13, w.w13_scale, w.w2, w.w2_scale, r.ids, r.weights, *_moe.no_shared_operands(),
                 attrs=attrs).block_until_ready()


def test_explain_picks_cuda():
  e = gm.explain()
  assert e.backend == "cuda", str(e)
  print("\n" + str(e))
