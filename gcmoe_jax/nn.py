"""Flax NNX module: a router, routed MXFP4 experts through `gcmoe_jax.moe`, and an optional shared expert.

    from flax import nnx
    import gcmoe_jax.nn as gnn

    layer = gnn.MoE.from_bf16(router_w, w13, w2, top_k=8, shared=(s13, s2), clamp=10.0)
    y = nnx.jit(lambda m, x: m(x))(layer, x)            # x [T, H] or [B, S, H] bf16 -> same shape bf16

The expert weights are quantized once, when the module is built, and held as an `ExpertWeights` pytree inside a
`QuantizedParam` (an `nnx.Variable` that is not an `nnx.Param`): `nnx.split`, `nnx.merge`, `nnx.state` and
`nnx.jit` carry them like any other state, and an optimizer over `nnx.Param` leaves them alone. The router weights
are an `nnx.Param`, but no gradient reaches them through this layer: `gcmoe_jax.moe` is forward-only (decode), and
`jax.grad` through it raises TypeError; train the dense model (`reference.moe_bf16`) instead.

Expert parallelism: `MoE.shard(mesh, axis)` puts the routed experts' `QuantizedParam` leaves on a `NamedSharding`
over that mesh axis (the shared expert replicated), and `__call__` then passes it to the operator as ``ep_axis``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gcmoe_jax import api, formats, sharding
from gcmoe_jax.formats import ExpertWeights

__all__ = ["SCORES", "MoE", "QuantizedParam", "RouterBias"]

SCORES = ("softmax", "sigmoid")


class QuantizedParam(nnx.Variable):
  """Quantized, non-trainable weights: the value is an `ExpertWeights` pytree (MXFP4 routed, MXFP8 shared)."""


class RouterBias(nnx.Variable):
  """Non-trainable per-expert bias added to the scores for top-k selection only (DeepSeek-V3's
  ``e_score_correction_bias``); float32 ``[E]``."""


def _value(v: nnx.Variable) -> Any:
  # flax 0.12 deprecates `.value` in favour of `get_value()`; older flax (>= 0.10, pyproject) has only `.value`.
  return v.get_value() if hasattr(v, "get_value") else v.value


def _is_int(v: Any) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_config(e: int, top_k: Any, score: Any, norm_topk_prob: Any, routed_scaling_factor: Any, clamp: Any,
                  backend: Any) -> None:
  """Checks the routing and operator options (TypeError for types, ValueError for values)."""
  if not _is_int(top_k):
    raise TypeError(f"MoE: top_k must be an int, got {top_k!r}")
  if not 1 <= top_k <= min(api.MAX_TOP_K, e):
    raise ValueError(f"MoE: top_k must be in [1, min(32, E)] = [1, {min(api.MAX_TOP_K, e)}] (Table 10), got {top_k}")
  if score not in SCORES:
    raise ValueError(f"MoE: score must be one of {SCORES}, got {score!r}")
  if norm_topk_prob is not None and not isinstance(norm_topk_prob, bool):
    raise TypeError(f"MoE: norm_topk_prob must be a bool or None, got {norm_topk_prob!r}")
  if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float, np.floating)):
    raise TypeError(f"MoE: routed_scaling_factor must be a float, got {routed_scaling_factor!r}")
  if not math.isfinite(routed_scaling_factor) or routed_scaling_factor <= 0:
    raise ValueError(f"MoE: routed_scaling_factor must be finite and positive, got {routed_scaling_factor}")
  if clamp is not None:
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float, np.floating, np.integer)):
      raise TypeError(f"MoE: clamp must be a Python float or None, got {type(clamp).__name__}")
    if not math.isfinite(clamp) or clamp <= 0:
      raise ValueError(f"MoE: clamp must be a finite positive number or None, got {clamp}")
  if backend not in api.BACKENDS:
    raise ValueError(f"MoE: backend must be one of {api.BACKENDS}, got {backend!r}")


def _as_router(router_w: Any, h: int, e: int) -> jax.Array:
  if not hasattr(router_w, "shape") or not hasattr(router_w, "dtype"):
    raise TypeError(f"MoE: router_w must be an array [H, E], got {type(router_w).__name__}")
  if not jnp.issubdtype(router_w.dtype, jnp.floating):
    raise TypeError(f"MoE: router_w must be a floating array, got {router_w.dtype}")
  if tuple(router_w.shape) != (h, e):
    raise ValueError(f"MoE: router_w must have shape [H, E] = {[h, e]}, got {list(router_w.shape)}")
  # The router runs in float32 (an upcast from bf16 is exact): top-k on bf16 scores ties far too often.
  return jnp.asarray(router_w, jnp.float32)


class MoE(nnx.Module):
  """A Mixture-of-Experts layer: router, top-k, routed MXFP4 experts and an optional MXFP8 shared expert.

  Routing (float32, from the bf16 activations):

  * ``score="softmax"``: ``p = softmax(x @ router_w)`` over the E experts, the top-k of ``p`` are chosen and their
    ``p`` are the route weights, renormalised to sum 1 when ``norm_topk_prob`` (Mixtral, Qwen-MoE).
  * ``score="sigmoid"`` (DeepSeek-V3): ``s = sigmoid(x @ router_w)``, the top-k of ``s + score_bias`` are chosen
    (the bias steers selection only), their ``s`` are the route weights, normalised to sum 1 when
    ``norm_topk_prob`` (the default for sigmoid).

  Both multiply the route weights by ``routed_scaling_factor``. The experts then run through `gcmoe_jax.moe` with the
  layer's ``clamp`` and ``backend``; the shared expert (if any) is added inside the operator.

  Build one with `MoE.from_bf16` (quantizes BF16/F32 weights once), `MoE.from_mxfp4` (repacks an MXFP4 checkpoint),
  `MoE.from_quantized`, or the constructor (random init, then quantized).

  Attributes:
    router_w: `nnx.Param`, float32 ``[H, E]``.
    experts: `QuantizedParam` holding the `ExpertWeights`.
    score_bias: `RouterBias` float32 ``[E]``, or None.
    top_k, score, norm_topk_prob, routed_scaling_factor, clamp, backend: static options (see `__init__`).
  """

  def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, *, rngs: nnx.Rngs | None = None,
               shared_intermediate: int | None = None, shared_group: int = 128, score: str = "softmax",
               norm_topk_prob: bool | None = None, routed_scaling_factor: float = 1.0, clamp: float | None = None,
               backend: str = "auto", router_w: jax.Array | None = None, weights: ExpertWeights | None = None,
               score_bias: jax.Array | None = None):
    """A layer with random weights (``rngs``), or with given ``router_w`` and quantized ``weights``.

    Args:
      hidden: H, a multiple of 128 in [512, 8192].
      intermediate: I of a routed expert, a multiple of 128 in [256, 4096].
      experts: E, the routed experts.
      top_k: k, in [1, min(32, E)].
      rngs: `nnx.Rngs` for random init (router ~ N(0, 1/H), w13 ~ N(0, 1/H), w2 ~ N(0, 1/I)); required unless
        ``weights`` is given, ignored otherwise.
      shared_intermediate: Is of the shared expert for random init, or None for no shared expert.
      shared_group: K-group of the shared expert's MXFP8 scales for random init, 32 or 128.
      score: ``"softmax"`` or ``"sigmoid"`` (see the class doc).
      norm_topk_prob: renormalise the k route weights to sum 1; None means False for softmax, True for sigmoid.
      routed_scaling_factor: multiplies the route weights (DeepSeek-V3's 2.5, for instance); default 1.
      clamp: SwiGLU clamp passed to `gcmoe_jax.moe`, or None.
      backend: passed to `gcmoe_jax.moe`: ``"auto"``, ``"cuda"``, ``"cpu"`` or ``"reference"``.
      router_w: float ``[H, E]`` router weights (with ``weights``), stored as float32.
      weights: `ExpertWeights` of E experts of size H x I (with ``router_w``).
      score_bias: optional float ``[E]`` selection bias (sigmoid only).

    Raises:
      TypeError, ValueError: for options outside the ranges above, missing ``rngs``, or ``router_w``,
        ``weights`` or ``score_bias`` that do not match (H, I, E).
    """
    for name, v in (("hidden", hidden), ("intermediate", intermediate), ("experts", experts)):
      if not _is_int(v):
        raise TypeError(f"MoE: {name} must be an int, got {v!r}")
      if v < 1:
        raise ValueError(f"MoE: {name} must be positive, got {v}")
    _check_config(experts, top_k, score, norm_topk_prob, routed_scaling_factor, clamp, backend)
    if weights is None:
      if router_w is not None:
        raise TypeError("MoE: router_w must come with weights (ExpertWeights), got router_w without weights")
      if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"MoE: rngs must be an nnx.Rngs for random init (or pass router_w and weights), got "
                        f"{type(rngs).__name__}")
      router_w, weights = _random_init(rngs, hidden, intermediate, experts, shared_intermediate, shared_group)
    else:
      if not isinstance(weights, ExpertWeights):
        raise TypeError(f"MoE: weights must be gcmoe_jax.ExpertWeights, got {type(weights).__name__}")
      got = (weights.hidden, weights.intermediate, weights.num_experts)
      if got != (hidden, intermediate, experts):
        raise ValueError(f"MoE: weights must have (H, I, E) = {(hidden, intermediate, experts)}, got {got}")
      if router_w is None:
        raise TypeError("MoE: weights must come with router_w [H, E], got weights without router_w")
    if score_bias is not None:
      if score != "sigmoid":
        raise ValueError(f"MoE: score_bias applies only to score='sigmoid', got score={score!r}")
      if not hasattr(score_bias, "shape") or tuple(score_bias.shape) != (experts,):
        raise ValueError(f"MoE: score_bias must have shape [E] = [{experts}], got "
                         f"{list(getattr(score_bias, 'shape', ()))}")
    self.router_w = nnx.Param(_as_router(router_w, hidden, experts))
    self.experts = QuantizedParam(weights)
    self.score_bias = None if score_bias is None else RouterBias(jnp.asarray(score_bias, jnp.float32))
    self.top_k = int(top_k)
    self.score = score
    self.norm_topk_prob = (score == "sigmoid") if norm_topk_prob is None else norm_topk_prob
    self.routed_scaling_factor = float(routed_scaling_factor)
    self.clamp = None if clamp is None else float(clamp)
    self.backend = backend
    self.ep_axis: str | None = None  # set by `shard`: the mesh axis the experts are split over

  def shard(self, mesh: jax.sharding.Mesh, axis: str = "ep") -> MoE:
    """Splits the routed experts over mesh axis ``axis`` (shared expert replicated) and runs expert-parallel.

    Calls then go through `gcmoe_jax.moe(..., ep_axis=axis)` under `jax.jit`: tokens split over the same axis,
    routes sent to their experts' ranks with all_to_all (docs/expert_parallel.md). E and the token count must be
    divisible by the axis size.

    Returns:
      self.
    """
    w = self.weights
    self.experts = QuantizedParam(jax.device_put(w, sharding.expert_shardings(w, mesh, axis=axis)))
    self.ep_axis = axis
    return self

  # ---------------------------------------------------------------------------------------------------------------
  # Constructors
  # ---------------------------------------------------------------------------------------------------------------

  @classmethod
  def from_quantized(cls, router_w: jax.Array, weights: ExpertWeights, *, top_k: int, **options: Any) -> MoE:
    """A layer from router weights ``[H, E]`` and already quantized `ExpertWeights` (no copy, no requantization).

    ``options`` are the keyword options of `__init__` (score, norm_topk_prob, routed_scaling_factor, score_bias,
    clamp, backend).

    Raises:
      TypeError, ValueError: as `__init__`.
    """
    if not isinstance(weights, ExpertWeights):
      raise TypeError(f"MoE: weights must be gcmoe_jax.ExpertWeights, got {type(weights).__name__}")
    return cls(weights.hidden, weights.intermediate, weights.num_experts, top_k, router_w=router_w, weights=weights,
               **options)

  @classmethod
  def from_bf16(cls, router_w: jax.Array, w13: jax.Array, w2: jax.Array, *, top_k: int,
                shared: tuple[jax.Array, jax.Array] | None = None, shared_group: int = 128, **options: Any) -> MoE:
    """Quantizes unquantized expert weights once (`gcmoe_jax.quantize_experts`) and builds the layer.

    Args:
      router_w: float ``[H, E]``.
      w13: float ``[E, H, 2I]``, gate = ``[..., :I]``, up = ``[..., I:]`` (``x @ W`` orientation).
      w2: float ``[E, I, H]``.
      top_k: k.
      shared: optional shared expert ``(s13 [H, 2Is], s2 [Is, H])`` (quantized to MXFP8).
      shared_group: 32 or 128.
      **options: score, norm_topk_prob, routed_scaling_factor, score_bias, clamp, backend (see `__init__`).

    Raises:
      TypeError, ValueError: from `quantize_experts` (shapes outside Table 10, non-finite weights) or `__init__`.
    """
    w = formats.quantize_experts(w13, w2, shared=shared, shared_group=shared_group)
    return cls.from_quantized(router_w, w, top_k=top_k, **options)

  @classmethod
  def from_mxfp4(cls, router_w: jax.Array, w13_blocks: jax.Array, w13_scales: jax.Array, w2_blocks: jax.Array,
                 w2_scales: jax.Array, *, top_k: int, gate_up: str = "interleaved",
                 shared: tuple[jax.Array, jax.Array] | None = None, shared_group: int = 128,
                 **options: Any) -> MoE:
    """Repacks a gpt-oss style MXFP4 checkpoint (`gcmoe_jax.from_mxfp4`, no requantization) and builds the layer.

    Args:
      router_w: float ``[H, E]``.
      w13_blocks: uint8 ``[E, 2I, H/32, 16]``; w13_scales: uint8 ``[E, 2I, H/32]``.
      w2_blocks: uint8 ``[E, H, I/32, 16]``; w2_scales: uint8 ``[E, H, I/32]``.
      top_k: k.
      gate_up: row order of ``w13_blocks``, ``"interleaved"`` (gpt-oss) or ``"concatenated"``.
      shared: optional float shared expert ``(s13 [H, 2Is], s2 [Is, H])``; shared_group: 32 or 128.
      **options: as `from_bf16`.

    Raises:
      TypeError, ValueError: from `from_mxfp4` or `__init__`.
    """
    w = formats.from_mxfp4(w13_blocks, w13_scales, w2_blocks, w2_scales, gate_up=gate_up, shared=shared,
                           shared_group=shared_group)
    return cls.from_quantized(router_w, w, top_k=top_k, **options)

  # ---------------------------------------------------------------------------------------------------------------
  # Shape
  # ---------------------------------------------------------------------------------------------------------------

  @property
  def weights(self) -> ExpertWeights:
    """The quantized `ExpertWeights`."""
    return _value(self.experts)

  @property
  def num_experts(self) -> int:
    return self.weights.num_experts

  @property
  def hidden(self) -> int:
    return self.weights.hidden

  @property
  def intermediate(self) -> int:
    return self.weights.intermediate

  # ---------------------------------------------------------------------------------------------------------------
  # Forward
  # ---------------------------------------------------------------------------------------------------------------

  def route(self, x: jax.Array) -> api.Routes:
    """The router alone: top-k ids and route weights of tokens ``x`` (bf16 ``[T, H]``).

    Returns:
      `Routes` with int32 ids ``[T, k]`` and float32 weights ``[T, k]``.
    """
    # HIGHEST: on GPUs a default-precision float32 matmul may run in TF32, and routing must not flip with it.
    logits = jnp.dot(x.astype(jnp.float32), self.router_w[...], precision=jax.lax.Precision.HIGHEST)
    if self.score == "softmax":
      scores = jax.nn.softmax(logits, axis=-1)
      select = scores
    else:
      scores = jax.nn.sigmoid(logits)
      select = scores if self.score_bias is None else scores + self.score_bias[...]
    _, ids = jax.lax.top_k(select, self.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if self.norm_topk_prob:
      # The epsilon is DeepSeek-V3's: sigmoid scores can all underflow for a far-off token.
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * self.routed_scaling_factor
    return api.Routes(ids.astype(jnp.int32), weights.astype(jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    """Routes ``x`` and applies the experts.

    Args:
      x: bfloat16 ``[T, H]`` or ``[B, S, H]`` (tokens are flattened, then the shape is restored).

    Returns:
      bfloat16, the shape of ``x``.

    Raises:
      TypeError: for a dtype other than bfloat16 or a rank other than 2 or 3.
      ValueError: when ``x.shape[-1]`` is not H. `gcmoe_jax.moe` raises as documented there (a named backend that
        cannot run here: RuntimeError).
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"MoE: x must be an array, got {type(x).__name__}")
    if x.dtype != jnp.bfloat16:
      raise TypeError(f"MoE: x must have dtype bfloat16, got {x.dtype} (convert with x.astype(jnp.bfloat16))")
    if x.ndim not in (2, 3):
      raise TypeError(f"MoE: x must be [T, H] or [B, S, H], got shape {list(x.shape)}")
    if x.shape[-1] != self.hidden:
      raise ValueError(f"MoE: x.shape[-1] must equal H = {self.hidden}, got {x.shape[-1]}")
    tokens = x.reshape(-1, x.shape[-1])
    y = api.moe(tokens, self.weights, self.route(tokens), clamp=self.clamp, backend=self.backend,
                ep_axis=self.ep_axis)
    return y.reshape(x.shape)


