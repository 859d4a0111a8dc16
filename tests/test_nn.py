"""The Flax NNX module: routing semantics against numpy, equality with gcmoe_jax.moe, constructors, nnx transforms."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL
from flax import nnx

import gcmoe_jax as gm
from gcmoe_jax import nn as gnn
from gcmoe_jax.bench.problems import make_problem

E, H, I, K = SMALL.experts, SMALL.hidden, SMALL.intermediate, SMALL.top_k


@pytest.fixture(scope="module")
def problem():
  return make_problem("default", SMALL, seed=5)


@pytest.fixture(scope="module")
def router_w():
  return np.random.default_rng(6).standard_normal((H, E)).astype(np.float32) / np.sqrt(H) * 4.0


@pytest.fixture(scope="module")
def quantized(problem):
  return gm.quantize_experts(problem.w13, problem.w2)


@pytest.fixture(scope="module")
def x():
  return jnp.asarray(np.random.default_rng(7).standard_normal((6, H)), jnp.bfloat16)


def _np_route(x, router_w, *, score, top_k, norm, scale=1.0, bias=None):
  """The router recomputed independently in float64 numpy: ids [T, k] (best first), weights [T, k]."""
  logits = np.asarray(x, np.float64) @ np.asarray(router_w, np.float64)
  if score == "softmax":
    z = np.exp(logits - logits.max(-1, keepdims=True))
    scores = z / z.sum(-1, keepdims=True)
    select = scores
  else:
    scores = 1.0 / (1.0 + np.exp(-logits))
    select = scores if bias is None else scores + bias
  ids = np.argsort(-select, axis=-1, kind="stable")[:, :top_k]
  w = np.take_along_axis(scores, ids, axis=-1)
  if norm:
    w = w / w.sum(-1, keepdims=True)
  return ids.astype(np.int32), (w * scale).astype(np.float32)


def _bits(y):
  return np.asarray(y).view(np.uint16)


def test_output_equals_moe_on_numpy_routes(router_w, quantized, x):
  m = gnn.MoE.from_quantized(router_w, quantized, top_k=K, clamp=10.0, backend="reference")
  ids, w = _np_route(x, router_w, score="softmax", top_k=K, norm=False)
  r = m.route(x)
  np.testing.assert_array_equal(np.asarray(r.ids), ids)
  np.testing.assert_allclose(np.asarray(r.weights), w, rtol=1e-5)
  y = m(x)
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape
  # Bit for bit against the operator on the module's routes; on the numpy routes, float32 route weights may differ in
  # the last bit (summation order), which can move a BF16 rounding of w * a.
  np.testing.assert_array_equal(_bits(y), _bits(gm.moe(x, quantized, r, clamp=10.0, backend="reference")))
  y_np = gm.moe(x, quantized, gm.Routes(jnp.asarray(ids), jnp.asarray(w)), clamp=10.0, backend="reference")
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_np, np.float32), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("norm", [False, True])
def test_softmax_routing(router_w, quantized, x, norm):
  m = gnn.MoE.from_quantized(router_w, quantized, top_k=K, norm_topk_prob=norm, backend="reference")
  r = m.route(x)
  ids, w = _np_route(x, router_w, score="softmax", top_k=K, norm=norm)
  np.testing.assert_array_equal(np.asarray(r.ids), ids)
  np.testing.assert_allclose(np.asarray(r.weights), w, rtol=1e-5)
  sums = np.asarray(r.weights).sum(-1)
  if norm:
    np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
  else:
    assert np.all(sums < 1.0)  # top-k of a softmax over E > k experts


def test_sigmoid_routing_bias_selects_scale_multiplies(router_w, quantized, x):
  bias = np.zeros(E, np.float32)
  bias[[5, 2]] = 10.0  # steers selection to experts 5 and 2, whatever the scores
  m = gnn.MoE.from_quantized(router_w, quantized, top_k=K, score="sigmoid", score_bias=bias,
                             routed_scaling_factor=2.5, backend="reference")
  assert m.norm_topk_prob  # DeepSeek-V3 default for sigmoid
  r = m.route(x)
  ids, w = _np_route(x, router_w, score="sigmoid", top_k=K, norm=True, scale=2.5, bias=bias)
  np.testing.assert_array_equal(np.asarray(r.ids), ids)
  assert np.all(np.isin(np.asarray(r.ids)[:, :2], [2, 5]))
  np.testing.assert_allclose(np.asarray(r.weights), w, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(r.weights).sum(-1), 2.5, rtol=1e-6)
  # The weights are the unbiased sigmoid scores: the bias steers selection only.
  logits = np.asarray(x, np.float64) @ router_w.astype(np.float64)
  s = 1.0 / (1.0 + np.exp(-np.take_along_axis(logits, ids, -1)))
  np.testing.assert_allclose(np.asarray(r.weights), 2.5 * s / s.sum(-1, keepdims=True), rtol=1e-5)


def test_sigmoid_without_normalisation(router_w, quantized, x):
  m = gnn.MoE.from_quantized(router_w, quantized, top_k=K, score="sigmoid", norm_topk_prob=False,
                             backend="reference")
  _ids, w = _np_route(x, router_w, score="sigmoid", top_k=K, norm=False)
  np.testing.assert_allclose(np.asarray(m.route(x).weights), w, rtol=1e-5)


def test_from_bf16_and_from_mxfp4_agree(problem, router_w, x):
  shared = (np.random.default_rng(8).standard_normal((H, 2 * 256)).astype(np.float32) / np.sqrt(H),
            np.random.default_rng(9).standard_normal((256, H)).astype(np.float32) / np.sqrt(256))
  a = gnn.MoE.from_bf16(router_w, jnp.asarray(problem.w13, jnp.bfloat16), jnp.asarray(problem.w2, jnp.bfloat16),
                        top_k=K, shared=shared, clamp=10.0, backend="reference")
  for order in ("interleaved", "concatenated"):
    ckpt = jax.jit(gm.to_mxfp4, static_argnames="gate_up")(a.weights, gate_up=order)  # a helper here, not under test
    b = gnn.MoE.from_mxfp4(router_w, *ckpt, top_k=K, gate_up=order, shared=shared, clamp=10.0, backend="reference")
    for u, v in zip(jax.tree_util.tree_leaves(a.weights), jax.tree_util.tree_leaves(b.weights)):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
  assert a.weights.shared is not None
  np.testing.assert_array_equal(_bits(a(x)), _bits(b(x)))


def test_nnx_jit_and_batched_input(router_w, quantized, x):
  m = gnn.MoE.from_quantized(router_w, quantized, top_k=K, clamp=10.0, backend="reference")
  y = m(x)
  y_jit = nnx.jit(lambda m, x: m(x))(m, x)
  np.testing.assert_array_equal(_bits(y), _bits(y_jit))
  y3 = m(x.reshape(2, 3, H))  # [batch, seq, H]: tokens flattened
  assert y3.shape == (2, 3, H)
  np.testing.assert_array_equal(_bits(y3.reshape(6, H)), _bits(y))


def test_split_merge_round_trip(router_w, quantized, x):
  m = gnn.MoE.from_quantized(router_w, quantized, top_k=K, score="sigmoid", score_bias=np.ones(E, np.float32),
                             backend="reference")
  graphdef, state = nnx.split(m)
  m2 = nnx.merge(graphdef, state)
  assert isinstance(m2.weights, gm.ExpertWeights)
  for u, v in zip(jax.tree_util.tree_leaves(nnx.state(m)), jax.tree_util.tree_leaves(nnx.state(m2))):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
  np.testing.assert_array_equal(_bits(m(x)), _bits(m2(x)))
  # Only the router is an nnx.Param; the quantized experts and the selection bias are other Variable types.
  params = jax.tree_util.tree_leaves(nnx.state(m, nnx.Param))
  assert len(params) == 1 and params[0].shape == (H, E)
  assert len(jax.tree_util.tree_leaves(nnx.state(m, gnn.QuantizedParam))) == 4
  assert len(jax.tree_util.tree_leaves(nnx.state(m, gnn.RouterBias))) == 1


def test_random_init_with_shared_expert():
  m = gnn.MoE(512, 256, 4, 2, rngs=nnx.Rngs(0), shared_intermediate=256, shared_group=32)
  assert (m.hidden, m.intermediate, m.num_experts) == (512, 256, 4)
  assert m.weights.shared is not None and m.weights.shared.group == 32
  y = m(jnp.asarray(np.random.default_rng(1).standard_normal((3, 512)), jnp.bfloat16))
  assert np.all(np.isfinite(np.asarray(y, np.float32))) and np.any(np.asarray(y, np.float32) != 0)


def test_named_backend_that_cannot_run_raises(router_w, quantized, x):
  if dict(gm.explain().reasons)["cuda"].ok:
    pytest.skip("a CUDA GPU is present")
  m = gnn.MoE.from_quantized(router_w, quantized, top_k=K, backend="cuda")
  with pytest.raises(RuntimeError, match=r"moe: backend='cuda' cannot run here"):
    m(x)


# ---------------------------------------------------------------------------------------------------------------
# Errors: every raise in nn.py
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, exc, match", [
  ({"top_k": 2.0}, TypeError, "MoE: top_k must be an int, got 2.0"),
  ({"top_k": 9}, ValueError, r"MoE: top_k must be in \[1, min\(32, E\)\] = \[1, 8\] \(Table 10\), got 9"),
  ({"top_k": 0}, ValueError, r"MoE: top_k must be in \[1, min\(32, E\)\] = \[1, 8\] \(Table 10\), got 0"),
  ({"score": "relu"}, ValueError, r"MoE: score must be one of \('softmax', 'sigmoid'\), got 'relu'"),
  ({"norm_topk_prob": 1}, TypeError, "MoE: norm_topk_prob must be a bool or None, got 1"),
  ({"routed_scaling_factor": "2"}, TypeError, "MoE: routed_scaling_factor must be a float, got '2'"),
  ({"routed_scaling_factor": 0.0}, ValueError, "MoE: routed_scaling_factor must be finite and positive, got 0.0"),
  ({"clamp": "7"}, TypeError, "MoE: clamp must be a Python float or None, got str"),
  ({"clamp": -1.0}, ValueError, "MoE: clamp must be a finite positive number or None, got -1.0"),
  ({"backend": "tpu"}, ValueError, r"MoE: backend must be one of \('auto', 'cuda', 'cpu', 'reference'\), got 'tpu'"),
  ({"score_bias": np.zeros(E)}, ValueError, "MoE: score_bias applies only to score='sigmoid', got score='softmax'"),
  ({"score": "sigmoid", "score_bias": np.zeros(E + 1)}, ValueError,
   r"MoE: score_bias must have shape \[E\] = \[8\], got \[9\]"),
])
def test_option_errors(router_w, quantized, kwargs, exc, match):
  kwargs = {"top_k": K, **kwargs}
  with pytest.raises(exc, match=f"^{match}$"):
    gnn.MoE.from_quantized(router_w, quantized, **kwargs)


def test_router_and_weights_errors(router_w, quantized):
  with pytest.raises(TypeError, match=r"^MoE: router_w must be an array \[H, E\], got list$"):
    gnn.MoE.from_quantized([[0.0]], quantized, top_k=K)
  with pytest.raises(TypeError, match=r"^MoE: router_w must be a floating array, got int32$"):
    gnn.MoE.from_quantized(np.zeros((H, E), np.int32), quantized, top_k=K)
  with pytest.raises(ValueError, match=r"^MoE: router_w must have shape \[H, E\] = \[512, 8\], got \[512, 4\]$"):
    gnn.MoE.from_quantized(router_w[:, :4], quantized, top_k=K)
  with pytest.raises(TypeError, match=r"^MoE: weights must be gcmoe_jax.ExpertWeights, got tuple$"):
    gnn.MoE.from_quantized(router_w, (1, 2), top_k=K)
  with pytest.raises(TypeError, match=r"^MoE: weights must be gcmoe_jax.ExpertWeights, got dict$"):
    gnn.MoE(H, I, E, K, router_w=router_w, weights={})
  with pytest.raises(ValueError, match=r"^MoE: weights must have \(H, I, E\) = \(512, 256, 16\), got "
                                       r"\(512, 256, 8\)$"):
    gnn.MoE(H, I, 16, K, router_w=router_w, weights=quantized)
  with pytest.raises(TypeError, match=r"^MoE: weights must come with router_w \[H, E\], got weights without "
                                      r"router_w$"):
    gnn.MoE(H, I, E, K, weights=quantized)
  with pytest.raises(TypeError, match=r"^MoE: router_w must come with weights \(ExpertWeights\), got router_w "
                                      r"without weights$"):
    gnn.MoE(H, I, E, K, router_w=router_w)


def test_constructor_errors():
  with pytest.raises(TypeError, match=r"^MoE: rngs must be an nnx.Rngs for random init \(or pass router_w and "
                                      r"weights\), got NoneType$"):
    gnn.MoE(H, I, E, K)
  with pytest.raises(TypeError, match=r"^MoE: hidden must be an int, got 512.0$"):
    gnn.MoE(512.0, I, E, K, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"^MoE: experts must be positive, got 0$"):
    gnn.MoE(H, I, 0, K, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"^MoE: shared_intermediate must be an int or None, got '256'$"):
    gnn.MoE(H, I, E, K, rngs=nnx.Rngs(0), shared_intermediate="256")
  # Table 10 dimensions are checked by quantize_experts, which names them.
  with pytest.raises(ValueError, match=re.escape("quantize_experts: H (w13.shape[1]) must be a multiple of 128")):
    gnn.MoE(500, I, E, K, rngs=nnx.Rngs(0))


def test_call_errors(router_w, quantized, x):
  m = gnn.MoE.from_quantized(router_w, quantized, top_k=K, backend="reference")
  with pytest.raises(TypeError, match=r"^MoE: x must be an array, got list$"):
    m([[1.0]])
  with pytest.raises(TypeError, match=r"^MoE: x must have dtype bfloat16, got float32 \(convert with "
                                      r"x.astype\(jnp.bfloat16\)\)$"):
    m(x.astype(jnp.float32))
  with pytest.raises(TypeError, match=r"^MoE: x must be \[T, H\] or \[B, S, H\], got shape \[512\]$"):
    m(x[0])
  with pytest.raises(ValueError, match=r"^MoE: x.shape\[-1\] must equal H = 512, got 256$"):
    m(x[:, :256])
