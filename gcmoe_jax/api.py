"""The public operator: `moe`, `Routes`, backend choice and argument checking."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import ffi, reference, sharding
from gcmoe_jax._checks import check_activations
from gcmoe_jax._support import Support
from gcmoe_jax.formats import ExpertWeights

__all__ = ["BACKENDS", "Explanation", "MAX_TOP_K", "Routes", "Support", "explain", "moe"]

log = logging.getLogger("gcmoe_jax")

BACKENDS = ("auto", "cuda", "cpu", "reference")
MAX_TOP_K = 32  # Table 10: 1 <= k <= min(32, E)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Routes:
  """Top-k routing of T tokens.

  Attributes:
    ids: int32 ``[T, k]`` expert ids; ids < 0 are padding (the slot is dropped), ids >= E are an error.
    weights: float32 ``[T, k]`` route weights (any float dtype of at most 32 bits is converted to float32).
  """

  ids: jax.Array
  weights: jax.Array

  def tree_flatten(self):
    return (self.ids, self.weights), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)

  @property
  def top_k(self) -> int:
    return int(self.ids.shape[-1])


@dataclasses.dataclass(frozen=True)
class Explanation:
  """Which backend `moe` runs for given arguments, and why each other backend was or was not chosen."""

  backend: str | None  # None: the requested backend cannot run here (`reasons` says why)
  requested: str
  reasons: tuple[tuple[str, Support], ...]

  def __str__(self) -> str:
    head = (f"backend={self.backend!r}" if self.backend else f"backend {self.requested!r} cannot run here")
    lines = [f"gcmoe_jax.moe: {head} (requested {self.requested!r})"]
    for name, s in self.reasons:
      mark = "chosen" if name == self.backend else ("available" if s.ok else "unavailable")
      lines.append(f"  {name:<9} {mark:<11} {s.reason}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------------------------------------------
# Argument checking (trace time)
# -----------------------------------------------------------------------------------------------------------------


def _check_args(x: Any, w: Any, routes: Any, clamp: Any, backend: Any) -> None:
  """Checks shapes, dtypes and Table 10 constraints; raises TypeError (types, ranks) or ValueError (values)."""
  if not isinstance(w, ExpertWeights):
    raise TypeError(f"moe: w must be gcmoe_jax.ExpertWeights (from quantize_experts or from_mxfp4), got "
                    f"{type(w).__name__}")
  if not isinstance(routes, Routes):
    raise TypeError(f"moe: routes must be gcmoe_jax.Routes(ids, weights), got {type(routes).__name__}")
  if backend not in BACKENDS:
    raise ValueError(f"moe: backend must be one of {BACKENDS}, got {backend!r}")
  check_activations(x, w.hidden)
  t = x.shape[0]
  ids, rw = routes.ids, routes.weights
  for name, a in (("routes.ids", ids), ("routes.weights", rw)):
    if not hasattr(a, "shape") or a.ndim != 2:
      raise TypeError(f"moe: {name} must be rank 2 [T, k], got shape {list(getattr(a, 'shape', ()))}")
  if ids.dtype != jnp.int32:
    raise TypeError(f"moe: routes.ids must have dtype int32, got {ids.dtype}")
  if not jnp.issubdtype(rw.dtype, jnp.floating) or jnp.dtype(rw.dtype).itemsize > 4:
    raise TypeError(f"moe: routes.weights must be float32 (or bfloat16/float16), got {rw.dtype}")
  if ids.shape != rw.shape:
    raise ValueError(f"moe: routes.ids and routes.weights must have the same shape [T, k], got "
                     f"{list(ids.shape)} and {list(rw.shape)}")
  if ids.shape[0] != t:
    raise ValueError(f"moe: routes must have T = x.shape[0] = {t} rows, got {ids.shape[0]}")
  k, e = ids.shape[1], w.num_experts
  if not 1 <= k <= min(MAX_TOP_K, e):
    raise ValueError(f"moe: top-k (routes.ids.shape[1]) must be in [1, min(32, E)] = [1, {min(MAX_TOP_K, e)}] "
                     f"(Table 10), got {k}")
  if clamp is not None:
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float, np.floating, np.integer)):
      raise TypeError(f"moe: clamp must be a Python float or None, got {type(clamp).__name__}")
    if not math.isfinite(clamp) or clamp <= 0:
      raise ValueError(f"moe: clamp must be a finite positive number or None, got {clamp}")
  if not isinstance(ids, jax.core.Tracer):
    _check_ids_concrete(np.asarray(ids), e)


def _check_ids_concrete(ids: np.ndarray, e: int) -> None:
  bad = ids >= e
  if bad.any():
    t, j = (int(v) for v in np.argwhere(bad)[0])
    raise ValueError(f"moe: routes.ids must be < E = {e} (ids < 0 are padding), got id {int(ids[t, j])} at "
                     f"token {t}, slot {j} ({int(bad.sum())} such id(s))")


# -----------------------------------------------------------------------------------------------------------------
# Backend choice
# -----------------------------------------------------------------------------------------------------------------


def _support(name: str, platform: str) -> Support:
  if name == "reference":
    return Support(True, "pure jax.numpy emulation of DESIGN §2 (always available; the oracle, not fast)")
  if name == "cpu":
    if platform != "cpu":
      return Support(False, f"the C++ CPU handler runs on CPU devices, and the default device is {platform}")
    return ffi.platform_support("cpu")
  if platform != "gpu":
    return Support(False, f"needs a CUDA GPU, and the default device is {platform}")
  for probe in (ffi.device_arch, ffi.kernels_support):
    s = probe()
    if not s.ok:
      return s
  return ffi.platform_support("cuda")


def backend_support() -> dict[str, Support]:
  """Each backend's `Support` on the default device, probed now (uncached; `explain` caches its answer)."""
  platform = jax.default_backend()
  return {name: _support(name, platform) for name in ("cuda", "cpu", "reference")}


