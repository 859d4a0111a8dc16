"""The fused expert-parallel transport on one GPU with virtual ranks (issue 9, docs/fused_transport.md). Marked `gpu`.

R ranks, each with its own green-context pair of the GPU and its own workspace, run their three-role graphs at once;
role 1 pulls the rows its experts need from the peers' workspaces and role 2 returns every GEMM2 row into its
owner's. Every rank's output must equal the single-device oracle on the global inputs, bit for bit (each row's
math is the local operator's). Cubins: `python -m gcmoe_jax build-kernels --preset fused` (docs/kernels.md).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gcmoe_jax as gm
from conftest import SMALL, quantized
from gcmoe_jax import ffi, geometry, reference
from gcmoe_jax.bench import accuracy
from gcmoe_jax.bench.problems import CASE_FAMILIES, family_shape, make_problem
from gcmoe_jax.kernels import abi

pytestmark = pytest.mark.gpu

emulated = jax.jit(reference.moe_emulated, static_argnames=("clamp",))
CAPACITY = 16  # tokens per rank of the `fused` preset's variants


@pytest.fixture(autouse=True)
def _gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the default device is not one)")
  if not gm.api.backend_support()["cuda"].ok:
    pytest.skip(gm.api.backend_support()["cuda"].reason)


def _split(a, tokens):
  return np.split(np.asarray(a), np.cumsum(tokens)[:-1]) if len(tokens) > 1 else [np.asarray(a)]


def _case(family, ranks, tokens=None, *, base=SMALL, shared=None, seed=0):
  """(problem arrays, per-rank token counts): the family over E = 8 (or ``base``'s) global experts."""
  tokens = [6] * ranks if tokens is None else tokens
  shape = dataclasses.replace(base, tokens=sum(tokens), shared_intermediate=shared)
  if family_shape(family, shape).tokens == 0:
    tokens = [0] * ranks
  x, w, r = quantized(make_problem(family, shape, seed=seed))
  return x, w, r, tokens


def _check(name, ys, want, tokens):
  for rank, (y, wr) in enumerate(zip(ys, _split(want, tokens))):
    y, wr = np.asarray(y, np.float32), np.asarray(wr, np.float32)
    assert y.shape == wr.shape, f"{name} rank {rank}: shape {y.shape} != {wr.shape}"
    exact = float(np.mean(y.view(np.uint32) == wr.view(np.uint32))) if y.size else 1.0
    cos = accuracy.cosine(y, wr) if y.size and np.any(wr) else 1.0
    print(f"\n  {name} rank {rank} (T = {tokens[rank]}): cosine {cos:.9f}, bit-exact share {exact:.6f}")
    # Bit for bit, NaN payloads aside (the oracle's and the kernels' NaN bits may differ; their places may not).
    nan = np.isnan(wr)
    np.testing.assert_array_equal(np.isnan(y), nan, err_msg=f"{name} rank {rank}: NaN positions")
    np.testing.assert_array_equal(np.where(nan, 0, y).view(np.uint32), np.where(nan, 0, wr).view(np.uint32),
                                  err_msg=f"{name} rank {rank}")


def _run(x, w, r, tokens, ranks, clamp=10.0, **kw):
  with ffi.VirtualRanks(w, top_k=r.ids.shape[1], ranks=ranks, capacity=CAPACITY, tokens=tokens, clamp=clamp,
                        **kw) as vr:
    print(f"\n  partitions (dispatch, compute) per rank: {vr.partition.tolist()}")
    return vr(_split(x, tokens), _split(r.ids, tokens), _split(r.weights, tokens))


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("family", CASE_FAMILIES)
def test_every_case_family_on_virtual_ranks_equals_the_oracle(family, ranks, relay):
  """Both return paths; the pull cache is on where k >= R (k = 4, 8) and off where k < R (k = 1: the first- and
  last-expert families), `abi.pull_cache`."""
  x, w, r, tokens = _case(family, ranks, seed=ranks)
  ys = _run(x, w, r, tokens, ranks, relay=relay)
  cache = "on" if abi.pull_cache(r.ids.shape[1], ranks) else "off"
  _check(f"{family} R={ranks} {'relay' if relay else 'direct'} pull cache {cache}", ys,
         emulated(x, w, r.ids, r.weights, clamp=10.0), tokens)


@pytest.mark.parametrize("tokens", [[0, 7], [5, 0, 3, 0]], ids=["R2", "R4"])
def test_ranks_with_zero_tokens_still_take_part(tokens):
  """A rank with no tokens publishes an empty call and still computes its experts' rows for the others."""
  x, w, r, tokens = _case("default", len(tokens), tokens, seed=7)
  ys = _run(x, w, r, tokens, len(tokens), clamp=None)
  _check(f"tokens {tokens}", ys, emulated(x, w, r.ids, r.weights, clamp=None), tokens)


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
@pytest.mark.parametrize("tokens", [[1, 2], [2, 7], [2, 1, 2, 1]], ids=["R2", "R2-mixed", "R4"])
@pytest.mark.parametrize("family", ["default", "k_max", "first_expert"])
def test_tiny_batches_take_the_direct_scan(family, tokens, relay):
  """A rank with B <= 2 (`roles_v2.DIRECT_SCAN_TOKENS`) polls the peers from its role-1 block 0 alone, which
  opens a local gate with their T for the other CTAs; a rank with more tokens polls from every CTA. k_max: every
  route of a token is local to one rank (the packed routes hold k tags per token); first_expert: k = 1 < R, the
  pull cache off."""
  x, w, r, tokens = _case(family, len(tokens), tokens, seed=17)
  ys = _run(x, w, r, tokens, len(tokens), relay=relay)
  _check(f"{family} tokens {tokens} {'relay' if relay else 'direct'}", ys,
         emulated(x, w, r.ids, r.weights, clamp=10.0), tokens)


@pytest.mark.parametrize("hidden", [512, 640], ids=["pull-engine", "register-pulls"])
def test_both_pull_paths_equal_the_oracle(hidden):
  """H = 512: role 1's pull engine (bulk copies of a row's E4M3 codes and scale bytes into SMEM slots, the digit
  planes, exponent words and flag made on the receiving side); H = 640 (its H / 32 scale bytes are no multiple of
  16 B, so no bulk copy of them): the register-batched pulls of the planes. Rows with NaN, Inf, huge and tiny
  blocks (the flag's slow path) and ordinary ones."""
  from gcmoe_jax.ffi import _cuda
  from gcmoe_jax.kernels import build

  x, w, r, tokens = _case("default", 2, [7, 5], base=dataclasses.replace(SMALL, hidden=hidden), seed=29)
  x = np.asarray(x, np.float32)
  x[1, 5], x[2, 40], x[4, 100:132] = np.nan, -np.inf, 3e38  # a NaN block, an Inf block, a huge block
  x[8, 64:96] *= 1e-30  # a tiny block: its exponent word is outside abi.FAST_EXP
  x = jnp.asarray(x, jnp.bfloat16)
  with ffi.VirtualRanks(w, top_k=r.ids.shape[1], ranks=2, capacity=CAPACITY, tokens=tokens, clamp=10.0) as vr:
    role1 = build.load_or_build(_cuda.device_arch(jax.devices()[0]).reason, vr.variant).role(1)
    engine = role1["dynamic_smem"] > 8 * 1024
    assert engine == (hidden % 512 == 0), (hidden, role1)
    ys = vr(_split(x, tokens), _split(r.ids, tokens), _split(r.weights, tokens))
  _check(f"H={hidden} {'pull engine' if engine else 'register pulls'} (dispatch SMEM {role1['dynamic_smem']} B)",
         ys, emulated(x, w, r.ids, r.weights, clamp=10.0), tokens)


@pytest.mark.parametrize("tokens", [[9, 4], [10, 2]], ids=["one-token-tail", "two-token-group"])
def test_shared_expert_on_virtual_ranks(tokens):
  """A shared expert beside the fused transport; 9 and 10 tokens end in a group of one and two tokens, and a rank of
  2 tokens is one group of two (the shared items' halves, `roles_v2._sh_two_rows`)."""
  x, w, r, tokens = _case("zipf", 2, tokens, shared=256, seed=3)
  ys = _run(x, w, r, tokens, 2)
  _check("shared R=2", ys, emulated(x, w, r.ids, r.weights, clamp=10.0), tokens)


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
@pytest.mark.parametrize("model", sorted(geometry.MODELS))
def test_paper_models_scaled_to_two_virtual_ranks(model, relay):
  """Each rank holds the paper's per-rank expert count (L = E / 8), so the layer has 2 L experts; B = 16 per rank."""
  m = geometry.MODELS[model]
  base = dataclasses.replace(SMALL, experts=2 * (m.E // 8), hidden=m.H, intermediate=m.I, top_k=m.k)
  x, w, r, tokens = _case("default", 2, [16, 16], base=base, seed=5)
  ys = _run(x, w, r, tokens, 2, relay=relay)
  _check(f"{model} R=2 {'relay' if relay else 'direct'}", ys, emulated(x, w, r.ids, r.weights, clamp=10.0), tokens)


def test_1000_replays_with_fresh_inputs_stay_exact():
  """No reset between steps: epochs and the parity-double-buffered counters and publications carry the ranks from
  one step to the next; every 100th step is compared with the oracle."""
  ranks, tokens = 2, [6, 6]
  x, w, r, _ = _case("default", ranks, tokens, seed=11)
  key = jax.random.key(0)
  checked = 0
  with ffi.VirtualRanks(w, top_k=4, ranks=ranks, capacity=CAPACITY, tokens=tokens, clamp=10.0) as vr:
    for step in range(1000):
      kx, ki, kw, key = jax.random.split(key, 4)
      xs = jax.random.normal(kx, (sum(tokens), w.hidden), jnp.float32).astype(jnp.bfloat16)
      ids = jnp.argsort(jax.random.uniform(ki, (sum(tokens), w.num_experts)), axis=1)[:, :4].astype(jnp.int32)
      wt = jax.nn.softmax(jax.random.normal(kw, (sum(tokens), 4)), axis=1)
      ys = vr(_split(xs, tokens), _split(ids, tokens), _split(wt, tokens))
      if step % 100 == 99:
        want = _split(emulated(xs, w, ids, wt, clamp=10.0), tokens)
        for y, wr in zip(ys, want):
          np.testing.assert_array_equal(np.asarray(y).view(np.uint16), wr.view(np.uint16), err_msg=f"step {step}")
        checked += 1
  print(f"\n  1000 replays of R = {ranks}: {checked} checked bit-exact")


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_a_stalled_rank_makes_the_others_raise_and_the_next_call_recovers(monkeypatch, relay):
  """Rank 1 withholds one of its experts: its role 2 and every owner waiting for that expert's rows time out,
  and the run raises naming the ranks and the waits; with the stall lifted the next call is exact again."""
  monkeypatch.setenv("GCMOE_WAIT_TIMEOUT_MS", "200")
  ranks, tokens = 2, [6, 6]
  x, w, r, _ = _case("k_max", ranks, tokens, seed=13)  # k = E: every token routes to every expert
  xs, ids, wt = _split(x, tokens), _split(r.ids, tokens), _split(r.weights, tokens)
  with ffi.VirtualRanks(w, top_k=r.ids.shape[1], ranks=ranks, capacity=CAPACITY, tokens=tokens, clamp=10.0,
                        relay=relay) as vr:
    vr.stall(1, 0)
    with pytest.raises(RuntimeError) as info:
      vr(xs, ids, wt)
    print(f"\n  stalled rank 1: {info.value}")
    # Every rank's fault is in the message; rank 0's must be its wait for the rows rank 1 withholds.
    assert "rank 0: " in str(info.value) and "fused transport waited for the peers to return" in str(info.value), \
      str(info.value)
    vr.stall(1, -1)
    ys = vr(xs, ids, wt)
  _check("after the stall", ys, emulated(x, w, r.ids, r.weights, clamp=10.0), tokens)


def test_role2_starts_on_the_experts_published_while_one_is_withheld(monkeypatch):
  """Expert-granular publish (paper §4.5): rank 1 withholds its local expert 0, so its active queue never closes;
  its role 2 still runs every GEMM1 tile of the experts role 1 published (it streams the queue instead of waiting
  for its final size), and no GEMM2 tile (those need the closed queue). Rank 1's workspace, read back after the
  faulted call: each other expert completed its arrivals (every dispatch CTA's share and every row), was appended
  and counted published, and its GEMM1 tiles are all done."""
  from gcmoe_jax.ffi import _cuda

  monkeypatch.setenv("GCMOE_WAIT_TIMEOUT_MS", "200")
  ranks, tokens = 2, [6, 6]
  x, w, r, _ = _case("k_max", ranks, tokens, seed=23)  # k = E: every token routes to every expert
  xs, ids, wt = _split(x, tokens), _split(r.ids, tokens), _split(r.weights, tokens)
  with ffi.VirtualRanks(w, top_k=r.ids.shape[1], ranks=ranks, capacity=CAPACITY, tokens=tokens, clamp=10.0) as vr:
    vr.stall(1, 0)
    with pytest.raises(RuntimeError) as info:
      vr(xs, ids, wt)
    assert "rank 1: " in str(info.value), str(info.value)
    v = vr.variant
    ws = v.workspace()
    raw = _cuda.debug_read_workspace(0, ws.total)
    header = np.frombuffer(raw, np.uint32, abi.HEADER_BYTES // 4)
    assert header[abi.HEADER["rank"] // 4] == 1, "the workspace read back is not rank 1's"
    epoch = int(header[abi.HEADER["epoch"] // 4])
    args = (v.experts, v.capacity, v.shared)
    words = abi.counter_words(*args, ranks)
    counters = np.frombuffer(raw, np.uint32, words, ws.counters + 4 * words * (epoch & 1))
    at, arrive = abi.active_queue(*args, ranks), abi.arrivals(*args)
    appended, closed, entries = int(counters[at]), int(counters[at + 1]), counters[at + 2:at + 2 + v.experts]
    published = int(counters[abi.fused_counters(*args)[0]])
    j1 = 2 * v.intermediate // 128
    gemm1 = counters[:v.experts].tolist()
    print(f"\n  rank 1 withholding expert 0: queue {appended} appended, closed {closed}, entries "
          f"{(entries.astype(int) - 1).tolist()}, {published} published; GEMM1 tiles done per expert {gemm1} "
          f"(of {j1}); arrivals {counters[arrive:arrive + v.experts].tolist()}, claims "
          f"{counters[arrive + v.experts:arrive + 2 * v.experts].tolist()}")
    others = list(range(1, v.experts))
    assert closed == 0 and appended == published == len(others)
    assert sorted((entries[:appended].astype(int) - 1).tolist()) == others
    assert gemm1 == [0] + [j1] * len(others), gemm1
    complete = counters[arrive]
    assert complete % abi.ARRIVAL_CTA == 0 and (counters[arrive:arrive + v.experts] == complete).all()
    claims = counters[arrive + v.experts:arrive + 2 * v.experts]
    assert (claims == sum(tokens)).all(), claims  # every token of both ranks routes to every expert
    vr.stall(1, -1)
    ys = vr(xs, ids, wt)
  _check("after the withheld expert", ys, emulated(x, w, r.ids, r.weights, clamp=10.0), tokens)


@pytest.mark.parametrize("tokens", [[6, 6], [2, 2]], ids=["every-CTA-polls", "direct-scan"])
def test_a_rank_that_never_publishes_makes_the_others_raise_and_the_next_call_recovers(monkeypatch, tokens):
  """Rank 1 never publishes its call (`abi.STALL_CALL`): every rank's wait for it expires (with the direct scan,
  block 0's; the other CTAs wait on its gate and end on its fault) and the run raises naming rank 1; with the
  stall lifted the next call is exact again."""
  monkeypatch.setenv("GCMOE_WAIT_TIMEOUT_MS", "200")
  x, w, r, _ = _case("default", 2, tokens, seed=19)
  xs, ids, wt = _split(x, tokens), _split(r.ids, tokens), _split(r.weights, tokens)
  with ffi.VirtualRanks(w, top_k=r.ids.shape[1], ranks=2, capacity=CAPACITY, tokens=tokens, clamp=10.0) as vr:
    vr.stall(1, abi.STALL_CALL)
    with pytest.raises(RuntimeError) as info:
      vr(xs, ids, wt)
    print(f"\n  rank 1 withholding its call: {info.value}")
    assert "waited for rank 1 to publish this call" in str(info.value), str(info.value)
    vr.stall(1, -1)
    ys = vr(xs, ids, wt)
  _check(f"after the withheld call, tokens {tokens}", ys, emulated(x, w, r.ids, r.weights, clamp=10.0), tokens)


def test_two_processes_on_one_gpu_connect_their_workspaces_through_ipc():
  """The fused transport across processes: one rank per process under `jax.distributed`, each exporting its
  workspace's CUDA IPC handle through the key-value store and opening the other's (`ffi._cuda.connect_processes`),
  both processes on this one GPU with their own green contexts (the GPU time-slices the two processes' kernels, so
  the waits get 10 s). 20 steps of fresh inputs through `gm.moe(..., axis_name="ep", transport="fused")` inside
  `jax.shard_map`, every step bit-exact against the oracle. Cubins: `--preset fused` (512,256,8,4,8,r2)."""
  import ep_worker

  results = ep_worker.launch(2, "--steps", "20", "--transport", "fused", "--shared-intermediate", "0",
                             per_process=True, same_gpu=True, deadline_s=300, GCMOE_WAIT_TIMEOUT_MS="10000")
  for i, (rc, text) in enumerate(results):
    lines = [line for line in text.splitlines() if line.startswith(f"process {i}") or line.startswith("OK")]
    print(f"\n  process {i}: " + "\n  ".join(lines[:2] + lines[-2:]))
    assert rc == 0 and "OK 20 steps" in text, f"process {i} (rc {rc}):\n{ep_worker.tail(text)}"
    assert f"process {i}: peer groups ((" in text and text.count("bit-exact") == 20, ep_worker.tail(text)


def test_a_stalled_rank_in_another_process_makes_both_raise():
  """Across processes (one GPU, CUDA IPC): rank 1's role 1 withholds an expert that one of rank 0's tokens routes
  to, from step 2 on. That step's outputs come back NaN (rank 1's role 2 and rank 0's wait for its returned rows
  give up after 2 s), and a later call raises the recorded fault in both processes."""
  import re

  import ep_worker

  results = ep_worker.launch(2, "--steps", "6", "--stall-at", "2", "--fault-rank", "1", "--transport", "fused",
                             "--shared-intermediate", "0", "--heartbeat", "20", per_process=True, same_gpu=True,
                             deadline_s=240, GCMOE_WAIT_TIMEOUT_MS="2000")
  text = "\n".join(t for _, t in results)
  for i, (rc, t) in enumerate(results):
    print(f"\n  process {i}: rc {rc}: {ep_worker.tail(t, 3)}")
  assert re.search(r"step 2 shard \d+ NaN rows [1-9]", text), ep_worker.tail(text)
  assert re.search(r"fault was recorded on device 0: role 4, .*the fused transport waited for the peers to return "
                   r"this rank's rows", results[0][1]), ep_worker.tail(results[0][1])
  assert all(rc != 0 for rc, _ in results), "a rank finished all steps although rank 1 stalled"


def test_releasing_the_workspaces_across_processes_refuses_old_programs_and_a_new_trace_reconnects():
  """`gm.release_fused_workspaces` (collective) after 3 steps in each of two processes on one GPU: each process
  retires its group, the program traced before raises naming the release (XLA command buffers off, so the handler
  sees every call), its runtime goes with it (live runtimes drop), and a fresh trace exchanges new workspaces and is
  bit-exact on the last step's inputs."""
  import ep_worker

  results = ep_worker.launch(2, "--steps", "3", "--release", "--transport", "fused", "--shared-intermediate", "0",
                             per_process=True, same_gpu=True, deadline_s=300, GCMOE_WAIT_TIMEOUT_MS="10000",
                             XLA_FLAGS="--xla_gpu_enable_command_buffer=")
  for i, (rc, text) in enumerate(results):
    print(f"\n  process {i}: rc {rc}: " + "\n  ".join(l for l in text.splitlines() if "release" in l))
    assert rc == 0 and "OK 3 steps" in text, f"process {i}:\n{ep_worker.tail(text)}"
    assert "released 1 groups; the old program refused" in text and "a new trace bit-exact" in text, \
        ep_worker.tail(text)


@pytest.mark.parametrize("first_ms", ["120000", "2000"], ids=["first-call-bound", "plain-bound"])
def test_a_peer_process_that_starts_late_is_waited_for_in_its_first_call(first_ms):
  """Across processes (one GPU, CUDA IPC): process 1 starts its first step 6 s after process 0, three times the
  plain bound (GCMOE_WAIT_TIMEOUT_MS = 2000), as a slower compile would. The first call's waits have their own bound
  (GCMOE_FIRST_WAIT_TIMEOUT_MS, default 120 s; role 3 of that call restores the plain one), so both processes run 4
  bit-exact steps. The control: with that bound at 2 s, process 0's first call gives up on rank 1."""
  import ep_worker

  results = ep_worker.launch(2, "--steps", "4", "--first-call-skew", "6", "--transport", "fused",
                             "--shared-intermediate", "0", "--heartbeat", "30", per_process=True, same_gpu=True,
                             deadline_s=300, GCMOE_WAIT_TIMEOUT_MS="2000", GCMOE_FIRST_WAIT_TIMEOUT_MS=first_ms)
  for i, (rc, t) in enumerate(results):
    print(f"\n  process {i}: rc {rc}: {ep_worker.tail(t, 3)}")
  if first_ms == "2000":
    assert results[0][0] != 0 and "waited for rank 1 to publish this call" in results[0][1], \
        ep_worker.tail(results[0][1])
    return
  for i, (rc, text) in enumerate(results):
    assert rc == 0 and "OK 4 steps" in text and text.count("bit-exact") == 4, f"process {i}:\n{ep_worker.tail(text)}"
