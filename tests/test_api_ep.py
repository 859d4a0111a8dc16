"""`gm.moe` with expert parallelism: ``axis_name`` inside shard_map, ``ep_axis`` on sharded global arrays."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gcmoe_jax as gm
from conftest import SMALL, quantized
from gcmoe_jax import reference, sharding
from gcmoe_jax.bench.problems import make_problem

R = 4
SHAPE = dataclasses.replace(SMALL, experts=8, tokens=8, top_k=3, shared_intermediate=256)


def _mesh():
  return jax.make_mesh((R,), ("ep",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:R])


@pytest.fixture(scope="module")
def problem():
  x, w, r = quantized(make_problem("zipf", SHAPE, seed=31))
  want = jax.jit(reference.moe_emulated, static_argnames="clamp")(x, w, r.ids, r.weights, clamp=10.0)
  return x, w, r, np.asarray(want).view(np.uint16)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_axis_name_inside_shard_map_equals_the_oracle(problem, backend):
  if not gm.api.backend_support()[backend].ok:
    pytest.skip(gm.api.backend_support()[backend].reason)
  x, w, r, want = problem
  mesh = _mesh()

  def body(x, w, ids, weights):
    return gm.moe(x, w, gm.Routes(ids, weights), clamp=10.0, backend=backend, axis_name="ep")

  specs = (P("ep"), sharding.expert_specs(w), P("ep"), P("ep"))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("ep")))
  y = f(*_placed(mesh, x, w, r))
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want)


def _placed(mesh, x, w, r):
  """Tokens and routes split over ``ep``; routed experts split, the shared expert replicated."""
  tokens = NamedSharding(mesh, P("ep"))
  return (jax.device_put(x, tokens), jax.device_put(w, sharding.expert_shardings(w, mesh)),
          jax.device_put(r.ids, tokens), jax.device_put(r.weights, tokens))


def test_ep_axis_on_sharded_global_arrays_equals_the_oracle(problem):
  x, w, r, want = problem
  args = _placed(_mesh(), x, w, r)
  f = jax.jit(lambda x, w, ids, wt: gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend="reference", ep_axis="ep"))
  y = f(*args)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want)


def test_axis_name_and_ep_axis_together_is_an_error(problem):
  x, w, r, _ = problem
  with pytest.raises(ValueError, match="moe: pass axis_name .* or ep_axis .*, not both"):
    gm.moe(x, w, r, axis_name="ep", ep_axis="ep")


@pytest.mark.parametrize("tokens, experts", [(R, 8), (8, R), (R, R)], ids=["one-token-per-rank", "one-expert-per-rank",
                                                                          "one-of-each"])
def test_ep_axis_with_one_token_or_expert_per_rank(tokens, experts):
  """Shardy rejects compound dimensions with a size-1 factor: the rule must drop them."""
  shape = dataclasses.replace(SHAPE, tokens=tokens, experts=experts, top_k=2)
  x, w, r = quantized(make_problem("default", shape, seed=32))
  want = jax.jit(reference.moe_emulated, static_argnames="clamp")(x, w, r.ids, r.weights, clamp=10.0)
  f = jax.jit(lambda x, w, ids, wt: gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend="reference", ep_axis="ep"))
  y = f(*_placed(_mesh(), x, w, r))
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(want).view(np.uint16))


def test_output_is_split_like_the_tokens(problem):
  x, w, r, _ = problem
  mesh = _mesh()
  f = jax.jit(lambda x, w, ids, wt: gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend="reference", ep_axis="ep"))
  y = f(*_placed(mesh, x, w, r))
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("ep")), y.ndim), y.sharding


def test_an_ep_axis_missing_from_the_mesh_is_an_error(problem):
  x, w, r, _ = problem
  f = jax.jit(lambda x, w, ids, wt: gm.moe(x, w, gm.Routes(ids, wt), backend="reference", ep_axis="tp"))
  with pytest.raises(ValueError, match=r"moe: ep_axis must name an axis of the mesh \('ep',\), got 'tp'"):
    f(*_placed(_mesh(), x, w, r))


def test_the_flax_module_sharded_over_8_devices_equals_one_device():
  from flax import nnx

  from gcmoe_jax import nn as gnn
  layer = gnn.MoE(512, 256, 8, 2, rngs=nnx.Rngs(0), shared_intermediate=256, clamp=10.0, backend="reference")
  x = jax.random.normal(jax.random.key(1), (16, 512)).astype("bfloat16")
  want = nnx.jit(lambda m, x: m(x))(layer, x)
  mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:8])
  layer.shard(mesh)
  y = nnx.jit(lambda m, x: m(x))(layer, jax.device_put(x, NamedSharding(mesh, P("ep"))))
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(want).view(np.uint16))


from gcmoe_jax.bench.problems import CASE_FAMILIES  # noqa: E402


@pytest.mark.parametrize("entry", ["ep_axis", "axis_name"])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("family", CASE_FAMILIES)
def test_every_case_family_on_every_mesh_size(family, ranks, entry):
  """DESIGN §6: the expert-parallel result equals the single-device oracle on the same global inputs, bit for bit."""
  backend = "cpu" if gm.api.backend_support()["cpu"].ok else "reference"  # the C++ op compiles fastest
  p = make_problem(family, SHAPE, seed=40 + ranks)
  x, w, r = quantized(p)
  want = np.asarray(jax.jit(reference.moe_emulated, static_argnames="clamp")(x, w, r.ids, r.weights, clamp=10.0))
  mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:ranks])
  if entry == "ep_axis":
    f = jax.jit(lambda x, w, ids, wt: gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend=backend, ep_axis="ep"))
  else:
    body = lambda x, w, ids, wt: gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend=backend, axis_name="ep")
    specs = (P("ep"), sharding.expert_specs(w), P("ep"), P("ep"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("ep")))
  y = f(*_placed(mesh, x, w, r))
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want.view(np.uint16),
                                err_msg=f"{family} R={ranks} {entry}")


# ---- transport='fused' (issue 9): the wiring on CPU devices; the kernels run in tests/test_multigpu.py ------------


def test_fused_transport_lowers_one_fused_call_per_rank_with_the_meshs_peer_groups(problem, monkeypatch):
  """``ep_axis`` with transport='fused': each shard's program is one fused call over its tokens and L local experts,
  given every rank's device (the kernels find their rank there); invalid ids are masked and their tokens NaN.
  A stand-in replaces the CUDA call (the kernels need GPUs) and records what the shard program passes it."""
  import jax.numpy as jnp
  from gcmoe_jax import ffi

  x, w, r, _ = problem
  seen = []

  def fake(x, w_local, ids, weights, *, clamp, peer_groups):
    seen.append((x.shape, int(w_local.w13.shape[0]), ids.shape, peer_groups, clamp))
    return jnp.where(ids.max(axis=1, keepdims=True) < 0, 0.0, 1.0).astype(jnp.bfloat16) + jnp.zeros_like(x)

  monkeypatch.setattr(ffi, "moe_fused_call", fake)
  ids = np.asarray(r.ids).copy()
  ids[3, 1] = SHAPE.experts + 5  # an invalid id: its token comes back NaN and is counted
  mesh = _mesh()
  args = _placed(mesh, x, w, gm.Routes(ids, r.weights))
  f = jax.jit(lambda x, w, ids, wt: sharding.moe_partitioned_with_stats(
    x, w, ids, wt, local_fn=reference.moe_emulated, clamp=10.0, axis="ep", transport="fused"))
  y, stats = f(*args)
  b, k, local = SHAPE.tokens // R, SHAPE.top_k, SHAPE.experts // R
  assert seen == [((b, SHAPE.hidden), local, (b, k), (tuple(d.local_hardware_id for d in mesh.devices.flat),), 10.0)]
  y = np.asarray(y, np.float32)
  assert np.isnan(y[3]).all() and not np.isnan(np.delete(y, 3, axis=0)).any()
  valid = (ids >= 0) & (ids < SHAPE.experts)
  load = max(np.sum((ids[p * b:(p + 1) * b] // local == q) & valid[p * b:(p + 1) * b]) for p in range(R)
             for q in range(R))
  assert (int(stats.overflow), int(stats.invalid), int(stats.max_load)) == (0, 1, load)


def test_fused_transport_errors_name_what_to_use_instead(problem):
  x, w, r, _ = problem
  with pytest.raises(NotImplementedError, match=r"transport='fused' inside shard_map .* ep_axis=\.\.\. under jax.jit"):
    sharding.moe_shard_map_body(x, w, r.ids, r.weights, axis_name="ep", local_fn=reference.moe_emulated,
                                transport="fused")
  with pytest.raises(ValueError, match=r"transport='fused' pulls every route and takes none, got capacity=4"):
    sharding.moe_partitioned(x, w, r.ids, r.weights, local_fn=reference.moe_emulated, axis="ep",
                             transport="fused", capacity=4)
  with pytest.raises(ValueError, match=r"transport='fused' runs in the CUDA kernels \(backend='cuda'\), got "
                                       r"backend='reference'"):
    gm.moe(x, w, r, backend="reference", ep_axis="ep", transport="fused")


def test_fused_peer_groups_follow_the_mesh_axis():
  from gcmoe_jax.sharding import _partitioned
  devices = jax.devices("cpu")[:8]
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=devices)
  ids = np.asarray([d.local_hardware_id for d in mesh.devices.flat]).reshape(2, 4)
  assert _partitioned.peer_groups(mesh, "ep") == tuple(tuple(int(v) for v in row) for row in ids)
  assert _partitioned.peer_groups(mesh, "dp") == tuple(tuple(int(v) for v in col) for col in ids.T)
