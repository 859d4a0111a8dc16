"""One rank (or one process driving every GPU) of the expert-parallel runs in tests/test_multigpu.py (issue 11), and
`launch`, which starts them.

Started as a subprocess so that a hang is a timeout of the test, not of the suite, and so that ranks can be one
process per GPU (``--process-id``: `jax.distributed` over a coordinator on localhost, one visible GPU each) or one
process driving every GPU (no ``--process-id``). Every step draws fresh global inputs from one seed (identical in every
process), runs ``gm.moe(..., backend="cuda", axis_name="ep")`` under `jax.shard_map`, and compares this process's
shards of the output with `reference.moe_emulated` on the global inputs, bit for bit. Prints one line per step and
``OK <steps>`` at the end; exits non-zero on the first mismatch or error.

Failure drills: ``--die-at S`` makes process ``--fault-rank`` exit abruptly (os._exit) at step S, as a killed
rank; ``--stall-at S`` makes rank ``--fault-rank``'s role 1 withhold a local expert from step S on (the runtime's
stall hook), as a stalled rank: its role 2 waits past GCMOE_WAIT_TIMEOUT_MS, that call's outputs become NaN and
a later call raises the fault naming the device. ``--first-call-skew S``: process ``--fault-rank`` starts its first
step S seconds after the others (past GCMOE_WAIT_TIMEOUT_MS: the first call's waits have their own bound,
GCMOE_FIRST_WAIT_TIMEOUT_MS). ``--release``: after the steps, `gm.release_fused_workspaces` and a fresh trace.
``--exchange N`` runs N `sharding._peers` exchanges instead of steps. ``--backend
cpu`` runs everything on CPU devices (the harness's own tests, tests/test_ep_processes.py).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np

# NVLink multicast stays off in every process (issue 11).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(ranks: int, *args: str, per_process: bool, deadline_s: float = 240, cpu: bool = False,
           same_gpu: bool = False, **env: str) -> list[tuple[int, str]]:
  """Runs this script as ``ranks`` processes (``per_process``: one per device, `jax.distributed` over a coordinator
  on localhost) or as one process driving ``ranks`` devices, and returns each process's (exit code, output).
  ``cpu``: CPU devices (``--backend cpu``, gloo collectives across processes) instead of GPUs. ``same_gpu``: every
  process sees GPU 0 (ranks of one GPU in several processes: the fused transport's CUDA IPC path on one GPU; the
  processes' kernels share the GPU by time slices, so waits need a generous GCMOE_WAIT_TIMEOUT_MS).

  Raises:
    TimeoutError: a process still running at the deadline (all are killed first), with its output's tail.
  """
  me = pathlib.Path(__file__)
  # The workers import the same gcmoe_jax as the caller (the checkout when pytest runs from it).
  path = os.pathsep.join(p for p in (str(me.parent.parent), os.environ.get("PYTHONPATH", "")) if p)
  base = {**os.environ, **NO_MULTICAST, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1",
          "PYTHONPATH": path, **env}
  if cpu:
    args = (*args, "--backend", "cpu")
    base.update(JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
  if per_process:
    port = _free_port()
    cmds = [([sys.executable, str(me), *args, "--coordinator", f"localhost:{port}", "--num-processes", str(ranks),
              "--process-id", str(i)], {**base, "CUDA_VISIBLE_DEVICES": "0" if same_gpu else str(i)})
            for i in range(ranks)]
  else:
    devices = {"XLA_FLAGS": f"{base.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ranks}"} if cpu \
        else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(ranks)))}
    cmds = [([sys.executable, str(me), *args], {**base, **devices})]
  procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c, e in cmds]
  end = time.monotonic() + deadline_s
  out = []
  for i, proc in enumerate(procs):
    try:
      text, _ = proc.communicate(timeout=max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise TimeoutError(f"worker {i} still running after {deadline_s} s (a hang):\n{tail(proc.communicate()[0])}")
    out.append((proc.returncode, text))
  return out


def tail(text: str, lines: int = 25) -> str:
  """The last lines of a worker's output, without native stack-trace frames, each cut to 300 characters."""
  return "\n".join([line[:300] for line in text.splitlines() if not line.startswith("    @")][-lines:])


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--coordinator", default="")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=None)
  p.add_argument("--heartbeat", type=int, default=10, help="jax.distributed heartbeat timeout in seconds")
  p.add_argument("--transport", default="collective")
  p.add_argument("--backend", default="cuda", help="cuda; cpu for a dry run of this script on CPU devices")
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--check-every", type=int, default=1)
  p.add_argument("--die-at", type=int, default=-1)
  p.add_argument("--stall-at", type=int, default=-1)
  p.add_argument("--fault-rank", type=int, default=1)
  p.add_argument("--first-call-skew", type=float, default=0.0)
  p.add_argument("--release", action="store_true", help="after the steps: release the fused workspaces, reconnect")
  p.add_argument("--exchange", type=int, default=0, help="instead of steps: this many `sharding._peers` exchanges")
  p.add_argument("--exchange-timeout-ms", type=int, default=30_000)
  p.add_argument("--shared-intermediate", type=int, default=256, help="the shared expert's I (0: none)")
  args = p.parse_args(argv)

  import jax

  if args.process_id is not None:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               heartbeat_timeout_seconds=args.heartbeat, initialization_timeout=60,
                               shutdown_timeout_seconds=args.heartbeat)
  if args.exchange:
    return _exchange(args)
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import gcmoe_jax as gm
  from gcmoe_jax import formats, reference, sharding
  from gcmoe_jax.bench.problems import Shape, make_routes, make_weights
  from gcmoe_jax.ffi import debug_set_stall_expert, graph_instantiations

  gpus = jax.devices()
  ranks = len(gpus)
  me = jax.process_index()
  mesh = jax.sharding.Mesh(np.array(gpus), ("ep",), axis_types=(AxisType.Explicit,))  # rank r is gpus[r]
  shape = Shape(experts=8 * ranks, hidden=512, intermediate=256, top_k=4, tokens=4 * ranks,
                shared_intermediate=args.shared_intermediate or None)
  rng = np.random.default_rng(1234)
  w13, w2, shared = make_weights(rng, shape)
  local = jax.local_devices()[0]
  w = jax.device_put(formats.quantize_experts(jax.device_put(w13, local), jax.device_put(w2, local),
                                              shared=None if shared is None else jax.device_put(shared, local)), local)
  w_host = jax.tree_util.tree_map(np.asarray, w)

  def global_array(value, s):
    return jax.make_array_from_callback(value.shape, s, lambda index: value[index])

  w_global = jax.tree_util.tree_map(global_array, w_host, sharding.expert_shardings(w, mesh))
  tokens = NamedSharding(mesh, P("ep"))

  def body(x, w, ids, wt):
    return gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend=args.backend, axis_name="ep", transport=args.transport,
                  mesh=mesh if args.transport == "fused" else None)

  def make_step():
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), sharding.expert_specs(w), P("ep"), P("ep")),
                                 out_specs=P("ep")))

  step = make_step()
  if args.transport == "fused" and jax.process_count() > 1:
    # A rank's first call waits for its peers' first publications (bounded by GCMOE_FIRST_WAIT_TIMEOUT_MS): compile
    # ahead and meet at a barrier, so the drills' steps start together (--first-call-skew then delays one process).
    x0 = np.zeros((shape.tokens, shape.hidden), jnp.bfloat16)
    i0 = np.zeros((shape.tokens, shape.top_k), np.int32)
    step = step.lower(global_array(x0, tokens), w_global, global_array(i0, tokens),
                      global_array(np.zeros(i0.shape, np.float32), tokens)).compile()
    from gcmoe_jax import _compat
    _compat.distributed_client().wait_at_barrier("ep_worker_compiled", 120_000)
    print(f"process {jax.process_index()}: peer groups {sharding._body.peer_groups(mesh, 'ep')} (CUDA IPC where "
          f"negative: another process's device)", flush=True)
  oracle = jax.jit(reference.moe_emulated, static_argnames=("clamp",))
  fault_device = gpus[args.fault_rank]
  stall_expert = 1  # local expert 1 of the faulty rank: global expert L * rank + 1
  print(f"process {me} of {jax.process_count()}: {ranks} ranks, local devices {[d.id for d in jax.local_devices()]}, "
        f"transport {args.transport}", flush=True)
  t0 = time.perf_counter()
  graphs = None
  for n in range(args.steps):
    if n == 0 and args.first_call_skew > 0 and me == fault_device.process_index:
      print(f"process {me}: starting {args.first_call_skew} s after the others", flush=True)
      time.sleep(args.first_call_skew)
    if n == args.die_at and me == fault_device.process_index:
      print(f"process {me}: exiting abruptly at step {n} (killed rank {args.fault_rank})", flush=True)
      os._exit(17)
    if n == args.stall_at and fault_device.process_index == me:
      debug_set_stall_expert(stall_expert, fault_device.local_hardware_id)
      print(f"process {me}: rank {args.fault_rank} (device {fault_device.local_hardware_id}) withholds local expert "
            f"{stall_expert} from step {n}", flush=True)
    x = rng.standard_normal((shape.tokens, shape.hidden)).astype(np.float32).astype(jnp.bfloat16)
    ids, wt = make_routes(rng, "default", shape.tokens, shape.experts, shape.top_k)
    ids = ids.astype(np.int32)
    target = shape.experts // ranks * args.fault_rank + stall_expert
    if args.stall_at >= 0 and target not in ids[0]:  # the withheld expert gets a row (ids of a token stay distinct)
      ids[0, 0] = target
    y = step(global_array(x, tokens), w_global, global_array(ids, tokens), global_array(wt, tokens))
    stalled = n >= args.stall_at >= 0
    if n % args.check_every and n != args.steps - 1 and not stalled:
      continue
    want = np.asarray(oracle(jax.device_put(x, local), w, jax.device_put(ids, local), jax.device_put(wt, local),
                             clamp=10.0))
    # A first step that gave up on a late peer (--first-call-skew past its bound) has NaN outputs; the next call
    # raises the recorded fault.
    late = n == 0 and args.first_call_skew > 0 and any(np.isnan(np.asarray(s.data)).any()
                                                       for s in y.addressable_shards)
    for s in y.addressable_shards:
      got = np.asarray(s.data)
      if stalled or late:
        nan_rows = int(np.isnan(got).any(axis=1).sum())
        print(f"process {me}: step {n} shard {s.index[0].start or 0} NaN rows {nan_rows} of {got.shape[0]}",
              flush=True)
        continue
      if not np.array_equal(got.view(np.uint16), want[s.index].view(np.uint16)):
        print(f"process {me}: step {n} shard {s.index[0].start or 0} MISMATCH", flush=True)
        return 1
    if not (stalled or late):
      print(f"process {me}: step {n} bit-exact", flush=True)
    if args.backend == "cuda" and graphs is None:
      graphs = graph_instantiations()  # after the first step: replays must not instantiate graphs
  if args.backend == "cuda" and graph_instantiations() != graphs:
    print(f"process {me}: graphs were instantiated inside the loop: {graphs} -> {graph_instantiations()}", flush=True)
    return 1
  elapsed = time.perf_counter() - t0
  if args.release:
    args_now = (global_array(x, tokens), w_global, global_array(ids, tokens), global_array(wt, tokens))
    old = [step]  # the only reference left to the program traced before the release
    del step, y
    if not _release_and_reconnect(old, make_step, args_now, want):
      return 1
  print(f"OK {args.steps} steps in {elapsed:.1f} s", flush=True)
  return 0


