"""Sharded global arrays under `jax.jit`: the op's partitioning rule (`custom_partitioning`).

`moe_partitioned` is one `custom_partitioning` call over flat arrays. When XLA partitions it over a mesh with the
expert axis, the `partition` callback asks for tokens, routes and routed experts split over that axis (the shared
expert replicated) and lowers one per-shard body (`_body.body`: all_to_all dispatch, local op, all_to_all combine;
for transport='fused', `_body.fused_body`: one kernel call given the mesh's peer groups), so neither x, the routes
nor the weights are ever gathered. On one device, or inside a fully manual `shard_map`, JAX runs the global
function instead: ``local_fn`` over all tokens and all experts, which is the same result.

The op's arguments are flat arrays, not the `ExpertWeights` pytree: the per-shard arrays hold L = E/R experts, and
`ExpertWeights` checks its shapes when it is rebuilt, so the per-shard body relabels them itself (`_rebuild`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gcmoe_jax.formats import ExpertWeights, SharedWeights
from gcmoe_jax.sharding import _body
from gcmoe_jax.sharding._body import EPStats, LocalFn


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the partitioner's callbacks need besides the arrays (hashable: a static argument)."""

  local_fn: LocalFn
  clamp: float | None
  axis: str
  transport: str
  capacity: int | None
  num_experts: int
  hidden: int
  intermediate: int
  shared: tuple[int, int] | None  # (Is, group) of the shared expert, or None


def _rebuild(st: _Static, leaves: tuple[jax.Array, ...]) -> ExpertWeights:
  shared = None
  if st.shared is not None:
    shared = SharedWeights(*leaves[4:], st.hidden, *st.shared)
  return ExpertWeights(*leaves[:4], shared, int(leaves[0].shape[0]), st.hidden, st.intermediate)


def _stats_vector(s: EPStats) -> jax.Array:
  return jnp.stack([s.overflow, s.invalid, s.max_load]).astype(jnp.int32)


def _global(st: _Static, x, ids, weights, *leaves):
  """The unpartitioned op (one device, or a fully manual context): ``local_fn`` over every route and expert."""
  # custom_partitioning refuses a function that closes over constants (local_fn's tables); an inner jit keeps them
  # inside its own jaxpr.
  return _global_jit(st, x, ids, weights, *leaves)


@functools.partial(jax.jit, static_argnums=(0,))
def _global_jit(st: _Static, x, ids, weights, *leaves):
  w = _rebuild(st, leaves)
  bad = ids >= st.num_experts
  y = st.local_fn(x, w, jnp.where(bad, -1, ids), weights.astype(jnp.float32), clamp=st.clamp)
  y = jnp.where(bad.any(axis=1, keepdims=True), jnp.asarray(jnp.nan, y.dtype), y)
  n_bad = jnp.sum(bad, dtype=jnp.int32)
  return y, _stats_vector(EPStats(jnp.int32(0), n_bad, jnp.sum(ids >= 0, dtype=jnp.int32) - n_bad))


_moe_cp = custom_partitioning(_global, static_argnums=(0,))


def _ranks(st: _Static, mesh) -> int:
  shape = dict(mesh.shape)
  if shape and st.axis not in shape:
    # Running unsharded here would gather x, the routes and the experts onto every device: refuse instead.
    raise ValueError(f"moe: ep_axis must name an axis of the mesh {tuple(shape)}, got {st.axis!r}")
  return int(shape.get(st.axis, 1))


def _check_divisible(num_experts: int, tokens: int, axis: str, r: int) -> None:
  if num_experts % r:
    raise ValueError(f"moe: E (number of experts) must be divisible by R (size of mesh axis {axis!r}), got "
                     f"E = {num_experts}, R = {r}")
  if tokens % r:
    raise ValueError(f"moe: T (x.shape[0]) must be divisible by R (size of mesh axis {axis!r}), got "
                     f"T = {tokens}, R = {r}")


def _shardings(st: _Static, mesh, num_leaves: int):
  """(argument shardings, result shardings): tokens and routed experts split over the axis, the rest replicated."""
  split = NamedSharding(mesh, P(st.axis) if _ranks(st, mesh) > 1 else P())
  rep = NamedSharding(mesh, P())
  args = (split, split, split) + (split,) * 4 + (rep,) * (num_leaves - 4)
  return args, (split, rep)


