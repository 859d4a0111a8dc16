"""Test and benchmark problems: random MoE layers and the paper's routing case families.

Everything is random and seeded (never zeros): x ~ N(0, 1), weights ~ N(0, 1/fan_in), route weights from random
router logits: renormalised over the k chosen experts by default, or (``normalize=False``) the chosen experts'
probabilities under a softmax over all E experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["CASE_FAMILIES", "DEMO_SHAPE", "Problem", "Shape", "make_problem", "make_routes", "make_weights"]


@dataclasses.dataclass(frozen=True)
class Shape:
  """One MoE layer shape: E experts, hidden H, intermediate I, top-k, T tokens, shared expert Is (or None)."""

  experts: int
  hidden: int
  intermediate: int
  top_k: int
  tokens: int
  shared_intermediate: int | None = None
  shared_group: int = 128
  clamp: float | None = 10.0


# A GLM5.2-like layer reduced to run in seconds on 2 CPU cores: 16 experts (GLM5.2 has 256), H 1024 (6144),
# I 512 (2048), top-8 -> top-4, one decode step of 8 tokens, a shared expert.
DEMO_SHAPE = Shape(experts=16, hidden=1024, intermediate=512, top_k=4, tokens=8, shared_intermediate=512)

# The paper's accuracy case families (§6): routing patterns, boundary k, empty and maximally skewed batches.
CASE_FAMILIES = ("default", "first_expert", "last_expert", "k_max", "zipf", "empty", "skewed", "padding")


@dataclasses.dataclass(frozen=True)
class Problem:
  """Unquantized inputs of one case: arrays are numpy; ``shared`` is ``(s13, s2)`` or None."""

  name: str
  shape: Shape
  x: np.ndarray  # [T, H] float32 (cast to bf16 by the caller)
  w13: np.ndarray  # [E, H, 2I]
  w2: np.ndarray  # [E, I, H]
  shared: tuple[np.ndarray, np.ndarray] | None
  ids: np.ndarray  # [T, k] int32
  weights: np.ndarray  # [T, k] float32


def make_weights(rng: np.random.Generator, shape: Shape) -> tuple[np.ndarray, np.ndarray, Any]:
  e, h, i = shape.experts, shape.hidden, shape.intermediate
  w13 = (rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)).astype(np.float32)
  w2 = (rng.standard_normal((e, i, h)) / np.sqrt(i)).astype(np.float32)
  shared = None
  if shape.shared_intermediate:
    i_s = shape.shared_intermediate
    shared = ((rng.standard_normal((h, 2 * i_s)) / np.sqrt(h)).astype(np.float32),
              (rng.standard_normal((i_s, h)) / np.sqrt(i_s)).astype(np.float32))
  return w13, w2, shared


def make_routes(rng: np.random.Generator, family: str, tokens: int, experts: int, top_k: int, *,
                normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Expert ids ``[T, k]`` int32 and softmax route weights ``[T, k]`` float32 for a case family.

  ``normalize``: the k weights sum to 1 (a softmax over the chosen experts' logits, GLM / DeepSeek-V3 routers), or,
  when False, they are the chosen experts' probabilities under a softmax over all E experts (Qwen-MoE /
  DeepSeek-V2 routers, the ones that pair routed experts with a shared expert).
  """
  t, e, k = tokens, experts, top_k
  if family in ("default", "k_max", "padding"):
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k]
  elif family == "first_expert":
    ids = np.zeros((t, k), np.int64) + np.arange(k)  # k = 1 in the family's shape: every token to expert 0
  elif family == "last_expert":
    ids = np.zeros((t, k), np.int64) + (e - 1 - np.arange(k))
  elif family == "zipf":
    # Asymmetric routing: expert popularity ~ 1/rank^1.2, k distinct experts drawn without replacement.
    p = 1.0 / np.arange(1, e + 1) ** 1.2
    p /= p.sum()
    ids = np.stack([rng.choice(e, size=k, replace=False, p=p) for _ in range(t)]) if t else np.zeros((0, k))
  elif family == "skewed":
    ids = np.tile(rng.choice(e, size=k, replace=False), (t, 1))  # every token to the same k experts
  elif family == "empty":
    ids = np.zeros((0, k))
  else:
    raise ValueError(f"make_routes: family must be one of {CASE_FAMILIES}, got {family!r}")
  if normalize:  # GLM / DeepSeek-V3 routers: the k weights renormalised to sum 1
    logits = rng.standard_normal(ids.shape)
  else:  # Qwen-MoE / DeepSeek-V2 routers: the chosen experts' probabilities under a softmax over all E experts
    all_logits = rng.standard_normal((t, e))
    logits = np.take_along_axis(all_logits, ids.astype(np.int64), axis=1) if t else np.zeros((0, k))
  denom = np.exp(logits).sum(axis=1, keepdims=True) if normalize else np.exp(all_logits).sum(axis=1, keepdims=True)
  weights = np.exp(logits) / denom if t else np.zeros((0, k))
  ids = ids.astype(np.int32)
  if family == "padding":
    ids[rng.random(ids.shape) < 0.3] = -1  # padding slots are dropped
  return ids, weights.astype(np.float32)


def family_shape(family: str, base: Shape) -> Shape:
  """The family's variant of a base shape (k = 1 for the single-expert boundaries, k = min(32, E) for k_max)."""
  if family in ("first_expert", "last_expert"):
    return dataclasses.replace(base, top_k=1)
  if family == "k_max":
    return dataclasses.replace(base, top_k=min(32, base.experts))
  if family == "empty":
    return dataclasses.replace(base, tokens=0)
  return base


def make_problem(family: str, base: Shape, seed: int = 0, *, normalize: bool = True) -> Problem:
  """A random problem of ``family`` at (a variant of) ``base`` (``normalize``: see `make_routes`)."""
  shape = family_shape(family, base)
  rng = np.random.default_rng(seed)
  w13, w2, shared = make_weights(rng, shape)
  x = rng.standard_normal((shape.tokens, shape.hidden)).astype(np.float32)
  ids, weights = make_routes(rng, family, shape.tokens, shape.experts, shape.top_k, normalize=normalize)
  return Problem(family, shape, x, w13, w2, shared, ids, weights)
