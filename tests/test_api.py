"""The public API: argument checking (every Table 10 rejection), backend choice, jit and pytrees."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gcmoe_jax as gm
from conftest import SMALL, quantized
from gcmoe_jax import reference
from gcmoe_jax.bench.problems import make_problem


@pytest.fixture(scope="module")
def args():
  return quantized(make_problem("default", SMALL, seed=1))


def test_moe_equals_oracle_eager_and_jit(args):
  x, w, r = args
  y = gm.moe(x, w, r, clamp=10.0, backend="reference")
  y_jit = jax.jit(lambda x, w, r: gm.moe(x, w, r, clamp=10.0, backend="reference"))(x, w, r)
  want = jax.jit(reference.moe_emulated, static_argnames="clamp")(x, w, r.ids, r.weights, clamp=10.0)
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(want).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(y_jit).view(np.uint16), np.asarray(want).view(np.uint16))


def test_routes_and_weights_are_pytrees(args):
  x, w, r = args
  doubled = jax.tree_util.tree_map(lambda a: a, (w, r))
  assert isinstance(doubled[0], gm.ExpertWeights) and isinstance(doubled[1], gm.Routes)
  assert r.top_k == SMALL.top_k


def test_bf16_route_weights_are_accepted(args):
  x, w, r = args
  y = gm.moe(x, w, gm.Routes(r.ids, r.weights.astype(jnp.bfloat16)), backend="reference")
  assert y.shape == x.shape


def _replace(r, ids=None, weights=None):
  return gm.Routes(r.ids if ids is None else ids, r.weights if weights is None else weights)


@pytest.mark.parametrize("make, exc, match", [
  (lambda x, w, r: (x.astype(jnp.float32), w, r, {}), TypeError,
   r"moe: x must have dtype bfloat16, got float32 \(convert with x.astype\(jnp.bfloat16\)\)"),
  (lambda x, w, r: (x[None], w, r, {}), TypeError, r"moe: x must be rank 2 \[T, H\], got shape \[1, 6, 512\]"),
  (lambda x, w, r: (jnp.concatenate([x, x], 1), w, r, {}), ValueError,
   r"moe: x.shape\[1\] \(H\) must equal the experts' hidden size 512, got 1024"),
  (lambda x, w, r: (x, w, _replace(r, ids=r.ids.astype(jnp.int64 if jax.config.x64_enabled else jnp.int16)), {}),
   TypeError, r"moe: routes.ids must have dtype int32, got int16"),
  (lambda x, w, r: (x, w, _replace(r, weights=r.weights.astype(jnp.int32)), {}), TypeError,
   r"moe: routes.weights must be float32 \(or bfloat16/float16\), got int32"),
  (lambda x, w, r: (x, w, _replace(r, weights=r.weights[:, :2]), {}), ValueError,
   r"moe: routes.ids and routes.weights must have the same shape \[T, k\], got \[6, 4\] and \[6, 2\]"),
  (lambda x, w, r: (x[:3], w, r, {}), ValueError, r"moe: routes must have T = x.shape\[0\] = 3 rows, got 6"),
  (lambda x, w, r: (x, w, gm.Routes(jnp.zeros((6, 9), jnp.int32), jnp.ones((6, 9))), {}), ValueError,
   r"moe: top-k \(routes.ids.shape\[1\]\) must be in \[1, min\(32, E\)\] = \[1, 8\] \(Table 10\), got 9"),
  (lambda x, w, r: (x, w, gm.Routes(jnp.zeros((6, 0), jnp.int32), jnp.ones((6, 0))), {}), ValueError,
   r"moe: top-k .* got 0"),
  (lambda x, w, r: (x, w, _replace(r, ids=r.ids[:, 0]), {}), TypeError,
   r"moe: routes.ids must be rank 2 \[T, k\], got shape \[6\]"),
  (lambda x, w, r: (x, w, _replace(r, ids=r.ids.at[4, 2].set(8)), {}), ValueError,
   r"moe: routes.ids must be < E = 8 \(ids < 0 are padding\), got id 8 at token 4, slot 2 \(1 such id\(s\)\)"),
  (lambda x, w, r: (x, w, r, {"clamp": -1.0}), ValueError,
   r"moe: clamp must be a finite positive number or None, got -1.0"),
  (lambda x, w, r: (x, w, r, {"clamp": float("nan")}), ValueError, r"moe: clamp must be a finite positive"),
  (lambda x, w, r: (x, w, r, {"clamp": jnp.float32(3)}), TypeError,
   r"moe: clamp must be a Python float or None, got ArrayImpl"),
  (lambda x, w, r: (x, w, r, {"backend": "triton"}), ValueError,
   r"moe: backend must be one of \('auto', 'cuda', 'cpu', 'reference'\), got 'triton'"),
  (lambda x, w, r: (x, (w.w13, w.w2), r, {}), TypeError, r"moe: w must be gcmoe_jax.ExpertWeights"),
  (lambda x, w, r: (x, w, (r.ids, r.weights), {}), TypeError, r"moe: routes must be gcmoe_jax.Routes"),
])
def test_rejected_arguments_name_the_argument_and_value(args, make, exc, match):
  x, w, r, kw = make(*args)
  with pytest.raises(exc, match=match):
    gm.moe(x, w, r, **kw)


def test_rejections_happen_at_trace_time(args):
  x, w, r = args
  with pytest.raises(TypeError, match="moe: x must have dtype bfloat16"):
    jax.jit(lambda x: gm.moe(x, w, r)).lower(x.astype(jnp.float32))


def test_traced_out_of_range_id_poisons_its_token_on_the_reference_backend(args):
  x, w, r = args
  y = jax.jit(lambda ids: gm.moe(x, w, _replace(r, ids=ids), backend="reference"))(r.ids.at[2, 0].set(99))
  y = np.asarray(y, np.float32)
  assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()


def test_explain_lists_every_backend_with_a_reason():
  e = gm.explain()
  assert [name for name, _ in e.reasons] == ["cuda", "cpu", "reference"]
  assert e.backend in ("cpu", "reference", "cuda")
  text = str(e)
  assert "chosen" in text and e.backend in text
  if jax.default_backend() == "cpu":
    assert "needs a CUDA GPU, and the default device is cpu" in text


def test_forcing_an_unavailable_backend_raises_its_reason(args):
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU machine's answer")
  x, w, r = args
  with pytest.raises(RuntimeError, match=r"moe: backend='cuda' cannot run here: needs a CUDA GPU"):
    gm.moe(x, w, r, backend="cuda")


def test_shared_expert_size_mismatch_is_rejected():
  p = make_problem("default", dataclasses.replace(SMALL, shared_intermediate=256), seed=2)
  _, w, _ = quantized(p)
  with pytest.raises(ValueError, match="ExpertWeights: shared expert hidden size must equal H = 1024, got 512"):
    gm.ExpertWeights(w.w13, w.w13_scale, w.w2, w.w2_scale, w.shared, 8, 1024, 256)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # the output [T, H] aliases none of them
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_donated_and_strided_inputs_give_the_oracle(args, backend):
  """Donated buffers and strided views (XLA materialises them) change nothing in the result."""
  if not gm.api.backend_support()[backend].ok:
    pytest.skip(gm.api.backend_support()[backend].reason)
  x, w, r = args
  want = np.asarray(jax.jit(reference.moe_emulated, static_argnames="clamp")(x, w, r.ids, r.weights, clamp=10.0))
  donating = jax.jit(lambda x, ids, wt: gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend=backend),
                     donate_argnums=(0, 1, 2))
  y = donating(jnp.array(x), jnp.array(r.ids), jnp.array(r.weights))
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want.view(np.uint16))
  doubled = jnp.repeat(x, 2, axis=0)[::2]  # every other row of a larger buffer
  y = gm.moe(doubled, w, r, clamp=10.0, backend=backend)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want.view(np.uint16))


def test_cuda_token_capacity_is_a_clear_error():
  from gcmoe_jax.ffi import _cuda
  assert _cuda.capacity_for(1) == 8 and _cuda.capacity_for(9) == 16 and _cuda.capacity_for(17) == 32
  assert _cuda.capacity_for(33) == 64 and _cuda.capacity_for(256) == 256
  with pytest.raises(ValueError, match=r"the CUDA backend runs decode batches of at most 256 tokens per call .* "
                                       r"got T = 257"):
    _cuda.capacity_for(257)
