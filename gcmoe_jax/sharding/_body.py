"""The per-shard expert-parallel body: dispatch, the local grouped op, combine (DESIGN §2 step 6, §6).

Also the fused transport's per-shard call (docs/fused_transport.md), which both entry points lower to: the peer
groups of a mesh, one `ffi.moe_fused_call` with invalid ids masked, its `EPStats`, and the concrete mesh a
`shard_map` body takes the peer groups from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import _compat, ffi
from gcmoe_jax._checks import check_activations
from gcmoe_jax.formats import ExpertWeights
from gcmoe_jax.sharding import _peers
from gcmoe_jax.sharding import _transport as tr

LocalFn = Callable[..., jax.Array]
"""``local_fn(x_rows [M, H] bf16, w_local, local_ids [M, k] int32, weights [M, k] f32, *, clamp) -> [M, H] bf16``."""


class EPStats(NamedTuple):
  """What the transport did, summed (or maxed) over the expert-parallel axis: the same value on every rank.

  Attributes:
    overflow: int32 ``[]``: routes that did not fit in their peer's ``capacity`` rows. Their tokens are NaN.
    invalid: int32 ``[]``: routes with an expert id >= E (a user error). Their tokens are NaN.
    max_load: int32 ``[]``: the most routes one rank had for one peer, i.e. the smallest ``capacity`` with no
      overflow for this batch.
  """

  overflow: jax.Array
  invalid: jax.Array
  max_load: jax.Array


def check_common(x: Any, w: Any, ids: Any, weights: Any, local_fn: Any, transport: Any, capacity: Any) -> None:
  """Trace-time checks shared by both entry points (TypeError for types and ranks, ValueError for values)."""
  if not isinstance(w, ExpertWeights):
    raise TypeError(f"moe: w must be gcmoe_jax.ExpertWeights, got {type(w).__name__}")
  if not callable(local_fn):
    raise TypeError(f"moe: local_fn must be callable, got {type(local_fn).__name__}")
  check_activations(x, w.hidden)
  for name, a in (("ids", ids), ("weights", weights)):
    if not hasattr(a, "shape") or a.ndim != 2:
      raise TypeError(f"moe: {name} must be rank 2 [T, k], got shape {list(getattr(a, 'shape', ()))}")
  if ids.dtype != jnp.int32:
    raise TypeError(f"moe: ids must have dtype int32, got {ids.dtype}")
  if not jnp.issubdtype(weights.dtype, jnp.floating):
    raise TypeError(f"moe: weights must be float32, got {weights.dtype}")
  if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
    raise ValueError(f"moe: ids and weights must have shape [T, k] with T = x.shape[0] = {x.shape[0]}, got "
                     f"{list(ids.shape)} and {list(weights.shape)}")
  if transport not in (*tr.TRANSPORTS, "fused"):
    raise ValueError(f"moe: transport must be one of {(*tr.TRANSPORTS, 'fused')}, got {transport!r}")
  if transport == "fused" and capacity is not None:
    raise ValueError(f"moe: capacity applies to the collective transports (rows per peer); transport='fused' pulls "
                     f"every route and takes none, got capacity={capacity}")
  if capacity is not None:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
      raise TypeError(f"moe: capacity must be an int or None, got {type(capacity).__name__}")
    if capacity < 1:
      raise ValueError(f"moe: capacity must be >= 1 (rows per peer), got {capacity}")


def local_experts(w: ExpertWeights, *, shared: bool) -> ExpertWeights:
  """``w`` relabelled with its actual leading dimension L as ``num_experts`` (optionally without the shared expert).

  Inside `shard_map` or a partitioned body the arrays hold L = E/R experts whatever the static ``num_experts`` says.
  """
  return ExpertWeights(w.w13, w.w13_scale, w.w2, w.w2_scale, w.shared if shared else None, int(w.w13.shape[0]),
                       w.hidden, w.intermediate)


def _nan_where(bad_token: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.where(bad_token[:, None], jnp.asarray(jnp.nan, y.dtype), y)


def body(x: jax.Array, w_local: ExpertWeights, ids: jax.Array, weights: jax.Array, *, axis_name: str,
         local_fn: LocalFn, clamp: float | None, transport: str, capacity: int | None,
         groups: tuple[tuple[int, ...], ...] | None = None) -> tuple[jax.Array, EPStats]:
  """`moe_shard_map_body_with_stats` without the argument checks (also the partitioned path's per-shard body).

  ``groups``: the mesh's `peer_groups` along ``axis_name``, for ``transport='fused'`` (unused by the others).
  """
  r = jax.lax.axis_size(axis_name)
  num_local = int(w_local.w13.shape[0])
  b, k = ids.shape
  h = x.shape[1]
  weights = weights.astype(jnp.float32)
  if b == 0:  # every rank holds B = 0 tokens (shard_map splits evenly): nothing to send
    zero = jnp.int32(0)
    return jnp.zeros((0, h), jnp.bfloat16), EPStats(zero, zero, zero)
  if r == 1:
    # No peers, no transport: the local op sees every route (capacity cannot overflow).
    bad = ids >= num_local
    y = local_fn(x, local_experts(w_local, shared=True), jnp.where(bad, -1, ids), weights, clamp=clamp)
    n_bad = jnp.sum(bad, dtype=jnp.int32)
    return _nan_where(bad.any(axis=1), y), EPStats(jnp.int32(0), n_bad, jnp.sum(ids >= 0, dtype=jnp.int32) - n_bad)
  if transport == "fused":
    return fused_body(x, w_local, ids, weights, axis_name=axis_name, ranks=r, clamp=clamp, groups=groups)

  c = b * k if capacity is None else min(int(capacity), b * k)  # b k rows per peer can never overflow
  lay = tr.layout(ids, num_local, r, c)
  send = tr.send_buffer(x, ids, weights, lay, num_local, r, c)
  if transport == "ragged":
    recv_sizes = jax.lax.all_to_all(lay.send_sizes, axis_name, 0, 0, tiled=True)
  else:
    recv_sizes = lay.send_sizes  # unused by all_to_all
  recv = tr.exchange(send, axis_name=axis_name, num_ranks=r, capacity=c, transport=transport,
                     send_sizes=lay.send_sizes, recv_sizes=recv_sizes, fill=tr.empty_rows(r * c, h))
  x_rows, local_ids, row_weights = tr.unpack(recv, h)
  # One route per row (k = 1): local_fn returns each route's BF16 o_j unsummed, so the owner can sum the k slots
  # in slot order exactly as DESIGN §2 step 6 does. The shared expert is not applied here (the owner does it).
  out = local_fn(x_rows, local_experts(w_local, shared=False), local_ids[:, None], row_weights[:, None], clamp=clamp)
  out_bits = jax.lax.bitcast_convert_type(out.astype(jnp.bfloat16), jnp.uint16)
  back = tr.exchange(out_bits, axis_name=axis_name, num_ranks=r, capacity=c, transport=transport,
                     send_sizes=recv_sizes, recv_sizes=lay.send_sizes, fill=jnp.zeros_like(out_bits))
  o = jnp.take(jax.lax.bitcast_convert_type(back, jnp.bfloat16), lay.slot, axis=0, mode="fill", fill_value=0)
  o = jnp.where(lay.sent[:, None], o.astype(jnp.float32), 0.0).reshape(b, k, h)
  acc = jnp.zeros((b, h), jnp.float32)
  for j in range(k):  # DESIGN §2 step 6: acc = 0; acc += o_j for j = 0..k-1; acc += shared; one BF16 rounding
    acc = acc + o[:, j]
  if w_local.shared is not None:
    # The shared expert is replicated, so the token owner computes it: local_fn with no routes returns
    # bf16(0 + shared_y), which is shared_y except that -0 becomes +0; acc + v then differs only if acc is -0,
    # which a sum starting at +0 never is (short of a flushed subnormal). The same holds for the routed o_j above.
    none = jnp.full((b, 1), -1, jnp.int32)
    shared_y = local_fn(x, local_experts(w_local, shared=True), none, jnp.zeros((b, 1), jnp.float32), clamp=clamp)
    acc = acc + shared_y.astype(jnp.float32)
  y = acc.astype(jnp.bfloat16)
  poisoned = (lay.overflow | lay.invalid).reshape(b, k).any(axis=1)
  stats = EPStats(jax.lax.psum(jnp.sum(lay.overflow, dtype=jnp.int32), axis_name),
                  jax.lax.psum(jnp.sum(lay.invalid, dtype=jnp.int32), axis_name),
                  jax.lax.pmax(jnp.max(lay.peer_load).astype(jnp.int32), axis_name))
  return _nan_where(poisoned, y), stats


# -----------------------------------------------------------------------------------------------------------------
# The fused transport (docs/fused_transport.md): the per-shard call and where its peer groups come from
# -----------------------------------------------------------------------------------------------------------------


def peer_groups(mesh: jax.sharding.Mesh, axis: str) -> tuple[tuple[int, ...], ...]:
  """The fused transport's peer groups of ``mesh`` along ``axis``: for every position on the other axes, the
  devices along ``axis`` in rank order, this process's as their CUDA ordinal (``local_hardware_id``: peer access
  connects them) and another process's as -(1 + its process index) (CUDA IPC handles connect those,
  `ffi._cuda.connect_processes`).

  Raises:
    NotImplementedError: a group that holds devices of other processes and more than one of this process's, or
      two of one other process (one group connected by both peer access and IPC is not built: make the EP axis
      one device per process, or keep it within a process).
  """
  names = list(mesh.axis_names)
  devices = np.moveaxis(np.asarray(mesh.devices), names.index(axis), -1)
  groups = devices.reshape(-1, devices.shape[-1])
  this = jax.process_index()
  out = []
  for g in groups:
    procs = [int(d.process_index) for d in g]
    others = [p for p in procs if p != this]
    if others and (len(procs) - len(others) > 1 or len(set(others)) < len(others)):
      raise NotImplementedError(f"moe: transport='fused' connects the devices of a peer group either within one "
                                f"process (peer access) or one device per process (CUDA IPC); mesh axis {axis!r} "
                                f"has a group on processes {procs}; use one device per process along {axis!r}, or "
                                f"transport='collective'")
    out.append(tuple(int(d.local_hardware_id) if p == this else -1 - p for d, p in zip(g, procs)))
  return tuple(out)


def _fused_stats(ids: jax.Array, num_experts: int, num_local: int, ranks: int, axis: str) -> EPStats:
  """The fused transport's `EPStats`: nothing overflows (every route is pulled), invalid ids, and the most routes
  one rank sends one peer (the collective transports' smallest overflow-free capacity, for comparison)."""
  valid = (ids >= 0) & (ids < num_experts)
  dest = jnp.where(valid, ids // num_local, ranks)
  load = jnp.zeros((ranks + 1,), jnp.int32).at[dest.reshape(-1)].add(1)[:ranks].max()
  invalid = jax.lax.psum(jnp.sum(ids >= num_experts, dtype=jnp.int32), axis)
  return EPStats(jnp.int32(0), invalid, jax.lax.pmax(load, axis))


def fused_body(x: jax.Array, w_local: ExpertWeights, ids: jax.Array, weights: jax.Array, *, axis_name: str,
               ranks: int, clamp: float | None, groups: tuple[tuple[int, ...], ...]) -> tuple[jax.Array, EPStats]:
  """One rank's fused-transport program (both entry points): ONE `ffi.moe_fused_call` over its B tokens and L
  experts, given every rank's device; ids >= E = L R become padding there and their tokens NaN (a traced id cannot
  raise), counted in `EPStats.invalid`."""
  num_local = int(w_local.w13.shape[0])
  num_experts = num_local * ranks
  bad = ids >= num_experts
  # The variant is keyed by the L local experts, whatever the static num_experts of w_local says.
  y = ffi.moe_fused_call(x, local_experts(w_local, shared=True), jnp.where(bad, -1, ids), weights, clamp=clamp,
                         peer_groups=groups, exchange=_peers.exchange)
  return _nan_where(bad.any(axis=1), y), _fused_stats(ids, num_experts, num_local, ranks, axis_name)


def _check_mesh(mesh: Any, axis_name: str) -> None:
  """``mesh`` is a concrete mesh with ``axis_name``, shaped like the mesh of the `shard_map` the body traces in."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"moe: mesh must be a jax.sharding.Mesh (with devices: the mesh shard_map runs over) or None, "
                    f"got {type(mesh).__name__}")
  shape = dict(mesh.shape)
  if axis_name not in shape:
    raise ValueError(f"moe: mesh must have the axis axis_name={axis_name!r}, got a mesh with axes "
                     f"{tuple(mesh.axis_names)}")
  ranks = jax.lax.axis_size(axis_name)
  if isinstance(ranks, (int, np.integer)) and int(ranks) != shape[axis_name]:
    raise ValueError(f"moe: mesh axis {axis_name!r} must have the size of the shard_map axis {axis_name!r} "
                     f"(R = {int(ranks)}), got {shape[axis_name]} in mesh {shape}; pass the mesh shard_map runs over")
  # The peer groups cover every position on the other axes, so those must match too (else some ranks' devices are
  # missing from the groups). Inside shard_map the abstract mesh is its mesh; devices cannot be compared here.
  body_mesh = jax.sharding.get_abstract_mesh()
  if not body_mesh.empty and tuple(body_mesh.shape.items()) != tuple(mesh.shape.items()):
    raise ValueError(f"moe: mesh must be the mesh shard_map runs over, of shape {dict(body_mesh.shape)}, got "
                     f"{shape}")


def _fused_groups(mesh: jax.sharding.Mesh | None, axis_name: str) -> tuple[tuple[int, ...], ...]:
  """The peer groups of a `shard_map` body's fused transport: from ``mesh`` (already checked), else from the
  concrete mesh set around the trace; empty when the axis has one rank (no transport runs)."""
  if mesh is None:
    mesh = _compat.ambient_concrete_mesh()
    if mesh is None:
      # jax.shard_map(..., mesh=m) gives its body only the abstract mesh, which has no devices.
      raise ValueError(f"moe: transport='fused' inside shard_map needs the concrete mesh, whose devices give the "
                       f"kernels their peers: pass mesh=<the jax.sharding.Mesh shard_map runs over> or trace under "
                       f"jax.set_mesh(mesh), got mesh=None and no mesh set (axis_name={axis_name!r})")
    _check_mesh(mesh, axis_name)  # the ambient mesh need not be the one shard_map runs over
  return peer_groups(mesh, axis_name) if dict(mesh.shape)[axis_name] > 1 else ()


def _check_body_args(x, w_local, ids, weights, axis_name, local_fn, transport, capacity, mesh) -> None:
  check_common(x, w_local, ids, weights, local_fn, transport, capacity)
  if not isinstance(axis_name, str):
    raise TypeError(f"moe: axis_name must be a str (one mesh axis), got {type(axis_name).__name__}")
  if mesh is not None:  # checked whatever the transport; only the fused one uses it
    _check_mesh(mesh, axis_name)


def moe_shard_map_body(x: jax.Array, w_local: ExpertWeights, ids: jax.Array, weights: jax.Array, *,
                       axis_name: str, local_fn: LocalFn, clamp: float | None = None,
                       transport: str = "collective", capacity: int | None = None,
                       mesh: jax.sharding.Mesh | None = None) -> jax.Array:
  """Expert-parallel MoE for one rank; call it inside `jax.shard_map` over the mesh axis ``axis_name``.

  The axis has R ranks. Rank r holds B tokens and the L = E/R experts ``r L .. r L + L - 1``: global expert id g
  lives on rank ``g // L`` as local expert ``g % L``. Each route travels to its expert's rank with its activations
  and route weight, the local op runs there one route per row, the BF16 output rows travel back, and the token's
  owner sums its k slots in slot order in FP32, adds the shared expert (replicated, so computed by the owner) and
  rounds once to BF16: the result equals the single-device `moe_emulated` bit for bit.

  Args:
    x: bfloat16 ``[B, H]``: this rank's tokens.
    w_local: this rank's L experts (arrays with leading dimension L; the shared expert, if any, replicated).
    ids: int32 ``[B, k]`` GLOBAL expert ids in ``[0, E)``, E = L R; ids < 0 are padding. Ids >= E poison their
      token with NaN (a traced value cannot raise).
    weights: float32 ``[B, k]`` route weights.
    axis_name: the `shard_map` mesh axis the experts are split over (e.g. ``"ep"``).
    local_fn: the per-rank grouped op ``(x_rows [M, H] bf16, w [L experts], local_ids [M, k'] int32 (-1 =
      padding), weights [M, k'] f32, *, clamp) -> [M, H] bf16`` computing DESIGN §2 on local experts, e.g.
      `gcmoe_jax.reference.moe_emulated`.
    clamp: the SwiGLU clamp, or None.
    transport: ``"collective"`` (`jax.lax.all_to_all`, runs everywhere), ``"ragged"``
      (`jax.lax.ragged_all_to_all`, GPU only: XLA:CPU does not implement it) or ``"fused"`` (the CUDA kernels' peer
      exchange, docs/fused_transport.md: ONE `ffi.moe_fused_call` per rank, one process driving its GPUs; needs the
      concrete mesh, see ``mesh``; ``local_fn`` then runs only when R = 1). Fused inside shard_map is CPU-tested
      (lowering, peer groups, errors) and has never run on several GPUs.
    capacity: rows each rank may send to each peer; default (None) ``B k``, which can never overflow. Routes past
      the capacity are not computed: their tokens come back NaN and `moe_shard_map_body_with_stats` counts them.
      Ignored when R = 1 (no transport); an error with ``"fused"`` (every route is pulled).
    mesh: the concrete `jax.sharding.Mesh` the `shard_map` runs over (same axes, sizes and device order), from
      which ``"fused"`` takes its peer groups: for each position on the other axes, the CUDA ordinals of the
      devices along ``axis_name`` in rank order. Default: the mesh set with `jax.set_mesh` (or the deprecated
      ``with mesh:``) around the trace; ``jax.shard_map(..., mesh=m)`` alone gives the body no devices. Checked
      when given, whatever the transport; only ``"fused"`` uses it.

  Returns:
    bfloat16 ``[B, H]``: this rank's outputs.

  Raises:
    TypeError, ValueError: for arguments of the wrong type, rank, dtype or shape (at trace time); ValueError for
      ``"fused"`` without a mesh, or a mesh without ``axis_name``, of another axis size or shape than the body's.
    NotImplementedError: ``"fused"`` over a peer group that holds devices of other processes and more than one of
      this process's (`peer_groups`).
  """
  return moe_shard_map_body_with_stats(x, w_local, ids, weights, axis_name=axis_name, local_fn=local_fn, clamp=clamp,
                                       transport=transport, capacity=capacity, mesh=mesh)[0]


def moe_shard_map_body_with_stats(x: jax.Array, w_local: ExpertWeights, ids: jax.Array, weights: jax.Array, *,
                                  axis_name: str, local_fn: LocalFn, clamp: float | None = None,
                                  transport: str = "collective", capacity: int | None = None,
                                  mesh: jax.sharding.Mesh | None = None) -> tuple[jax.Array, EPStats]:
  """`moe_shard_map_body` that also returns the transport's `EPStats` (overflow, invalid ids, peak load).

  Returns:
    ``(y, stats)``: y bfloat16 ``[B, H]``; stats int32 scalars, equal on every rank (use ``out_specs=P()``).
  """
  _check_body_args(x, w_local, ids, weights, axis_name, local_fn, transport, capacity, mesh)
  groups = _fused_groups(mesh, axis_name) if transport == "fused" else None
  return body(x, w_local, ids, weights, axis_name=axis_name, local_fn=local_fn, clamp=clamp, transport=transport,
              capacity=capacity, groups=groups)
