"""The ``gcmoe_moe_v1`` custom call: attributes, the one `jax.ffi.ffi_call` path, and its transformation rules.

* **Lowering.** One target name for every platform; XLA picks the handler registered for the platform it compiles
  for (``cpu``: ``GcmoeMoeCpu``; ``CUDA``: ``GcmoeMoeCudaInstantiate`` + ``GcmoeMoeCudaExecute``).
* **vmap.** ``vmap_method="sequential"``: a batched call becomes a loop (``lax.map``) of unbatched calls, one per
  batch element, so any mix of batched operands (tokens, routes, even weights) is computed exactly as the unbatched
  op would. Callers that batch only tokens get the same numbers faster by folding the batch into T themselves.
* **Differentiation.** The op is forward-only (a decode operator over quantized weights): `jax.grad`, `jax.jvp`,
  `jax.vjp` and `jax.linearize` raise `TypeError` with `FORWARD_ONLY`, via a `jax.custom_jvp` whose rule raises.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import _compat, _config
from gcmoe_jax.ffi import _cuda, _library
from gcmoe_jax.formats import ExpertWeights

FORWARD_ONLY = ("gcmoe_jax.moe is forward-only: it has no JVP or VJP (a decode operator over quantized weights); "
                "differentiate the dense model (reference.moe_bf16) instead, or wrap the call in jax.lax.stop_gradient")


class Flag(enum.IntFlag):
  """Bits of the ``flags`` attribute (C++ ``gcmoe::MoeFlags`` in csrc/moe.h)."""

  HAS_SHARED = 1
  HAS_CLAMP = 2
  SYNC_CHECK = 4


@dataclasses.dataclass(frozen=True)
class MoeAttrs:
  """The static attributes of one call (baked into the HLO; hashable, so usable as a static argument).

  Attributes:
    hidden, intermediate, num_experts, top_k: H, I, E and k.
    shared_intermediate, shared_group: Is and the shared K-group (32 or 128), both 0 without a shared expert.
    clamp: the SwiGLU clamp, or None.
  """

  hidden: int
  intermediate: int
  num_experts: int
  top_k: int
  shared_intermediate: int = 0
  shared_group: int = 0
  clamp: float | None = None
  variant: str = ""  # the CUDA kernel variant key (`_cuda.prepare`); "" on CPU
  sync_check: bool = False  # CUDA: synchronise and report device faults at once (GCMOE_SYNC_CHECK)

  @classmethod
  def from_weights(cls, w: ExpertWeights, top_k: int, clamp: float | None, **kw) -> MoeAttrs:
    e, h, i, i_s, group = w.config
    return cls(h, i, e, int(top_k), i_s or 0, group or 0, None if clamp is None else float(clamp), **kw)

  @property
  def flags(self) -> Flag:
    f = Flag(0)
    if self.shared_intermediate:
      f |= Flag.HAS_SHARED
    if self.clamp is not None:
      f |= Flag.HAS_CLAMP
    if self.sync_check:
      f |= Flag.SYNC_CHECK
    return f

  def ffi_attributes(self) -> dict[str, np.generic]:
    """Typed attributes as the handlers bind them (``int64`` and ``float32`` numpy scalars, never Python numbers)."""
    return {
      "H": np.int64(self.hidden),
      "I": np.int64(self.intermediate),
      "E": np.int64(self.num_experts),
      "k": np.int64(self.top_k),
      "Is": np.int64(self.shared_intermediate),
      "group": np.int64(self.shared_group),
      # float32, as the reference holds the clamp before its bf16 rounding (jnp.asarray(clamp) is float32).
      "clamp": np.float32(0.0 if self.clamp is None else self.clamp),
      "flags": np.int64(int(self.flags)),
      "variant": self.variant,
    }


def _ffi_call(attrs: MoeAttrs, x, *operands):
  # GCMOE_SYNC_CHECK: a target whose CUDA handler XLA keeps out of command buffers (`_library.TARGET_SYNC`).
  target = _library.TARGET_SYNC if attrs.sync_check else _library.TARGET
  call = jax.ffi.ffi_call(target, _compat.ffi_result_like(x), vmap_method="sequential")
  return call(x, *operands, **attrs.ffi_attributes())


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _moe_forward_only(attrs: MoeAttrs, *operands):
  return _ffi_call(attrs, *operands)


@_moe_forward_only.defjvp
def _moe_jvp(attrs, primals, tangents):
  del attrs, primals, tangents
  raise TypeError(FORWARD_ONLY)


def _require_library(target: str = _library.TARGET) -> None:
  info = _library.library_info()
  if info.error is not None:
    raise RuntimeError(f"gcmoe_jax FFI: {info.error}")
  if target not in info.build.get("targets", {}):
    # A library built from older sources (XLA would only say the target has no implementation).
    why = " (GCMOE_SYNC_CHECK=1 lowers to it)" if target == _library.TARGET_SYNC else ""
    raise RuntimeError(f"gcmoe_jax FFI: {info.path} does not declare the target {target}{why}; it was built from "
                       "older sources: rebuild it (pip install . or cmake --build build/dev)")


def moe_ffi(x: jax.Array, w13: jax.Array, w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, ids: jax.Array,
            weights: jax.Array, s13: jax.Array, s13_scale: jax.Array, s2: jax.Array, s2_scale: jax.Array, *,
            attrs: MoeAttrs) -> jax.Array:
  """The raw custom call over Table 10 buffers: no Python checks (the handler checks every buffer and id).

  For tests and for callers that hold the packed buffers themselves; `moe_call` is the checked entry.

  Args:
    x: bfloat16 ``[T, H]``.
    w13, w13_scale, w2, w2_scale: routed payloads and scales (`ExpertWeights` fields).
    ids: int32 ``[T, k]``; weights: float32 ``[T, k]``.
    s13, s13_scale, s2, s2_scale: the shared expert (`SharedWeights` fields), or empty placeholders
      (`no_shared_operands`) when ``attrs.shared_intermediate == 0``.
    attrs: the static attributes.

  Returns:
    bfloat16 ``[T, H]``.

  Raises:
    RuntimeError: when the library is not loaded, or lacks the target ``attrs`` lower to. Errors of the handler (a
      bad shape, an id >= E) surface when the call runs, as the runtime error of jax, with the handler's message.
  """
  _require_library(_library.TARGET_SYNC if attrs.sync_check else _library.TARGET)
  return _moe_forward_only(attrs, x, w13, w13_scale, w2, w2_scale, ids, weights, s13, s13_scale, s2, s2_scale)


def no_shared_operands() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The empty ``(s13, s13_scale, s2, s2_scale)`` placeholders of a call without a shared expert."""
  return (jnp.zeros((0, 0, 0), jnp.int8), jnp.zeros((0, 0), jnp.int32), jnp.zeros((0, 0, 0), jnp.int8),
          jnp.zeros((0, 0), jnp.int32))


