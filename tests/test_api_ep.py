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
from gcmoe_jax.sharding import _peers
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


def test_body_with_stats_takes_the_pytree_and_passes_check_vma(problem):
  """docs/expert_parallel.md's entry point 1 as written: the `ExpertWeights` pytree through ``in_specs``,
  `jax.shard_map`'s default ``check_vma=True``, the stats replicated (``out_specs=P()``)."""
  x, w, r, want = problem
  mesh = _mesh()

  def step(x, w, ids, weights):
    return sharding.moe_shard_map_body_with_stats(x, w, ids, weights, axis_name="ep",
                                                  local_fn=reference.moe_emulated, clamp=10.0)

  specs = (P("ep"), sharding.expert_specs(w), P("ep"), P("ep"))
  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P("ep"), P())))
  y, stats = f(*_placed(mesh, x, w, r))
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want)
  assert int(stats.overflow) == 0 and int(stats.invalid) == 0 and int(stats.max_load) >= 1


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

  def fake(x, w_local, ids, weights, *, clamp, peer_groups, exchange):
    assert exchange is _peers.exchange
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
  with pytest.raises(ValueError, match=r"transport='fused' inside shard_map needs the concrete mesh, .* pass "
                                       r"mesh=<the jax.sharding.Mesh shard_map runs over> or trace under "
                                       r"jax.set_mesh\(mesh\), got mesh=None"):
    sharding.moe_shard_map_body(x, w, r.ids, r.weights, axis_name="ep", local_fn=reference.moe_emulated,
                                transport="fused")
  with pytest.raises(ValueError, match=r"transport='fused' pulls every route and takes none, got capacity=4"):
    sharding.moe_partitioned(x, w, r.ids, r.weights, local_fn=reference.moe_emulated, axis="ep",
                             transport="fused", capacity=4)
  with pytest.raises(ValueError, match=r"transport='fused' runs in the CUDA kernels \(backend='cuda'\), got "
                                       r"backend='reference'"):
    gm.moe(x, w, r, backend="reference", ep_axis="ep", transport="fused")


def test_fused_peer_groups_follow_the_mesh_axis():
  from gcmoe_jax.sharding import _body
  devices = jax.devices("cpu")[:8]
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=devices)
  ids = np.asarray([d.local_hardware_id for d in mesh.devices.flat]).reshape(2, 4)
  assert _body.peer_groups(mesh, "ep") == tuple(tuple(int(v) for v in row) for row in ids)
  assert _body.peer_groups(mesh, "dp") == tuple(tuple(int(v) for v in col) for col in ids.T)


# ---- transport='fused' inside shard_map (axis_name): the concrete mesh gives the peer groups --------------------

# The shard_map meshes of the fused tests: EP over 4 devices, alone or beside a data-parallel axis of 2, the devices
# in a scrambled order so that the groups are not simply 0..7 in order.
_SCRAMBLED = (5, 2, 7, 0, 3, 6, 1, 4)
FUSED_MESHES = {"ep4": ((4,), ("ep",)), "dp2-ep4": ((2, 4), ("dp", "ep")), "ep4-dp2": ((4, 2), ("ep", "dp"))}


def _fused_mesh(name):
  shape, names = FUSED_MESHES[name]
  devices = [jax.devices("cpu")[i] for i in _SCRAMBLED[:int(np.prod(shape))]]
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names, axis_types=(AxisType.Explicit,) * len(names))


def _groups_along_ep(mesh):
  """The expected peer groups, read off the device array directly: the devices along 'ep', for each other index."""
  devices = mesh.devices if mesh.axis_names[-1] == "ep" else mesh.devices.T
  return tuple(tuple(int(d.local_hardware_id) for d in row) for row in devices.reshape(-1, mesh.shape["ep"]))