def _release_and_reconnect(old: list, make_step, inputs, want) -> bool:
  """``--release``: the collective `gm.release_fused_workspaces` after the steps; where it released groups (the fused
  transport across processes) the program traced before must then refuse to run (naming the release), else it
  still runs; its runtimes go with it, and a program traced afresh (exchanging new workspaces) is bit-exact again
  on the last step's inputs."""
  import gc

  import jax

  import gcmoe_jax as gm
  from gcmoe_jax import ffi

  me = jax.process_index()
  released = gm.release_fused_workspaces()
  try:
    np.asarray(old[0](*inputs).addressable_shards[0].data)
    if released:
      print(f"process {me}: the program traced before the release still ran", flush=True)
      return False
    print(f"process {me}: released no groups (none across processes); the old program still runs", flush=True)
  except Exception as e:  # the FFI error surfaces as jax's runtime error
    if not released or "were released" not in str(e):
      raise
    print(f"process {me}: released {released} groups; the old program refused: {str(e).splitlines()[0][:160]}",
          flush=True)
  count = ffi.live_runtimes if released else (lambda: 0)  # (the CPU-only library has no CUDA runtime counter)
  before = count()
  old.clear()
  jax.clear_caches()
  gc.collect()
  after = count()
  if released and not after < before:
    print(f"process {me}: the old program's runtimes outlived it: {before} -> {after}", flush=True)
    return False
  y = make_step()(*inputs)
  for s in y.addressable_shards:
    if not np.array_equal(np.asarray(s.data).view(np.uint16), want[s.index].view(np.uint16)):
      print(f"process {me}: after the release shard {s.index[0].start or 0} MISMATCH", flush=True)
      return False
  print(f"process {me}: after the release: runtimes {before} -> {after} when the old program went, a new trace "
        f"bit-exact", flush=True)
  return True


def _exchange(args) -> int:
  """``--exchange N``: N exchanges of per-process random payloads, each checked against what every process sent
  (payloads are derived from (exchange, process)); process ``--fault-rank`` skips them all with ``--die-at 0``
  (then it only sleeps, alive, past the others' timeout)."""
  import jax

  from gcmoe_jax.sharding import _peers

  me, n = jax.process_index(), jax.process_count()
  if args.die_at == 0 and me == args.fault_rank:
    print(f"process {me}: not publishing", flush=True)
    time.sleep(2 * args.exchange_timeout_ms / 1000)
    return 0

  def payload(x: int, p: int) -> bytes:
    return np.random.default_rng([x, p]).bytes(8 + 8 * p)

  for x in range(args.exchange):
    got = _peers.exchange(f"test{x}", payload(x, me), timeout_ms=args.exchange_timeout_ms)
    if got != [payload(x, p) for p in range(n)]:
      print(f"process {me}: exchange {x} MISMATCH", flush=True)
      return 1
  print(f"EXCHANGE OK {args.exchange} x {n} processes", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