def moe_call(x: jax.Array, w: ExpertWeights, ids: jax.Array, weights: jax.Array, *,
             clamp: float | None, backend: str = "cpu") -> jax.Array:
  """The operator through the FFI handler of the platform it is compiled for (arguments checked by `gcmoe_jax.moe`).

  Args:
    x: bfloat16 ``[T, H]``.
    w: `ExpertWeights`.
    ids: int32 ``[T, k]`` (ids < 0: padding; ids >= E: the handler returns an error naming the id, token and slot).
    weights: float32 ``[T, k]``.
    clamp: the SwiGLU clamp, or None.

  Returns:
    bfloat16 ``[T, H]``, bit-identical to `reference.moe_emulated` on the CPU handler.
  """
  _check_clamp(clamp)
  kw = {}
  if backend == "cuda" and x.shape[0] == 0:
    return jnp.zeros((0, w.hidden), jnp.bfloat16)  # nothing to launch (the CPU handler takes T = 0 itself)
  if backend == "cuda" and x.shape[0] > _cuda.CAPACITIES[-1]:
    call = functools.partial(moe_call, w=w, clamp=clamp, backend=backend)
    return in_chunks(lambda x, ids, weights: call(x, ids=ids, weights=weights), x, ids, weights,
                     _cuda.CAPACITIES[-1])
  if backend == "cuda":
    e, h, i, i_s, group = w.config
    kw = {"variant": _cuda.prepare(h, i, e, int(ids.shape[1]), int(x.shape[0]), i_s or 0, group or 0),
          "sync_check": bool(_config.get("GCMOE_SYNC_CHECK"))}
  return _moe_on(x, w, ids, weights, MoeAttrs.from_weights(w, ids.shape[1], clamp, **kw))