def _partition(st: _Static, mesh, arg_shapes, result_shape):
  del result_shape
  r = _ranks(st, mesh)
  _check_divisible(st.num_experts, arg_shapes[0].shape[0], st.axis, r)
  arg_shardings, result_shardings = _shardings(st, mesh, len(arg_shapes) - 3)
  if r == 1:
    return mesh, functools.partial(_global, st), result_shardings, arg_shardings
  # The fused transport's kernels need every rank's device: the partitioner's mesh has them.
  groups = _body.peer_groups(mesh, st.axis) if st.transport == "fused" else None

  def lower_fn(x, ids, weights, *leaves):
    y, stats = _body.body(x, _rebuild(st, leaves), ids, weights, axis_name=st.axis, local_fn=st.local_fn,
                          clamp=st.clamp, transport=st.transport, capacity=st.capacity, groups=groups)
    return y, _stats_vector(stats)

  return mesh, lower_fn, result_shardings, arg_shardings


def _infer_sharding_from_operands(st: _Static, mesh, arg_shapes, result_shape):
  # GSPMD propagation (used only with jax_use_shardy_partitioner=False): results follow the token split.
  del result_shape
  return _shardings(st, mesh, len(arg_shapes) - 3)[1]


def _sharding_rule(st: _Static, mesh, operand_types, result_types):
  """The Shardy rule: tokens ``(r b)`` and experts ``(r l)`` share the factor r that the expert axis splits.

  Splitting tokens and experts over one mesh axis is, for Shardy, one factor r of size R common to both leading
  dimensions; the per-rank extents b = T/R and l = E/R and every other dimension are never split.
  """
  del result_types
  r = _ranks(st, mesh)
  tokens = int(operand_types[0].shape[0])
  _check_divisible(st.num_experts, tokens, st.axis, r)  # Shardy calls this first, before `_partition`
  sizes = {"r": r, "b": tokens // r, "l": st.num_experts // r}
  # Shardy rejects a compound dimension with a factor of size 1 (one token or one expert per rank, or R = 1).
  kept = [f for f in ("r", "b", "l") if sizes[f] > 1] or ["r"]

  def lead(f: str) -> str:
    parts = [g for g in ("r", f) if g in kept]
    return parts[0] if len(parts) == 1 else f"({' '.join(parts)})" if parts else f

  tok, exp = lead("b"), lead("l")
  operands = [f"{tok} h", f"{tok} k", f"{tok} k", f"{exp} hb n c", f"{exp} n hb", f"{exp} ib h c", f"{exp} h ib"]
  if st.shared is not None:
    operands += ["hb sn sc", "sn sg", "sb h sc", "h sg2"]
  rule = ", ".join(operands) + f" -> {tok} h, s"
  # Every factor but r is never split. Listed in order of first appearance: Shardy requires the special factors'
  # indices sorted, and JAX numbers factors in that order.
  factors = rule.replace("(", " ").replace(")", " ").replace(",", " ").split()
  replicated = tuple(dict.fromkeys(f for f in factors if f not in ("r", "->")))
  # Sizes are given only for factors that appear solely inside compound dimensions: Shardy infers the others, and
  # rejects a size for a factor that is a whole dimension anywhere.
  compound = set(" ".join(re.findall(r"\(([^)]*)\)", rule)).split())
  whole = set(re.sub(r"\([^)]*\)", " ", rule).replace(",", " ").split())
  return rule, {"need_replication_factors": replicated,
                **{f: sizes[f] for f in ("r", "b", "l") if f in compound and f not in whole}}


_moe_cp.def_partition(
  partition=_partition,
  infer_sharding_from_operands=_infer_sharding_from_operands,
  sharding_rule=_sharding_rule,
)


def _leaves(w: ExpertWeights) -> tuple[jax.Array, ...]:
  routed = (w.w13, w.w13_scale, w.w2, w.w2_scale)
  if w.shared is None:
    return routed
  s = w.shared
  return routed + (s.s13, s.s13_scale, s.s2, s.s2_scale)


def _typed_mesh(arrays) -> Any:
  """The mesh in the arrays' types (sharding in types, set for Explicit mesh axes), or None."""
  for a in arrays:
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty:
      return mesh
  return None


def _check_args(x, w, ids, weights, local_fn, axis, transport, capacity) -> None:
  _body.check_common(x, w, ids, weights, local_fn, transport, capacity)
  if not isinstance(axis, str):
    raise TypeError(f"moe: axis must be a str (one mesh axis), got {type(axis).__name__}")
  mesh = _typed_mesh((x, ids, weights, *_leaves(w)))
  if mesh is None:
    ctx = jax.sharding.get_abstract_mesh()
    mesh = None if ctx.empty else ctx
  if mesh is not None and axis in mesh.axis_names:
    # Known at trace time (Explicit axes or `jax.set_mesh`); otherwise the partition callback checks it.
    _check_divisible(w.num_experts, x.shape[0], axis, int(dict(mesh.shape)[axis]))


def moe_partitioned_with_stats(x: jax.Array, w: ExpertWeights, ids: jax.Array, weights: jax.Array, *,
                               local_fn: LocalFn, clamp: float | None = None, axis: str = "ep",
                               transport: str = "collective", capacity: int | None = None
                               ) -> tuple[jax.Array, EPStats]:
  """`moe_partitioned` that also returns the transport's `EPStats` (overflow, invalid ids, peak load).

  Returns:
    ``(y, stats)``: y bfloat16 ``[T, H]``; stats int32 scalars (replicated).
  """
  _check_args(x, w, ids, weights, local_fn, axis, transport, capacity)
  if x.shape[0] == 0:  # nothing to route; Shardy cannot describe a zero-sized token factor
    zero = jnp.zeros((), jnp.int32)
    return jnp.zeros((0, w.hidden), jnp.bfloat16), EPStats(zero, zero, zero)
  shared = None if w.shared is None else (w.shared.intermediate, w.shared.group)
  st = _Static(local_fn, None if clamp is None else float(clamp), axis, transport,
               None if capacity is None else int(capacity), w.num_experts,
               w.hidden, w.intermediate, shared)
  args = (x, ids, weights, *_leaves(w))
  call = functools.partial(_moe_cp, st)
  mesh = _typed_mesh(args)
  if mesh is not None and mesh.explicit_axes:
    # custom_partitioning is an Auto-mode (partitioner-driven) op: with Explicit axes, run it in an auto_axes
    # region and give its results their types back.
    y_spec = P(axis) if axis in mesh.axis_names else P()
    with jax.sharding.use_abstract_mesh(mesh):
      y, stats = jax.sharding.auto_axes(call, axes=mesh.explicit_axes, out_sharding=(y_spec, P()))(*args)
  else:
    y, stats = call(*args)
  return y, EPStats(stats[0], stats[1], stats[2])


def moe_partitioned(x: jax.Array, w: ExpertWeights, ids: jax.Array, weights: jax.Array, *, local_fn: LocalFn,
                    clamp: float | None = None, axis: str = "ep", transport: str = "collective",
                    capacity: int | None = None) -> jax.Array:
  """Expert-parallel MoE on sharded global arrays, for use under `jax.jit`.

  With the routed experts' leading dimension split over mesh axis ``axis`` (R ranks, L = E/R experts each: global
  expert g on rank ``g // L`` as local expert ``g % L``) and tokens split over the same axis (B = T/R each), XLA
  partitions the op into the `moe_shard_map_body` program: routes travel to their experts' ranks with
  `jax.lax.all_to_all`, outputs travel back, and each token's owner combines its k slots and the (replicated)
  shared expert. x, the routes and the weights are never all-gathered; inputs placed otherwise are resharded to
  that layout first. Without the axis in the mesh, or on one device, ``local_fn`` runs on the whole problem. The
  result equals the single-device `moe_emulated` bit for bit.

  Args:
    x: bfloat16 ``[T, H]``.
    w: all E experts (`ExpertWeights`), typically placed with `expert_shardings`.
    ids: int32 ``[T, k]`` expert ids; ids < 0 are padding, ids >= E poison their token with NaN.
    weights: float32 ``[T, k]`` route weights.
    local_fn: the per-rank grouped op (see `moe_shard_map_body`), e.g. `gcmoe_jax.reference.moe_emulated`.
    clamp: the SwiGLU clamp, or None.
    axis: the mesh axis the experts and tokens are split over.
    transport: ``"collective"`` (all_to_all) or ``"ragged"`` (ragged_all_to_all, GPU only).
    capacity: rows each rank may send to each peer (default ``(T/R) k``: no overflow possible); routes past it
      come back as NaN tokens, counted by `moe_partitioned_with_stats`.

  Returns:
    bfloat16 ``[T, H]``, split like x.

  Raises:
    TypeError, ValueError: for arguments of the wrong type, rank, dtype or shape; ValueError when E or T is not
      divisible by R (at trace time when the mesh is set with `jax.set_mesh`, otherwise when XLA partitions).
  """
  return moe_partitioned_with_stats(x, w, ids, weights, local_fn=local_fn, clamp=clamp, axis=axis,
                                    transport=transport, capacity=capacity)[0]