@functools.lru_cache(maxsize=None)
def _choose(requested: str, platform: str) -> Explanation:
  order = ("cuda", "cpu", "reference")
  reasons = tuple((name, _support(name, platform)) for name in order)
  if requested == "auto":
    backend = next(name for name, s in reasons if s.ok)
  else:
    backend = requested if dict(reasons)[requested].ok else None
  result = Explanation(backend, requested, reasons)
  log.info("%s", result)
  return result


def explain(backend: str = "auto") -> Explanation:
  """Returns which backend `moe(..., backend=backend)` runs on the default device, with the reason for each.

  Never raises for an unavailable backend: ``Explanation.backend`` is then None and the reasons say why.
  """
  if backend not in BACKENDS:
    raise ValueError(f"explain: backend must be one of {BACKENDS}, got {backend!r}")
  return _choose(backend, jax.default_backend())


# -----------------------------------------------------------------------------------------------------------------
# The operator
# -----------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("clamp",))
def _reference_jit(x, w, ids, weights, clamp):
  # Ids >= E were rejected eagerly when concrete; traced ones poison their token with NaN rather than being
  # dropped silently (docs/reliability.md).
  bad = jnp.any(ids >= w.num_experts, axis=1, keepdims=True)
  y = reference.moe_emulated(x, w, jnp.where(ids >= w.num_experts, -1, ids), weights, clamp=clamp)
  return jnp.where(bad, jnp.asarray(jnp.nan, y.dtype), y)


def _local_reference(x, w, ids, weights, *, clamp):
  return reference.moe_emulated(x, w, ids, weights, clamp=clamp)


def _local_cpu(x, w, ids, weights, *, clamp):
  return ffi.moe_call(x, w, ids, weights, clamp=clamp, backend="cpu")


def _local_cuda(x, w, ids, weights, *, clamp):
  return ffi.moe_call(x, w, ids, weights, clamp=clamp, backend="cuda")


# The per-rank grouped op of each backend for expert parallelism (module-level: they are static arguments).
_LOCAL_FNS = {"reference": _local_reference, "cpu": _local_cpu, "cuda": _local_cuda}


