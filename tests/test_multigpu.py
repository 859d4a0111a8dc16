"""Expert parallelism on several real GPUs (issue 11): `gm.moe(..., backend="cuda", axis_name=...)` inside
shard_map over every GPU of the machine, against the single-device oracle on the same global inputs.

One process drives all GPUs (each rank's call runs its own runtime, workspace and green contexts on its device).
Skipped with fewer than two GPUs. The local op of the collective transport sees R * B * k rows with one route each
(docs/expert_parallel.md), so the kernel variants are (H, I, E/R, k = 1, capacity of R * B * k) and, for the shared
expert, (H, I, E/R, 1, capacity of B, Is, group): `python -m gcmoe_jax build-kernels --preset multigpu` builds them
for R = 2, 4 and 8.

The long runs and failure drills run in subprocesses (tests/ep_worker.py): one process driving every GPU, or one
process per GPU through `jax.distributed`; a hang becomes a failed test at its deadline. Run with
XLA_PYTHON_CLIENT_PREALLOCATE=false so that the workers find memory beside this process (docs/expert_parallel.md).
"""

import dataclasses
import re

import ep_worker
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



def test_a_local_op_beyond_256_rows_runs_in_chunks(mesh):
  """R * B * k > 256 rows per rank: the CUDA local op runs in chunks of 256 rows sorted by expert
  (`ffi._moe.in_chunks`), still bit for bit."""
  ranks = mesh.devices.size
  b = 256 // (4 * ranks) + 8  # rows per rank R * B * k = 256 + 32 R
  shape = dataclasses.replace(SMALL, experts=8 * ranks, top_k=4, tokens=b * ranks)
  x, w, r = quantized(make_problem("zipf", shape, seed=90 + ranks))
  y = _run(mesh, x, w, r, 10.0)
  want = np.asarray(emulated(x, w, r.ids, r.weights, clamp=10.0))
  np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))

@pytest.mark.parametrize("family", ["default", "zipf", "skewed", "padding"])
def test_fused_transport_over_all_gpus_equals_the_oracle(mesh, family):
  """Issue 9 across real GPUs: ``ep_axis`` with ``transport='fused'`` on sharded global arrays, one process driving
  every GPU (peer access): each rank pulls its experts' rows from the peers' workspaces in the kernels and returns
  GEMM2 rows to their owners; bit for bit equal to the oracle (the same arithmetic as one rank). Needs the cubins of
  the fused variants (H, I, E/R, k, capacity of B, R): `build-kernels --variant 512,256,8,4,8,rR`."""
  ranks = mesh.devices.size
  shape = dataclasses.replace(SMALL, experts=8 * ranks, top_k=4, tokens=4 * ranks, shared_intermediate=None)
  x, w, r = quantized(make_problem(family, shape, seed=70 + ranks))
  f = jax.jit(lambda x, w, ids, wt: gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend="cuda", ep_axis="ep",
                                            transport="fused"))
  tokens = NamedSharding(mesh, P("ep"))
  args = (jax.device_put(x, tokens), jax.device_put(w, sharding.expert_shardings(w, mesh)),
          jax.device_put(r.ids, tokens), jax.device_put(r.weights, tokens))
  y = np.asarray(f(*args))
  want = np.asarray(emulated(x, w, r.ids, r.weights, clamp=10.0))
  print(f"\n  fused {family} R={ranks}: bit-exact share {np.mean(y.view(np.uint16) == want.view(np.uint16)):.6f}")
  np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16), err_msg=f"fused {family} R={ranks}")


# ---- Subprocess runs (tests/ep_worker.py): one process per GPU, long loops and failure drills -------------------
# A subprocess turns a hang into a failed test. NVLink multicast stays off in every process (issue 11).
_launch = ep_worker.launch
_tail = ep_worker.tail


@pytest.fixture(scope="module")
def ranks():
  n = len(_gpus())
  if n < 2:
    pytest.skip(f"needs >= 2 GPUs, found {n}")
  return 8 if n >= 8 else 4 if n >= 4 else 2


