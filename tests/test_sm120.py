"""The sm_120a/sm_121a build on an SM120 GPU (issue 7): the numerical tests of the fast kernels, run through the
block-scaled QMMA seam. No SM120 GPU exists where this project is developed: these tests skip, and say so, on any
other device; the build itself is checked on the CPU (tests/test_kernels_build.py, tests/test_ptx.py).

The QMMA computes each K32 block's scaled product and adds it to the FP32 accumulator in hardware, so the result is
not required to be bit-identical to `reference.moe_emulated` (whose per-block product is rounded before the add):
the bar is the accuracy harness's cosine >= 0.9999999.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gcmoe_jax as gm
from conftest import SMALL, quantized
from gcmoe_jax import reference
from gcmoe_jax.bench import accuracy
from gcmoe_jax.bench.problems import CASE_FAMILIES, make_problem

pytestmark = [pytest.mark.sm120, pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _sm120():
  dev = jax.devices()[0]
  cc = str(getattr(dev, "compute_capability", ""))
  if dev.platform != "gpu" or not cc.startswith("12."):
    pytest.skip(f"needs an SM120/SM121 GPU for the sm_120a build; the default device is {dev.platform} "
                f"{dev.device_kind} (compute capability {cc or 'n/a'})")
  support = gm.api.backend_support()["cuda"]
  if not support.ok:
    pytest.skip(support.reason)


emulated = jax.jit(reference.moe_emulated, static_argnames=("clamp",))


def _close(name, y, want):
  y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
  np.testing.assert_array_equal(np.isnan(y), np.isnan(want), err_msg=f"{name}: NaN positions differ")
  ok = ~np.isnan(want)
  cos = accuracy.cosine(np.where(ok, y, 0), np.where(ok, want, 0))
  print(f"\n  {name}: cosine {cos:.9f}, max |diff| {np.max(np.abs(np.where(ok, y - want, 0))):.3g}")
  assert cos >= 0.9999999, f"{name}: cosine {cos} < 0.9999999"


@pytest.mark.parametrize("shared", [None, 32, 128], ids=["routed", "shared32", "shared128"])
@pytest.mark.parametrize("family", CASE_FAMILIES)
def test_sm120_matches_the_oracle_on_every_case_family(family, shared):
  shape = dataclasses.replace(SMALL, tokens=12)
  if shared is not None:
    shape = dataclasses.replace(shape, shared_intermediate=256, shared_group=shared)
  p = make_problem(family, shape, seed=21)
  x, w, r = quantized(p)
  y = jax.jit(lambda x, w, r: gm.moe(x, w, r, clamp=p.shape.clamp, backend="cuda"))(x, w, r)
  _close(f"{family}/{shared}", y, emulated(x, w, r.ids, r.weights, clamp=p.shape.clamp))


@pytest.mark.parametrize("model, h, i, e, k", [("glm5.2", 6144, 2048, 32, 8), ("dsv4.1-flash", 5120, 2304, 48, 6)])
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_sm120_paper_per_rank_shapes(model, h, i, e, k, batch):
  keys = jax.random.split(jax.random.key(batch), 3)
  w = gm.quantize_experts(jax.random.normal(keys[0], (e, h, 2 * i), jnp.float32) / np.sqrt(h),
                          jax.random.normal(keys[1], (e, i, h), jnp.float32) / np.sqrt(i))
  rng = np.random.default_rng(batch)
  x = jnp.asarray(rng.standard_normal((batch, h)), jnp.bfloat16)
  ids = jnp.asarray(np.argsort(rng.random((batch, e)), axis=1)[:, :k], jnp.int32)
  rw = jnp.asarray(rng.dirichlet(np.ones(k), batch), jnp.float32)
  y = gm.moe(x, w, gm.Routes(ids, rw), clamp=10.0, backend="cuda")
  _close(f"{model} B={batch}", y, emulated(x, w, ids, rw, clamp=10.0))


@pytest.mark.parametrize("top_k, tokens, compact", [(4, 12, False), (1, 200, True)], ids=["expanded", "compact"])
def test_sm120_both_fp4_operand_paths(top_k, tokens, compact):
  """The two FP4 operand paths of paper §4.3 on the test shape: capacity 16 at k = 4 (tile_n 16: the expanded tile,
  TMA 16U4_ALIGN16B + ldmatrix b4x16_p64) and capacity 256 at k = 1 (tile_n 48: the compact tile, prmt expansion)."""
  from gcmoe_jax.ffi import _cuda
  from gcmoe_jax.kernels import build

  variant = build.Variant(SMALL.hidden, SMALL.intermediate, SMALL.experts, top_k, _cuda.capacity_for(tokens))
  arch = _cuda.device_arch().reason  # the target the cuda backend builds for here
  assert build.load_or_build(arch, variant).role(2)["fp4_weights"] == ("compact" if compact else "expanded")
  p = make_problem("default", dataclasses.replace(SMALL, top_k=top_k, tokens=tokens), seed=5)
  x, w, r = quantized(p)
  y = jax.jit(lambda x, w, r: gm.moe(x, w, r, clamp=p.shape.clamp, backend="cuda"))(x, w, r)
  _close(f"{'compact' if compact else 'expanded'} k={top_k} T={tokens}", y,
         emulated(x, w, r.ids, r.weights, clamp=p.shape.clamp))