def moe(x: jax.Array, w: ExpertWeights, routes: Routes, *, clamp: float | None = None,
        backend: str = "auto", axis_name: str | None = None, ep_axis: str | None = None,
        transport: str = "collective", capacity: int | None = None,
        mesh: jax.sharding.Mesh | None = None) -> jax.Array:
  """The GC-MoE operator: routed MXFP4 experts (and the optional shared expert) applied to FP8 activations.

  Computes DESIGN §2 (docs/semantics.md): per token, MXFP8 activations, the gate/up GEMM, clamped SwiGLU, the
  route weight, MXFP8 requantization, the down GEMM, and the FP32 sum of the k returned rows (+ shared expert).

  Args:
    x: bfloat16 ``[T, H]`` activations.
    w: `ExpertWeights` from `quantize_experts` or `from_mxfp4`.
    routes: `Routes` with int32 ids ``[T, k]`` (ids < 0: padding) and float32 weights ``[T, k]``.
    clamp: SwiGLU clamp c (``silu(min(g, c)) * clip(u, -c, c)``), or None for no clamp.
    backend: ``"auto"`` (the fastest available, see `explain`), ``"cuda"``, ``"cpu"`` or ``"reference"``.
    axis_name: inside `jax.shard_map`: the mesh axis the experts (and tokens) are split over; ``x`` and ``routes``
      are this rank's tokens, ``w`` this rank's E/R experts, and ``routes.ids`` global expert ids
      (docs/expert_parallel.md).
    ep_axis: under `jax.jit` on sharded global arrays: the mesh axis of the experts and tokens; XLA partitions
      the op into the per-rank program without gathering x, the routes or the weights.
    transport: expert-parallel transport, ``"collective"`` (all_to_all), ``"ragged"`` (GPU only) or ``"fused"``
      (the in-kernel peer exchange of docs/fused_transport.md: ``backend="cuda"``, one process driving GPUs with
      peer access; with ``ep_axis``, or with ``axis_name`` given the concrete mesh, see ``mesh``). CPU-tested
      (lowering, peer groups, errors); never run on several GPUs.
    capacity: expert-parallel rows per peer (default: no overflow possible); overflow poisons tokens with NaN.
    mesh: with ``axis_name``: the concrete `jax.sharding.Mesh` the `shard_map` runs over (same axes, sizes and
      device order). ``transport="fused"`` takes the kernels' peer groups from its devices; default: the mesh set
      with `jax.set_mesh` (or the deprecated ``with mesh:``) around the trace, since ``jax.shard_map(...,
      mesh=m)`` alone shows its body no devices. Checked when given, whatever the transport.

  Returns:
    bfloat16 ``[T, H]``.

  Raises:
    TypeError, ValueError: for arguments outside Table 10 (at trace time), or expert ids >= E when they are
      concrete; ValueError for ``transport="fused"`` inside shard_map without a mesh, or with one that lacks
      ``axis_name`` or is shaped unlike the shard_map's. RuntimeError: when a named backend cannot run here (the
      reason is in the message). NotImplementedError: ``transport="fused"`` over a peer group with devices of
      other processes and more than one of this process's (one device per process, or all in one process).
  """
  _check_args(x, w, routes, clamp, backend)
  explanation = explain(backend)
  chosen = explanation.backend
  if chosen is None:
    raise RuntimeError(f"moe: backend={backend!r} cannot run here: {dict(explanation.reasons)[backend].reason}")
  ids, weights = routes.ids, routes.weights.astype(jnp.float32)
  clamp = None if clamp is None else float(clamp)
  if axis_name is not None and ep_axis is not None:
    raise ValueError(f"moe: pass axis_name (inside shard_map) or ep_axis (sharded global arrays), not both; got "
                     f"axis_name={axis_name!r}, ep_axis={ep_axis!r}")
  if mesh is not None and axis_name is None:
    # ep_axis takes the mesh from the arrays (the partitioner's), and one device needs none.
    raise ValueError(f"moe: mesh applies with axis_name (inside jax.shard_map), got mesh with axes "
                     f"{tuple(getattr(mesh, 'axis_names', ()))} and axis_name=None (ep_axis={ep_axis!r})")
  if transport == "fused" and chosen != "cuda":
    raise ValueError(f"moe: transport='fused' runs in the CUDA kernels (backend='cuda'), got backend={backend!r} "
                     f"(running {chosen!r}); use transport='collective' there")
  ep = {"local_fn": _LOCAL_FNS[chosen], "clamp": clamp, "transport": transport, "capacity": capacity}
  if axis_name is not None:
    return sharding.moe_shard_map_body(x, w, ids, weights, axis_name=axis_name, mesh=mesh, **ep)
  if ep_axis is not None:
    return sharding.moe_partitioned(x, w, ids, weights, axis=ep_axis, **ep)
  if chosen == "reference":
    return _reference_jit(x, w, ids, weights, clamp)
  return ffi.moe_call(x, w, ids, weights, clamp=clamp, backend=chosen)