def _fake_fused_call(seen, received=None):
  """A stand-in for `ffi.moe_fused_call` (the kernels need GPUs) that records its static arguments in ``seen`` at
  trace time, each rank's ids in ``received`` when it runs, and returns, for each token, the sum of (id + 1) over
  its ids."""
  import jax.numpy as jnp

  def fake(x, w_local, ids, weights, *, clamp, peer_groups, exchange):
    assert exchange is _peers.exchange  # the handles of groups across processes travel through jax.distributed
    seen.append((x.shape, int(w_local.w13.shape[0]), w_local.num_experts, ids.shape, peer_groups, clamp))
    if received is not None:
      jax.debug.callback(lambda a: received.append(np.asarray(a)), ids)
    s = jnp.sum(jnp.where(ids >= 0, ids + 1, 0), axis=1, keepdims=True)
    return s.astype(jnp.bfloat16) + jnp.zeros_like(x)

  return fake


def _fake_expected(ids):
  """What the fake returns per token once ids >= E are masked to -1, and NaN for the tokens that held one."""
  masked = np.where(ids >= SHAPE.experts, -1, ids)
  s = np.where(masked >= 0, masked + 1, 0).sum(axis=1).astype(np.float32)
  return np.where((ids >= SHAPE.experts).any(axis=1), np.nan, s)


def _with_an_invalid_id(r):
  ids = np.asarray(r.ids).copy()
  ids[3, 1] = SHAPE.experts + 5  # an invalid id: its token comes back NaN and is counted
  return gm.Routes(ids, r.weights), ids


def _fused_stats_program(w, mesh, axis_mesh, **kw):
  """jit(shard_map) of `moe_shard_map_body_with_stats` with transport='fused' over ``mesh``, given ``axis_mesh``."""
  def step(x, w, ids, wt):
    return sharding.moe_shard_map_body_with_stats(x, w, ids, wt, axis_name="ep", local_fn=reference.moe_emulated,
                                                  clamp=10.0, transport="fused", mesh=axis_mesh, **kw)

  specs = (P("ep"), sharding.expert_specs(w), P("ep"), P("ep"))
  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P("ep"), P())))