@pytest.mark.parametrize("per_process", [False, True], ids=["one-process", "process-per-gpu"])
def test_1000_replays_with_fresh_inputs_stay_exact(ranks, per_process):
  """Fresh inputs every step, every 100th step compared bit for bit, no graph instantiated after the first step."""
  results = _launch(ranks, "--steps", "1000", "--check-every", "100", per_process=per_process, deadline_s=400)
  for i, (rc, text) in enumerate(results):
    print(f"\n  worker {i}: {_tail(text, 3)}")
    assert rc == 0 and "OK 1000 steps" in text, f"worker {i} (rc {rc}):\n{_tail(text)}"


def test_a_killed_rank_ends_the_others_with_a_diagnostic(ranks):
  """The last rank's process exits abruptly at step 3: the others end (no hang) naming the lost task."""
  results = _launch(ranks, "--steps", "50", "--die-at", "3", "--fault-rank", str(ranks - 1), "--heartbeat", "10",
                    per_process=True, deadline_s=120)
  for i, (rc, text) in enumerate(results[:-1]):
    print(f"\n  survivor {i}: rc {rc}: {_tail(text, 4)}")
    assert rc != 0, f"survivor {i} finished although rank {ranks - 1} died:\n{_tail(text)}"
    assert re.search(r"heartbeat timeout|another task died|unhealthy", text), _tail(text)
  assert results[-1][0] == 17, _tail(results[-1][1])


@pytest.mark.parametrize("per_process", [False, True], ids=["one-process", "process-per-gpu"])
def test_a_stalled_rank_raises_naming_its_device(ranks, per_process):
  """Rank 1's role 1 withholds an expert from step 2: its role 2 gives up after 50 ms (the call ends on every rank,
  that rank's outputs NaN), and a later call raises the recorded fault naming the device: on every rank of a process
  that drives several (they stop at the same call, none waits in a collective), else on the faulty rank's process,
  whose exit the others' coordination service detects."""
  results = _launch(ranks, "--steps", "6", "--stall-at", "2", "--fault-rank", "1", "--heartbeat", "10",
                    per_process=per_process, deadline_s=120, GCMOE_WAIT_TIMEOUT_MS="50")
  text = "\n".join(t for _, t in results)
  for i, (rc, t) in enumerate(results):
    print(f"\n  worker {i}: rc {rc}: {_tail(t, 4)}")
  assert re.search(r"step 2 shard \d+ NaN rows [1-9]", text), _tail(text)
  device = 0 if per_process else 1  # one visible GPU per process: the faulty rank's device is its ordinal 0
  assert re.search(rf"fault was recorded on device {device}: role 2, .*spin-wait exceeded its bound of 50 ms", text), \
      _tail(text)
  assert all(rc != 0 for rc, _ in results), "a rank finished all steps although rank 1 stalled"


@pytest.mark.parametrize("per_process", [False, True], ids=["one-process", "process-per-gpu"])
def test_the_fused_transport_in_subprocesses_stays_exact(ranks, per_process):
  """`gm.moe(..., axis_name="ep", transport="fused")` inside shard_map over every GPU: one process driving them
  (peer access) or one process per GPU (CUDA IPC handles through jax.distributed, docs/fused_transport.md "Across
  processes"); 200 steps of fresh inputs, every 50th bit-exact; then `gm.release_fused_workspaces()` and a fresh
  trace, exact again (across processes the old program must refuse to run; XLA command buffers are off so that its
  handler sees the call). Cubins: `--preset multigpu` (512,256,8,4,8,rR)."""
  results = _launch(ranks, "--steps", "200", "--check-every", "50", "--transport", "fused", "--shared-intermediate",
                    "0", "--release", per_process=per_process, deadline_s=300,
                    XLA_FLAGS="--xla_gpu_enable_command_buffer=")
  for i, (rc, text) in enumerate(results):
    print(f"\n  worker {i}: {_tail(text, 2)}")
    assert rc == 0 and "OK 200 steps" in text, f"worker {i} (rc {rc}):\n{_tail(text)}"
    assert "a new trace bit-exact" in text and ("the old program refused" in text) == per_process, _tail(text)