def _random_init(rngs: nnx.Rngs, h: int, i: int, e: int, shared_i: int | None,
                 shared_group: int) -> tuple[jax.Array, ExpertWeights]:
  if shared_i is not None and not _is_int(shared_i):
    raise TypeError(f"MoE: shared_intermediate must be an int or None, got {shared_i!r}")
  # Sampled with numpy from a seed drawn from `rngs`: XLA:CPU takes seconds to compile threefry for these sizes.
  rng = np.random.default_rng(np.asarray(jax.random.key_data(rngs.params())).ravel())
  normal = lambda shape, fan_in: (rng.standard_normal(shape, np.float32) / np.sqrt(fan_in)).astype(np.float32)
  router_w = normal((h, e), h)
  w13, w2 = normal((e, h, 2 * i), h), normal((e, i, h), i)
  shared = None if shared_i is None else (normal((h, 2 * shared_i), h), normal((shared_i, h), shared_i))
  return jnp.asarray(router_w), _quantize_jit(w13, w2, shared=shared, shared_group=shared_group)


# Under jit: eagerly, the transform dispatches ~100 small ops, each compiled on first use (seconds on CPU); random
# normals need no finiteness check, the only thing the eager path adds.
_quantize_jit = jax.jit(formats.quantize_experts, static_argnames="shared_group")