@pytest.mark.parametrize("source", ["mesh=", "jax.set_mesh", "with mesh"])
@pytest.mark.parametrize("mesh_name", list(FUSED_MESHES))
def test_fused_inside_shard_map_is_one_fused_call_per_rank_with_the_meshs_peer_groups(problem, monkeypatch, mesh_name,
                                                                                      source):
  """``axis_name`` with transport='fused': the body lowers to one fused call over its B tokens and L local experts,
  given the peer groups of the concrete mesh (explicit, or the one set around the trace); invalid ids are masked as
  on the partitioned path (their tokens NaN), and the EPStats are the partitioned path's."""
  import warnings

  from gcmoe_jax import ffi
  x, w, r, _ = problem
  seen, received = [], []
  monkeypatch.setattr(ffi, "moe_fused_call", _fake_fused_call(seen, received))
  routes, ids = _with_an_invalid_id(r)
  mesh = _fused_mesh(mesh_name)
  args = _placed(mesh, x, w, routes)
  if source == "mesh=":
    y, stats = _fused_stats_program(w, mesh, mesh)(*args)
  elif source == "jax.set_mesh":
    with jax.set_mesh(mesh):
      y, stats = _fused_stats_program(w, mesh, None)(*args)
  else:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:` is deprecated, still supported
      with mesh:
        y, stats = _fused_stats_program(w, mesh, None)(*args)
  b, k, local = SHAPE.tokens // R, SHAPE.top_k, SHAPE.experts // R
  groups = _groups_along_ep(mesh)
  assert len(groups) == mesh.size // R and all(len(g) == R for g in groups), groups
  assert seen == [((b, SHAPE.hidden), local, local, (b, k), groups, 10.0)]
  # Each rank's call got its own B tokens' ids with the invalid one masked to padding (once per dp replica).
  masked = np.where(ids >= SHAPE.experts, -1, ids)
  want_ids = sorted([masked[p * b:(p + 1) * b].tobytes() for p in range(R)] * (mesh.size // R))
  jax.effects_barrier()  # jax.debug.callback runs asynchronously: every rank's callback has run only after this
  assert sorted(a.astype(np.int32).tobytes() for a in received) == want_ids, received
  np.testing.assert_array_equal(np.asarray(y, np.float32)[:, 0], _fake_expected(ids))
  valid = (ids >= 0) & (ids < SHAPE.experts)
  load = max(np.sum((ids[p * b:(p + 1) * b] // local == q) & valid[p * b:(p + 1) * b]) for p in range(R)
             for q in range(R))
  # Summed over 'ep' only: each dp group counts its own replica of the tokens once.
  assert (int(stats.overflow), int(stats.invalid), int(stats.max_load)) == (0, 1, load)


def _as_cuda(monkeypatch):
  """`gm.moe` believes backend='cuda' runs here (the wiring under test stops before any kernel)."""
  monkeypatch.setattr(gm.api, "explain", lambda backend="auto": gm.api.Explanation("cuda", backend, ()))


def _gm_fused_program(w, shard_mesh, **kw):
  """jit(shard_map over ``shard_mesh``) of `gm.moe` with axis_name='ep', transport='fused' and keywords ``kw``."""
  def body(x, w, ids, wt):
    return gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend="cuda", axis_name="ep", transport="fused", **kw)

  specs = (P("ep"), sharding.expert_specs(w), P("ep"), P("ep"))
  return jax.jit(jax.shard_map(body, mesh=shard_mesh, in_specs=specs, out_specs=P("ep")))


def test_gm_moe_passes_its_mesh_to_the_fused_shard_map_body(problem, monkeypatch):
  from gcmoe_jax import ffi
  x, w, r, _ = problem
  seen = []
  _as_cuda(monkeypatch)
  monkeypatch.setattr(ffi, "moe_fused_call", _fake_fused_call(seen))
  routes, ids = _with_an_invalid_id(r)
  mesh = _fused_mesh("dp2-ep4")
  y = _gm_fused_program(w, mesh, mesh=mesh)(*_placed(mesh, x, w, routes))
  b, local = SHAPE.tokens // R, SHAPE.experts // R
  assert seen == [((b, SHAPE.hidden), local, local, (b, SHAPE.top_k), _groups_along_ep(mesh), 10.0)]
  np.testing.assert_array_equal(np.asarray(y, np.float32)[:, 0], _fake_expected(ids))


def test_fused_inside_shard_map_lowers_to_one_gcmoe_custom_call_and_no_all_to_all(problem, monkeypatch):
  """The real `ffi.moe_fused_call` lowered on CPU: only the kernel variant's registration (`_cuda.prepare`, which
  needs a GPU) is replaced. The StableHLO has one gcmoe custom call over this rank's B tokens and L experts with the
  fused variant, and no all_to_all (the collective transport has two)."""
  from gcmoe_jax.ffi import _cuda, _moe
  x, w, r, _ = problem
  prepared = []

  def prepare(hidden, intermediate, experts, top_k, tokens, shared_intermediate, shared_group, peer_groups=(),
              exchange=None):
    assert exchange is (_peers.exchange if peer_groups else None)
    prepared.append((experts, top_k, tokens, peer_groups))
    return "fused-test-variant"

  _as_cuda(monkeypatch)
  monkeypatch.setattr(_cuda, "prepare", prepare)
  monkeypatch.setattr(_moe, "_require_library", lambda *_: None)  # lowering needs no handler
  mesh = _fused_mesh("dp2-ep4")
  args = _placed(mesh, x, w, r)
  text = _gm_fused_program(w, mesh, mesh=mesh).lower(*args).as_text()
  b, k, local, h = SHAPE.tokens // R, SHAPE.top_k, SHAPE.experts // R, SHAPE.hidden
  assert prepared == [(local, k, b, _groups_along_ep(mesh))]
  calls = [line for line in text.splitlines() if "stablehlo.custom_call @gcmoe_moe_v1" in line]
  assert len(calls) == 1, calls
  assert 'variant = "fused-test-variant"' in calls[0] and f"E = {local} : i64" in calls[0], calls[0]
  operands = calls[0].rsplit(" : (", 1)[1]  # the operand types: x, w13, ..., ids, weights, shared
  assert operands.startswith(f"tensor<{b}x{h}xbf16>, tensor<{local}x"), operands
  assert f"tensor<{b}x{k}xi32>, tensor<{b}x{k}xf32>" in operands, operands
  assert "all_to_all" not in text
  # The collective transport's lowering of the same program does have the exchange, so the check above can fail.
  collective = jax.jit(jax.shard_map(
    lambda x, w, i, g: gm.moe(x, w, gm.Routes(i, g), clamp=10.0, backend="cuda", axis_name="ep"), mesh=mesh,
    in_specs=(P("ep"), sharding.expert_specs(w), P("ep"), P("ep")), out_specs=P("ep"))).lower(*args).as_text()
  assert collective.count("stablehlo.all_to_all") == 2


def test_fused_inside_shard_map_with_one_rank_runs_the_local_op(problem, monkeypatch):
  """R = 1: no transport runs (as on the partitioned path), so local_fn computes every route: the oracle."""
  from gcmoe_jax import ffi
  x, w, r, want = problem
  seen = []
  monkeypatch.setattr(ffi, "moe_fused_call", _fake_fused_call(seen))
  mesh = jax.make_mesh((1,), ("ep",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:1])

  def step(x, w, ids, wt):
    return sharding.moe_shard_map_body(x, w, ids, wt, axis_name="ep", local_fn=reference.moe_emulated, clamp=10.0,
                                       transport="fused", mesh=mesh)

  specs = (P("ep"), sharding.expert_specs(w), P("ep"), P("ep"))
  y = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=P("ep")))(*_placed(mesh, x, w, r))
  assert seen == []
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want)


def _trace_fused(problem, mesh, **kw):
  x, w, r, _ = problem
  return _fused_stats_program(w, mesh, **kw).trace(*_placed(mesh, x, w, r))


@pytest.mark.parametrize("case, exc, match", [
  ("no mesh", ValueError, (r"moe: transport='fused' inside shard_map needs the concrete mesh, whose devices give the "
                           r"kernels their peers: pass mesh=<the jax.sharding.Mesh shard_map runs over> or trace under "
                           r"jax.set_mesh\(mesh\), got mesh=None and no mesh set \(axis_name='ep'\)")),
  ("axis missing", ValueError, r"moe: mesh must have the axis axis_name='ep', got a mesh with axes \('x',\)"),
  ("axis size", ValueError, (r"moe: mesh axis 'ep' must have the size of the shard_map axis 'ep' \(R = 4\), got 8 in "
                             r"mesh \{'ep': 8\}; pass the mesh shard_map runs over")),
  ("ambient axis size", ValueError, (r"moe: mesh axis 'ep' must have the size of the shard_map axis 'ep' \(R = 4\), "
                                     r"got 8")),
  ("other axes", ValueError, (r"moe: mesh must be the mesh shard_map runs over, of shape \{'dp': 2, 'ep': 4\}, got "
                              r"\{'ep': 4\}")),
  ("abstract mesh", TypeError, (r"moe: mesh must be a jax.sharding.Mesh \(with devices: the mesh shard_map runs over\) "
                                r"or None, got AbstractMesh")),
  ("capacity", ValueError, r"transport='fused' pulls every route and takes none, got capacity=4"),
])
def test_fused_inside_shard_map_mesh_errors(problem, monkeypatch, case, exc, match):
  import warnings

  from gcmoe_jax import ffi
  monkeypatch.setattr(ffi, "moe_fused_call", _fake_fused_call([]))
  cpu = jax.devices("cpu")
  ep4, ep8 = (jax.make_mesh((n,), ("ep",), devices=cpu[:n]) for n in (4, 8))
  with pytest.raises(exc, match=match):
    if case == "no mesh":
      _trace_fused(problem, ep4, axis_mesh=None)
    elif case == "axis missing":
      _trace_fused(problem, ep4, axis_mesh=jax.make_mesh((4,), ("x",), devices=cpu[:4]))
    elif case == "axis size":
      _trace_fused(problem, ep4, axis_mesh=ep8)
    elif case == "ambient axis size":  # a mesh set around the trace is checked too: it need not be shard_map's
      with warnings.catch_warnings():  # (jax.set_mesh itself refuses a shard_map over another mesh)
        warnings.simplefilter("ignore", DeprecationWarning)
        with ep8:
          _trace_fused(problem, ep4, axis_mesh=None)
    elif case == "other axes":  # the EP devices alone would leave the other dp group's devices out of the groups
      _trace_fused(problem, jax.make_mesh((2, 4), ("dp", "ep"), devices=cpu[:8]), axis_mesh=ep4)
    elif case == "abstract mesh":
      _trace_fused(problem, ep4, axis_mesh=ep4.abstract_mesh)
    else:
      _trace_fused(problem, ep4, axis_mesh=ep4, capacity=4)


def test_fused_inside_shard_map_refuses_a_group_of_several_devices_of_another_process(problem, monkeypatch):
  """`peer_groups`' NotImplementedError, seen from the body: here every device looks like one of 'process 0' to
  'process 1', four in one group (one device per process, or all in one, is what the transport connects)."""
  from gcmoe_jax import ffi
  monkeypatch.setattr(ffi, "moe_fused_call", _fake_fused_call([]))
  mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices("cpu")[:4])
  x, w, r, _ = problem
  args = _placed(mesh, x, w, r)
  monkeypatch.setattr(jax, "process_index", lambda *a: 1)
  with pytest.raises(NotImplementedError, match=r"moe: transport='fused' connects the devices of a peer group either "
                                                r"within one process \(peer access\) or one device per process "
                                                r"\(CUDA IPC\); mesh axis 'ep' has a group on processes \[0, 0, 0, "
                                                r"0\]"):
    _fused_stats_program(w, mesh, mesh).trace(*args)


@pytest.mark.parametrize("me, want", [
  (0, ((0, -2), (1, -2))),  # 2 processes x 2 GPUs, the EP axis across the processes: a device of each per group
  (1, ((-1, 0), (-1, 1))),
])
def test_peer_groups_across_processes_name_other_processes_devices(me, want, monkeypatch):
  """A device of another process is -(1 + its process index) in the groups (CUDA IPC reaches it); this process's
  devices keep their CUDA ordinal."""
  import types

  from gcmoe_jax.sharding import _body
  dev = lambda p, o: types.SimpleNamespace(process_index=p, local_hardware_id=o)
  mesh = types.SimpleNamespace(axis_names=("dp", "ep"), devices=np.array([[dev(0, 0), dev(1, 0)],
                                                                          [dev(0, 1), dev(1, 1)]], dtype=object))
  monkeypatch.setattr(jax, "process_index", lambda *a: me)
  assert _body.peer_groups(mesh, "ep") == want
  other = 1 - me
  with pytest.raises(NotImplementedError, match=rf"has a group on processes \[{other}, {other}\]"):
    _body.peer_groups(mesh, "dp")  # along dp, one group is two devices of the other process


def test_gm_moe_fused_inside_shard_map_errors(problem, monkeypatch):
  """Another backend than cuda is refused as on the partitioned path; ``mesh`` belongs with ``axis_name``."""
  x, w, r, _ = problem
  mesh = _mesh()
  with pytest.raises(ValueError, match=r"moe: transport='fused' runs in the CUDA kernels \(backend='cuda'\), got "
                                       r"backend='reference' \(running 'reference'\); use transport='collective'"):
    gm.moe(x, w, r, backend="reference", axis_name="ep", transport="fused", mesh=mesh)
  with pytest.raises(ValueError, match=r"moe: mesh applies with axis_name \(inside jax.shard_map\), got mesh with axes "
                                       r"\('ep',\) and axis_name=None \(ep_axis='ep'\)"):
    gm.moe(x, w, r, backend="reference", ep_axis="ep", mesh=mesh)
  _as_cuda(monkeypatch)
  with pytest.raises(ValueError, match=r"needs the concrete mesh"):
    _gm_fused_program(w, mesh).trace(*_placed(mesh, x, w, r))
