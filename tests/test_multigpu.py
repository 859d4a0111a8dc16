"""Expert parallelism on several real GPUs (issue 11): `gm.moe(..., backend="cuda", axis_name=...)` inside
shard_map over every GPU of the machine, against the single-device oracle on the same global inputs.

One process drives all GPUs (each rank's call runs its own runtime, workspace and green contexts on its device).
Skipped with fewer than two GPUs. The local op of the collective transport sees R * B * k rows with one route each
(docs/expert_parallel.md), so the kernel variants are (H, I, E/R, k = 1, capacity of R * B * k) and, for the shared
expert, (H, I, E/R, 1, capacity of B, Is, group): `python -m gcmoe_jax build-kernels --preset multigpu` builds them
for R = 2.
"""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gcmoe_jax as gm
from conftest import SMALL, quantized
from gcmoe_jax import reference, sharding
from gcmoe_jax.bench.problems import CASE_FAMILIES, make_problem

pytestmark = [pytest.mark.multigpu, pytest.mark.gpu]


def _gpus():
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


@pytest.fixture(scope="module")
def mesh():
  gpus = _gpus()
  if len(gpus) < 2:
    pytest.skip(f"needs >= 2 GPUs, found {len(gpus)}")
  if not gm.api.backend_support()["cuda"].ok:
    pytest.skip(gm.api.backend_support()["cuda"].reason)
  r = 8 if len(gpus) >= 8 else 4 if len(gpus) >= 4 else 2
  return jax.make_mesh((r,), ("ep",), axis_types=(AxisType.Explicit,), devices=gpus[:r])


emulated = jax.jit(reference.moe_emulated, static_argnames=("clamp",))


def _run(mesh, x, w, r, clamp, transport="collective"):
  def body(x, w, ids, wt):
    return gm.moe(x, w, gm.Routes(ids, wt), clamp=clamp, backend="cuda", axis_name="ep", transport=transport)

  specs = (P("ep"), sharding.expert_specs(w), P("ep"), P("ep"))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("ep")))
  tokens = NamedSharding(mesh, P("ep"))
  args = (jax.device_put(x, tokens), jax.device_put(w, sharding.expert_shardings(w, mesh)),
          jax.device_put(r.ids, tokens), jax.device_put(r.weights, tokens))
  return np.asarray(f(*args))


@pytest.mark.parametrize("transport", ["collective", "ragged"])
@pytest.mark.parametrize("family", CASE_FAMILIES)
def test_every_case_family_over_all_gpus_equals_the_oracle(mesh, family, transport):
  """Bit for bit: each rank's expert math is the single-device kernels', and the owner sums the k slots in order."""
  ranks = mesh.devices.size
  shape = dataclasses.replace(SMALL, experts=8 * ranks, top_k=4, tokens=4 * ranks, shared_intermediate=256,
                              shared_group=128)
  x, w, r = quantized(make_problem(family, shape, seed=50 + ranks))
  y = _run(mesh, x, w, r, 10.0, transport)
  want = np.asarray(emulated(x, w, r.ids, r.weights, clamp=10.0))
  print(f"\n  {family} R={ranks} {transport}: bit-exact share {np.mean(y.view(np.uint16) == want.view(np.uint16)):.6f}")
  np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16), err_msg=f"{family} R={ranks} {transport}")
