"""Accuracy harness: cosine of the quantized operator to the dense BF16 MoE over the paper's case families."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import api, formats, reference
from gcmoe_jax.bench.problems import CASE_FAMILIES, DEMO_SHAPE, Problem, Shape, make_problem

__all__ = ["Result", "THRESHOLDS", "cosine", "evaluate", "run", "to_markdown"]

# The paper's accuracy bars against the dense BF16 MoE: routed experts alone, and with the fused shared expert.
THRESHOLDS = {"routed": 0.97, "shared": 0.99}


@dataclasses.dataclass(frozen=True)
class Result:
  family: str
  variant: str  # "routed" or "shared"
  tokens: int
  top_k: int
  cosine: float  # nan when T = 0
  max_abs_diff: float
  threshold: float

  @property
  def ok(self) -> bool:
    return self.tokens == 0 or self.cosine >= self.threshold


def cosine(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  if a.size == 0:
    return float("nan")
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@functools.partial(jax.jit, static_argnames=("clamp",))
def _bf16_jit(x, w13, w2, shared, ids, weights, clamp):
  return reference.moe_bf16(x, w13, w2, ids, weights, shared=shared, clamp=clamp)


def bf16_reference(p: Problem) -> np.ndarray:
  """The dense BF16 MoE of problem ``p`` from its unquantized weights, float32 numpy ``[T, H]``."""
  x = jnp.asarray(p.x, jnp.bfloat16)
  return np.asarray(_bf16_jit(x, p.w13, p.w2, p.shared, jnp.asarray(p.ids), jnp.asarray(p.weights), p.shape.clamp),
                    np.float32)


def evaluate(p: Problem, *, backend: str = "reference") -> tuple[np.ndarray, np.ndarray]:
  """Returns ``(y_op, y_bf16)`` as float32 numpy for problem ``p`` (the op through `api.moe`)."""
  s = p.shape
  w = formats.quantize_experts(p.w13, p.w2, shared=p.shared, shared_group=s.shared_group)
  routes = api.Routes(jnp.asarray(p.ids), jnp.asarray(p.weights))
  y = api.moe(jnp.asarray(p.x, jnp.bfloat16), w, routes, clamp=s.clamp, backend=backend)
  return np.asarray(y, np.float32), bf16_reference(p)


def run(base: Shape = DEMO_SHAPE, families: tuple[str, ...] = CASE_FAMILIES, *, backend: str = "reference",
        seed: int = 0, normalize: bool = False) -> list[Result]:
  """Runs every family with routed experts only and with the shared expert; one `Result` each.

  ``normalize``: the router convention of `problems.make_routes`. The default (False: the chosen experts'
  probabilities under a softmax over all E experts) is the one under which the paper's figures reproduce.
  """
  results = []
  for variant in ("routed", "shared"):
    shape = dataclasses.replace(base, shared_intermediate=(base.shared_intermediate or base.intermediate)
                                if variant == "shared" else None)
    for family in families:
      p = make_problem(family, shape, seed, normalize=normalize)
      y, y_ref = evaluate(p, backend=backend)
      diff = float(np.max(np.abs(y - y_ref))) if y.size else 0.0
      results.append(Result(family, variant, p.shape.tokens, p.shape.top_k, cosine(y, y_ref), diff,
                            THRESHOLDS[variant]))
  return results


def to_markdown(results: list[Result]) -> str:
  lines = ["| family | variant | T | k | cosine to BF16 | max abs diff | bar | ok |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in results:
    cos = "n/a (T = 0)" if r.tokens == 0 else f"{r.cosine:.6f}"
    lines.append(f"| {r.family} | {r.variant} | {r.tokens} | {r.top_k} | {cos} | {r.max_abs_diff:.4g} | "
                 f">= {r.threshold} | {'yes' if r.ok else 'NO'} |")
  return "\n".join(lines)