def _check_clamp(clamp: float | None) -> None:
  if clamp is not None and not math.isfinite(clamp):
    raise ValueError(f"moe: clamp must be finite, got {clamp}")


def _moe_on(x: jax.Array, w: ExpertWeights, ids: jax.Array, weights: jax.Array, attrs: MoeAttrs) -> jax.Array:
  """`moe_ffi` over the buffers of ``w`` (placeholders for an absent shared expert)."""
  s = w.shared
  shared = no_shared_operands() if s is None else (s.s13, s.s13_scale, s.s2, s.s2_scale)
  return moe_ffi(x, w.w13, w.w13_scale, w.w2, w.w2_scale, ids, weights, *shared, attrs=attrs)


def moe_fused_call(x: jax.Array, w_local: ExpertWeights, ids: jax.Array, weights: jax.Array, *,
                   clamp: float | None, peer_groups: tuple[tuple[int, ...], ...],
                   exchange: _cuda.Exchange | None = None) -> jax.Array:
  """One rank's call of the fused transport (docs/fused_transport.md).

  Called per shard (``ep_axis`` under `jax.jit`): ``x`` and the routes are this rank's B tokens, ``w_local`` its L
  experts, ``ids`` global (rank p holds experts p L .. p L + L - 1). The rank is where the call runs: the handler
  finds its device in ``peer_groups`` (every group of R ranks in rank order: this process's devices as CUDA
  ordinals, another process's as -(1 + its process index), reached through CUDA IPC handles that ``exchange``
  trades at trace time, `_cuda.connect_processes`). Every rank's graph pulls its experts' rows from its peers'
  workspaces and returns GEMM2 rows to their owners in the kernels.

  Raises:
    ValueError: for B above the largest token capacity (the fused transport does not run in chunks).
  """
  _check_clamp(clamp)
  b = x.shape[0]
  if b > _cuda.CAPACITIES[-1]:
    raise ValueError(f"moe: transport='fused' runs at most {_cuda.CAPACITIES[-1]} tokens per rank and call, got "
                     f"B = {b}; split the batch or use transport='collective'")
  e, h, i, i_s, group = w_local.config
  variant = _cuda.prepare(h, i, e, int(ids.shape[1]), max(int(b), 1), i_s or 0, group or 0, peer_groups, exchange)
  attrs = MoeAttrs.from_weights(w_local, ids.shape[1], clamp, variant=variant,
                                sync_check=bool(_config.get("GCMOE_SYNC_CHECK")))
  return _moe_on(x, w_local, ids, weights, attrs)


def in_chunks(call, x: jax.Array, ids: jax.Array, weights: jax.Array, rows: int) -> jax.Array:
  """``call(x, ids, weights)`` over chunks of at most ``rows`` tokens (a `jax.lax.map`, one call site).

  The op is per token (each token's result depends on its own row, routes and the weights only), so the result is
  the unchunked one bit for bit. With one route per token (k = 1: the expert-parallel local op, whose rows are
  single routes) the tokens are first sorted by expert, stably, so each chunk's rows fall on a contiguous range of
  experts and the weights are streamed about once in all; with k > 1 each chunk streams the experts its tokens hit.
  The last chunk is filled with padding tokens (id -1), so every chunk runs the same kernel variant. A handler error
  that names a token names its row within its chunk.
  """
  t, k = ids.shape
  n = -(-t // rows)
  order = None
  if k == 1:
    order = jnp.argsort(jnp.where(ids[:, 0] < 0, jnp.iinfo(jnp.int32).max, ids[:, 0]), stable=True)
    x, ids, weights = x[order], ids[order], weights[order]
  pad = ((0, n * rows - t), (0, 0))
  chunks = (jnp.pad(x, pad).reshape(n, rows, x.shape[1]),
            jnp.pad(ids, pad, constant_values=-1).reshape(n, rows, k),
            jnp.pad(weights, pad).reshape(n, rows, k))
  y = jax.lax.map(lambda c: call(*c), chunks).reshape(n * rows, -1)[:t]
  return y if order is None else jnp.empty_like(y).at[order].set(y, unique_indices=True)
