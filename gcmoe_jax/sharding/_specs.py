"""Where expert-parallel arrays live: PartitionSpecs and NamedShardings for `ExpertWeights`."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gcmoe_jax.formats import ExpertWeights, SharedWeights


def _check_w(w) -> None:
  if not isinstance(w, ExpertWeights):
    raise TypeError(f"moe: w must be gcmoe_jax.ExpertWeights, got {type(w).__name__}")


def expert_specs(w: ExpertWeights, axis: str = "ep") -> ExpertWeights:
  """The `PartitionSpec` of each array of ``w``: routed experts split over ``axis``, the shared expert replicated.

  Args:
    w: the experts (only the structure and static sizes are used).
    axis: the mesh axis the experts are split over.

  Returns:
    An `ExpertWeights` whose leaves are PartitionSpecs (for `jax.shard_map` ``in_specs``).

  Raises:
    TypeError: when w is not `ExpertWeights`.
  """
  _check_w(w)
  shared = None
  if w.shared is not None:
    s = w.shared
    shared = SharedWeights(P(), P(), P(), P(), s.hidden, s.intermediate, s.group)
  return ExpertWeights(P(axis), P(axis), P(axis), P(axis), shared, w.num_experts, w.hidden, w.intermediate)


def expert_shardings(w: ExpertWeights, mesh: jax.sharding.Mesh, axis: str = "ep") -> ExpertWeights:
  """`NamedSharding`s for `jax.device_put(w, ...)`: global expert g on rank ``g // L`` of ``axis`` (L = E/R).

  Args:
    w: the experts.
    mesh: the device mesh; ``axis`` must be one of its axes.
    axis: the mesh axis the experts are split over (R ranks).

  Returns:
    An `ExpertWeights` whose leaves are NamedShardings.

  Raises:
    TypeError: when w is not `ExpertWeights`. ValueError: when ``axis`` is not a mesh axis or E is not divisible
      by R.
  """
  _check_w(w)
  if axis not in mesh.axis_names:
    raise ValueError(f"moe: axis must be one of the mesh axes {tuple(mesh.axis_names)}, got {axis!r}")
  r = int(dict(mesh.shape)[axis])
  if w.num_experts % r:
    raise ValueError(f"moe: E (number of experts) must be divisible by R (size of mesh axis {axis!r}), got "
                     f"E = {w.num_experts}, R = {r}")
  specs = expert_specs(w, axis)
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
