"""The CUDA backend on a GPU: green contexts, the role graph, replay in XLA's stream (issue 5). Marked `gpu`.

Run on the GPU machine with cubins built on a CPU machine:
  GCMOE_CUBIN_DIR=.cubins python -m pytest -m gpu tests/test_cuda.py -q -s
The figures it prints (cosine, max abs difference, exact share) are the ones reported in docs/perf.md.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gcmoe_jax as gm
from conftest import SMALL, quantized
from gcmoe_jax import ffi, reference
from gcmoe_jax.bench import accuracy, sweep
from gcmoe_jax.bench.problems import CASE_FAMILIES, make_problem

pytestmark = pytest.mark.gpu


def _cuda_or_skip():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the default device is not one)")
  reasons = gm.api.backend_support()
  if not reasons["cuda"].ok:
    pytest.skip(reasons["cuda"].reason)


@pytest.fixture(autouse=True)
def _gpu():
  _cuda_or_skip()


emulated = jax.jit(reference.moe_emulated, static_argnames=("clamp",))


def _compare(name, y, want):
  y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
  assert y.shape == want.shape
  nan_y, nan_w = np.isnan(y), np.isnan(want)
  np.testing.assert_array_equal(nan_y, nan_w, err_msg=f"{name}: NaN positions differ")
  exact = float(np.mean(y.view(np.uint32) == want.view(np.uint32))) if y.size else 1.0
  diff = float(np.max(np.abs(np.where(nan_y, 0, y - want)))) if y.size else 0.0
  finite_w = np.where(nan_w, 0, want)
  cos = accuracy.cosine(np.where(nan_y, 0, y), finite_w) if y.size and np.any(finite_w) else 1.0
  print(f"\n  {name}: cosine {cos:.9f}, max |diff| {diff:.3g}, bit-exact share {exact:.6f}")
  assert cos >= 0.9999999, f"{name}: cosine {cos} < 0.9999999 (max abs diff {diff})"
  return exact


SMALL_GPU = dataclasses.replace(SMALL, tokens=12)  # capacity 16: the small prebuilt variants


@pytest.mark.parametrize("shared", [None, 32, 128], ids=["routed", "shared32", "shared128"])
@pytest.mark.parametrize("family", CASE_FAMILIES)
def test_matches_the_oracle_on_every_case_family(family, shared):
  shape = SMALL_GPU if shared is None else dataclasses.replace(SMALL_GPU, shared_intermediate=256,
                                                                  shared_group=shared)
  p = make_problem(family, shape, seed=21)
  x, w, r = quantized(p)
  for clamp in (p.shape.clamp, None):
    y = gm.moe(x, w, r, clamp=clamp, backend="cuda")
    y_jit = jax.jit(lambda x, w, r: gm.moe(x, w, r, clamp=clamp, backend="cuda"))(x, w, r)
    want = emulated(x, w, r.ids, r.weights, clamp=clamp)
    _compare(f"{family}/{shared}/clamp={clamp}", y, want)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(y_jit).view(np.uint16))


def test_a_shared_expert_of_an_odd_number_of_k128_tiles_matches_the_oracle():
  """Is = 384: the shared GEMM2's last K step holds one K128 tile, so half its block slots are skipped."""
  p = make_problem("default", dataclasses.replace(SMALL_GPU, shared_intermediate=384, shared_group=128), seed=8)
  x, w, r = quantized(p)
  y = gm.moe(x, w, r, clamp=p.shape.clamp, backend="cuda")
  want = emulated(x, w, r.ids, r.weights, clamp=p.shape.clamp)
  assert _compare("shared Is=384", y, want) == 1.0


@pytest.mark.parametrize("group", [32, 128])
def test_the_shared_experts_token_groups_of_the_wider_variants_and_their_tails_match_the_oracle(group):
  """Capacity 64 (two CTAs per SM, 32-row passes: `abi.PASS_TIERS`): token groups of 8; T = 33, 36, 37, 45 and 64
  end in a group of 1, 4, 5, 5 and 8 tokens. Capacity 256 (one CTA per SM): token groups of 16, two n-tiles per
  weight decode; T = 129, 131, 133, 141 and 144 end in a group of 1, 3, 5, 13 and 16 tokens (the one-token,
  one-n-tile and two-n-tile bodies)."""
  for tokens in (33, 36, 37, 45, 64, 129, 131, 133, 141, 144):
    shape = dataclasses.replace(SMALL, tokens=tokens, shared_intermediate=256, shared_group=group)
    p = make_problem("default", shape, seed=tokens)
    x, w, r = quantized(p)
    y = gm.moe(x, w, r, clamp=p.shape.clamp, backend="cuda")
    want = emulated(x, w, r.ids, r.weights, clamp=p.shape.clamp)
    assert _compare(f"shared g{group} T={tokens}", y, want) == 1.0


@pytest.mark.parametrize("group", [32, 128])
def test_the_shared_experts_groups_of_one_to_four_tokens_match_the_oracle_on_every_case_family(group):
  """T = 1, 2, 9 and 10 (groups of 1 and 2, and 8 + 1, 8 + 2): the halves' body (`roles_v2._sh_two_rows`, the
  tokens' digit planes in the columns of two n-tiles); T = 3, 4, 11 and 12: groups of three and four tokens in the
  one-n-tile body (`roles_v2._sh_tiles`, half its columns padding); on every case family, and with the last token
  scaled by 2**-110 (block exponents past `SH_FAST_EXP`: the two-multiplication path) or holding a NaN, bit for bit
  where the oracle is finite."""

  def check(name, x, w, r, clamp):
    y = np.asarray(gm.moe(x, w, r, clamp=clamp, backend="cuda"), np.float32)
    want = np.asarray(emulated(x, w, r.ids, r.weights, clamp=clamp), np.float32)
    _compare(name, y, want)
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(y[ok].view(np.uint32), want[ok].view(np.uint32), err_msg=name)

  for family in CASE_FAMILIES:
    for tokens in (1, 2, 3, 4, 9, 10, 11, 12):
      shape = dataclasses.replace(SMALL, tokens=tokens, shared_intermediate=256, shared_group=group)
      p = make_problem(family, shape, seed=50 + tokens)
      x, w, r = quantized(p)
      check(f"shared g{group} {family} T={tokens}", x, w, r, p.shape.clamp)
      if family == "default":
        tiny = x.at[-1].set((x[-1].astype(jnp.float32) * 2.0**-110).astype(x.dtype))
        check(f"shared g{group} tiny last token T={tokens}", tiny, w, r, p.shape.clamp)
        check(f"shared g{group} NaN last token T={tokens}", x.at[-1, 7].set(jnp.nan), w, r, p.shape.clamp)


@pytest.mark.parametrize("tokens", [1, 2])
def test_a_small_groups_gemm1_halves_meet_in_their_exchange(tokens):
  """A group of one or two tokens takes each shared GEMM1 column block in two items of 32 W13 rows, which meet in the
  block's exchange (`abi.Workspace.shx`, `roles_v2._shared_gemm1`): after a T = 1 or 2 call the output is the
  oracle's bit for bit and every block's tag is that call's epoch (both halves swapped it in). H = 640 leaves the
  halves' last K step one K128 tile of the four a step holds."""
  from gcmoe_jax.ffi import _cuda
  from gcmoe_jax.kernels import abi, build
  for hidden in (512, 640):
    shape = dataclasses.replace(SMALL, tokens=tokens, hidden=hidden, shared_intermediate=256, shared_group=32)
    x, w, r = quantized(make_problem("default", shape, seed=hidden + tokens))
    clamp = 6.0 + hidden / 1024 + tokens / 64  # a clamp of its own: the workspace read back is this test's runtime's
    step = jax.jit(lambda x, w=w, r=r, clamp=clamp: gm.moe(x, w, r, clamp=clamp, backend="cuda"))
    for call in range(3):  # the tags of the earlier calls must not be taken for this one's
      xi = x * (1.0 + call / 8)
      y = step(xi)
      want = emulated(xi, w, r.ids, r.weights, clamp=clamp)
      assert _compare(f"T={tokens} halves H={hidden} call {call}", y, want) == 1.0
    variant = build.Variant(hidden, shape.intermediate, shape.experts, shape.top_k, 8, 256, 32)
    ws = variant.workspace("v2")
    raw = _cuda.debug_read_workspace(0, ws.total)
    epoch = int(np.frombuffer(raw, np.uint32, 1)[0])
    n_cb = 256 // 32
    tags = np.frombuffer(raw, np.uint32, n_cb * abi.SHX_BYTES // 4, ws.shx)[:: abi.SHX_BYTES // 4]
    print(f"\n  T={tokens} H={hidden}: epoch {epoch}, exchange tags {tags.tolist()}")
    np.testing.assert_array_equal(tags, np.full(n_cb, epoch, np.uint32))


def test_nan_activation_poisons_only_its_token():
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=3))
  y = np.asarray(gm.moe(x.at[5, 7].set(jnp.nan), w, r, backend="cuda"), np.float32)
  assert np.isnan(y[5]).all() and np.isfinite(np.delete(y, 5, axis=0)).all()


def _deal(counts, shape=SMALL_GPU):
  """Expert ids [T, k] of ``shape`` under which expert e receives counts[e] rows (T k in all: 48 for SMALL_GPU)."""
  deal = [e for e in np.argsort(counts)[::-1] for _ in range(counts[e])]  # the busiest expert first
  ids = np.array(deal, np.int32).reshape(shape.top_k, shape.tokens).T  # token t: deal[t], deal[t + T], ...
  assert sorted(np.bincount(ids.ravel(), minlength=shape.experts)) == sorted(counts)
  return ids


def test_passes_of_every_body_match_the_oracle_on_the_fast_and_the_slow_path():
  """Experts hit by 1, 2, 3, 4, 5, 8, 12 and 13 rows: the one-, two- and four-row bodies (`roles_v2._stage`), the
  1-tile body with and without padding slots, and 2-tile passes; token 5 scaled by 2**50, so its blocks' exponents
  (GEMM1's, and GEMM2's after its SwiGLU) leave the fast path's range (`abi.FAST_EXP`) in passes of 4, 8, 12 and 13
  rows."""
  counts = (1, 2, 3, 4, 5, 8, 12, 13)
  ids = _deal(counts)
  p = make_problem("default", SMALL_GPU, seed=8)
  x, w, r = quantized(p)
  x = x.at[5].multiply(2.0**50)
  rw = jnp.asarray(np.random.default_rng(8).dirichlet(np.ones(SMALL_GPU.top_k), SMALL_GPU.tokens), jnp.float32)
  y = gm.moe(x, w, gm.Routes(jnp.asarray(ids), rw), backend="cuda")
  want = emulated(x, w, jnp.asarray(ids), rw, clamp=None)
  _compare("rows 1, 2, 3, 4, 5, 8, 12, 13", y, want)
  assert np.asarray(y[5], np.float32).any() and np.isfinite(np.asarray(y, np.float32)).all()


def test_one_and_two_row_gemm2_items_at_eight_tokens_match_the_oracle_bit_for_bit():
  """At 8 tokens (capacity 8: role 2 alone, and under `GCMOE_ABLATION=kbany` the GEMM2 items of one and two rows
  waiting per K128 block, one-row ones taking their stages out of K order) experts hit by 1, 1, 2, 2, 5, 5, 8 and 8
  rows, plain, with tokens 3 and 7 scaled by 2**50 (their blocks leave the fast path's exponent range: a two- and
  a one-row expert get a slow row), and with GEMM2's second K128 stage of every expert scaled by 2**-70 (its scale
  bytes leave the fast path's range), bit for bit."""
  shape = dataclasses.replace(SMALL_GPU, tokens=8)
  ids = jnp.asarray(_deal((1, 2, 5, 8, 8, 5, 2, 1), shape))
  p = make_problem("default", shape, seed=10)
  w2 = p.w2.copy()
  w2[:, 128:256] *= 2.0**-70
  x, w, _ = quantized(p)
  _, w_off, _ = quantized(dataclasses.replace(p, w2=w2))
  rw = jnp.asarray(np.random.default_rng(10).dirichlet(np.ones(shape.top_k), shape.tokens), jnp.float32)
  for name, xs, ws in (("plain", x, w), ("slow rows", x.at[jnp.array([3, 7])].multiply(2.0**50), w),
                       ("a weight stage off the fast path", x, w_off)):
    y = gm.moe(xs, ws, gm.Routes(ids, rw), backend="cuda")
    exact = _compare(f"8 tokens, rows 1-8, {name}", y, emulated(xs, ws, ids, rw, clamp=None))
    assert exact == 1.0 and np.isfinite(np.asarray(y, np.float32)).all()


def test_a_weight_stage_off_the_fast_path_matches_the_oracle_bit_for_bit():
  """GEMM1's first K128 stage and GEMM2's second of every expert scaled by 2**-70, so their scale bytes leave the
  fast path's [64, 191] (`roles_v2.SCALE_BYTE_BITS`) while the stage beside each stays inside: where two stages meet
  one CTA barrier they take one fast-path test (`roles_v2._compute`), so both run the slow path, which must give
  the same bits. Passes of 1, 2, 3-4, 5-8 and 9-16 rows."""
  p = make_problem("default", SMALL_GPU, seed=9)
  w13, w2 = p.w13.copy(), p.w2.copy()
  w13[:, :128] *= 2.0**-70
  w2[:, 128:256] *= 2.0**-70
  p = dataclasses.replace(p, w13=w13, w2=w2)
  x, w, _ = quantized(p)
  ids = jnp.asarray(_deal((1, 2, 3, 4, 5, 8, 12, 13)))
  rw = jnp.asarray(np.random.default_rng(9).dirichlet(np.ones(SMALL_GPU.top_k), SMALL_GPU.tokens), jnp.float32)
  y = gm.moe(x, w, gm.Routes(ids, rw), backend="cuda")
  exact = _compare("weight stages off the fast path", y, emulated(x, w, ids, rw, clamp=None))
  assert exact == 1.0


@pytest.mark.parametrize("tokens, counts", [(64, (17, 20, 24, 30, 32, 40, 45, 48)),
                                            (256, (20, 60, 64, 100, 130, 150, 200, 300))])
def test_wide_passes_match_the_oracle_bit_for_bit_on_the_fast_and_the_slow_path(tokens, counts):
  """Passes of 17-64 rows (3- to 8-tile bodies, more than one pass per expert past 32 or 64 rows) at capacity 64
  (two CTAs per SM) and 256 (one), with token 5 scaled by 2**50 (its rows leave the fast path), a NaN in token 9
  (its outputs alone NaN) and then every case family: bit for bit."""
  shape = dataclasses.replace(SMALL, tokens=tokens)
  ids = jnp.asarray(_deal(counts, shape))
  x, w, _ = quantized(make_problem("default", shape, seed=tokens))
  x = x.at[5].multiply(2.0**50).at[9, 3].set(jnp.nan)
  rw = jnp.asarray(np.random.default_rng(tokens).dirichlet(np.ones(shape.top_k), tokens), jnp.float32)
  y = np.asarray(gm.moe(x, w, gm.Routes(ids, rw), backend="cuda"), np.float32)
  want = np.asarray(emulated(x, w, ids, rw, clamp=None), np.float32)
  _compare(f"wide passes T={tokens}", y, want)
  assert np.isnan(y[9]).all() and np.isfinite(np.delete(y, 9, axis=0)).all() and y[5].any()
  ok = ~np.isnan(want)
  np.testing.assert_array_equal(y[ok].view(np.uint32), want[ok].view(np.uint32))
  for family in CASE_FAMILIES:
    p = make_problem(family, shape, seed=tokens + 1)
    x, w, r = quantized(p)
    y = gm.moe(x, w, r, clamp=p.shape.clamp, backend="cuda")
    assert _compare(f"wide passes {family} T={tokens}", y, emulated(x, w, r.ids, r.weights,
                                                                      clamp=p.shape.clamp)) == 1.0


@pytest.mark.parametrize("tokens", [12, 64, 256])
def test_one_rows_weight_stage_off_the_fast_path_matches_the_oracle_bit_for_bit(tokens):
  """W13 column 3 of every expert scaled by 2**-70 in its first K128 block only, and W2 column 70 in its second: in
  those stages the threads that hold that weight row take the slow path and the other threads of their warp (and
  warpgroup) the fast one, a test each thread makes for its own rows; the warp votes (`roles_v2._compute`: the
  stage's bodies hold mma.sync.aligned; before session 33 the T = 12 case did not finish in 200 s on the H200).
  Bit for bit, in narrow passes (T = 12) and wide ones (T = 64, 256)."""
  shape = dataclasses.replace(SMALL, tokens=tokens)
  p = make_problem("default", shape, seed=70 + tokens)
  w13, w2 = p.w13.copy(), p.w2.copy()
  w13[:, :128, 3] *= 2.0**-70
  w2[:, 128:256, 70] *= 2.0**-70
  x, w, r = quantized(dataclasses.replace(p, w13=w13, w2=w2))
  y = gm.moe(x, w, r, clamp=p.shape.clamp, backend="cuda")
  want = emulated(x, w, r.ids, r.weights, clamp=p.shape.clamp)
  assert _compare(f"one row's weight stage off the fast path, T={tokens}", y, want) == 1.0


@pytest.mark.parametrize("k", [1, 4, 8])
def test_role2_lists_the_routes_itself_up_to_eight_tokens(k):
  """Up to `abi.SCAN_TOKENS` = 8 tokens (64 assignments) every role-2 CTA lists the routes itself
  (`_scan_routes`: assignments 32.. in a lane's second word) instead of reading role 1's closed queue: T = 1..9 (at
  9 the queue again), every token routed to expert 7 too, the last one twice and token 0 with a padding route,
  routed and with the shared expert; bit-exact."""
  for shared in (None, 32):
    for tokens in range(1, 10):
      shape = dataclasses.replace(SMALL, tokens=tokens, top_k=k, shared_intermediate=256 if shared else None,
                                  shared_group=shared or 128)
      x, w, r = quantized(make_problem("default", shape, seed=40 + 5 * k + tokens))
      ids = np.asarray(r.ids).copy()
      ids[:, -1] = 7
      if k > 1:
        ids[-1, 0] = 7
        if tokens > 1:
          ids[0, 0] = -1
      ids = jnp.asarray(ids)
      y = gm.moe(x, w, gm.Routes(ids, r.weights), backend="cuda")
      exact = _compare(f"k={k} T={tokens} shared={shared}", y, emulated(x, w, ids, r.weights, clamp=None))
      assert exact == 1.0


def test_up_to_eight_tokens_role2_does_not_wait_for_role1s_queue(monkeypatch):
  """Role 1 withholds an expert hit (the test hook), so its active queue never closes: at T = 3 and 7 role 2 lists
  the routes itself (and runs alone: role 1 is not in the graph) and the call is exact; at T = 9 role 2 waits for
  the queue and the call raises its timeout."""
  monkeypatch.setenv("GCMOE_SYNC_CHECK", "1")
  monkeypatch.setenv("GCMOE_WAIT_TIMEOUT_MS", "50")
  for tokens in (3, 7, 9):
    shape = dataclasses.replace(SMALL, tokens=tokens)
    x, w, r = quantized(make_problem("default", shape, seed=60 + tokens))
    stalled = int(np.asarray(r.ids)[1, 0])
    clamp = 5.5 + tokens / 64  # a clamp of its own: this test's runtime, with the short timeout
    step = jax.jit(lambda x, w, r, clamp=clamp: gm.moe(x, w, r, clamp=clamp, backend="cuda"))
    ffi.debug_set_stall_expert(stalled)
    try:
      if tokens < 9:
        y = step(x, w, r)
        assert _compare(f"T={tokens}, role 1 stalled", y, emulated(x, w, r.ids, r.weights, clamp=clamp)) == 1.0
      else:
        with pytest.raises(Exception, match=rf"role 2, block \d+, epoch \d+, counter {stalled}, .*spin-wait exceeded"):
          step(x, w, r).block_until_ready()
    finally:
      ffi.debug_set_stall_expert(-1)


@pytest.mark.parametrize("shared", [None, 32], ids=["routed", "shared32"])
def test_up_to_eight_tokens_role3_runs_beside_role2(shared, monkeypatch):
  """One GPU, up to `abi.FINALIZE_EARLY_TOKENS` tokens, where role 2 does not run alone (here ``GCMOE_SOLO=0``; by
  default it does up to `abi.scan_tokens`, see the next test): the runtime puts role 3 on the dispatch partition
  after role 1, where it waits for role 2's CTAs (``HEADER["role2_grid"]``, `abi.role2_done`) instead of following
  role 2 in the graph; above, after role 2, waiting for nothing. Three calls each at T = 1, 8 (beside) and 9
  (after): all bit-exact, the epoch advanced by each, and in the last call's counters every role-2 CTA counted
  itself done and (beside) every role-3 CTA, one per token, counted itself in."""
  from gcmoe_jax.ffi import _cuda
  from gcmoe_jax.kernels import abi, build
  monkeypatch.setenv("GCMOE_SOLO", "0")
  monkeypatch.setenv("GCMOE_GRAPH_CONTEXT", "green")  # (on the stream's context role 3 follows role 2: the test below)
  for tokens in (1, 8, 9):
    shape = dataclasses.replace(SMALL, tokens=tokens, shared_intermediate=256 if shared else None,
                                shared_group=shared or 128)
    x, w, r = quantized(make_problem("default", shape, seed=70 + tokens))
    clamp = 9.5 + tokens / 64 + (1 / 128 if shared else 0)  # a runtime of its own: its workspace is read below
    step = jax.jit(lambda x, w, r, clamp=clamp: gm.moe(x, w, r, clamp=clamp, backend="cuda"))
    want = np.asarray(emulated(x, w, r.ids, r.weights, clamp=clamp)).view(np.uint16)
    variant = build.Variant(shape.hidden, shape.intermediate, shape.experts, shape.top_k, 8 if tokens <= 8 else 16,
                            256 if shared else None, shared)
    ws = variant.workspace("v2")
    epochs = []
    for _ in range(3):
      y = step(x, w, r)
      np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want, err_msg=f"T={tokens} shared={shared}")
      raw = _cuda.debug_read_workspace(0, ws.total)
      header = np.frombuffer(raw, np.uint32, abi.HEADER_BYTES // 4)
      epochs.append(int(header[abi.HEADER["epoch"] // 4]))
    grid2 = int(header[abi.HEADER["role2_grid"] // 4])
    assert header[abi.HEADER["solo"] // 4] == 0
    args = (variant.experts, variant.capacity, variant.shared)
    words, at = abi.counter_words(*args), abi.role2_done(*args)
    last = np.frombuffer(raw, np.uint32, words, ws.counters + 4 * words * (epochs[-1] & 1))
    print(f"\n  T={tokens} shared={shared}: epochs {epochs}, role2_grid {grid2}, role 2 CTAs done {last[at]}, "
          f"role 3 CTAs in {last[at + 1]}")
    assert epochs[1:] == [epochs[0] + 1, epochs[0] + 2]
    if tokens <= abi.FINALIZE_EARLY_TOKENS:
      assert grid2 > 0 and last[at] == grid2 and last[at + 1] == tokens
    else:
      assert grid2 == 0 and last[at] > 0 and last[at + 1] == 0


def _exact_rotating_calls(shape, clamp, seed, calls, label):
  """``calls`` jitted CUDA calls of one layer (`shape`, with its shared expert if it has one) over three rotating
  inputs (seeds ``seed`` .. ``seed + 2``: a stale y would show), each bit-exact to the oracle. Returns the jitted
  step, the inputs (x, routes, the oracle's y as uint16), the kernel variant, its workspace layout, the last call's
  workspace bytes and the epoch read after each call."""
  from gcmoe_jax.ffi import _cuda
  from gcmoe_jax.kernels import abi, build
  problems = [quantized(make_problem("default", shape, seed=seed + i)) for i in range(3)]
  w0 = problems[0][1]  # one layer's weights, three inputs
  inputs = [(x, r, np.asarray(emulated(x, w0, r.ids, r.weights, clamp=clamp)).view(np.uint16))
            for x, _, r in problems]
  step = jax.jit(lambda x, r: gm.moe(x, w0, r, clamp=clamp, backend="cuda"))
  shared = shape.shared_group if shape.shared_intermediate else None
  variant = build.Variant(shape.hidden, shape.intermediate, shape.experts, shape.top_k,
                          _cuda.capacity_for(shape.tokens), shape.shared_intermediate, shared)
  ws = variant.workspace("v2")
  epochs = []
  for n in range(calls):
    x, r, want = inputs[n % 3]
    y = step(x, r)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want, err_msg=f"{label} call {n}")
    raw = _cuda.debug_read_workspace(0, ws.total)
    epochs.append(int(np.frombuffer(raw, np.uint32, abi.HEADER_BYTES // 4)[abi.HEADER["epoch"] // 4]))
  return step, inputs, variant, ws, raw, epochs


@pytest.mark.parametrize("shared", [None, 32], ids=["routed", "shared32"])
def test_up_to_eight_tokens_role2_runs_alone(shared, monkeypatch):
  """One GPU, up to `abi.scan_tokens` tokens: the graph holds role 2 alone (`abi.TOKENS_SOLO`); its CTAs list the
  routes and `abi.solo_ctas` more CTAs, beyond its item grid, check the ids and combine y. At T = 1, 5 and 8 (and
  T = 9, where roles 1 and 3 run): 12 calls each over three rotating inputs (a stale y would show), every one
  bit-exact; the epoch advanced by one per call; in the last call's counters every combining CTA counted itself in
  (beside role 2, every role-3 CTA); an id >= E under ``jit`` raises naming it and the next call is exact again;
  with ``GCMOE_SOLO_SMS=all`` (role 2 alone over every SM) the same at T = 1, 5, 8, with more item CTAs than on the
  compute partition; and with ``GCMOE_SOLO=0`` the graph has all three roles again, exact."""
  from gcmoe_jax.kernels import abi
  monkeypatch.setenv("GCMOE_SYNC_CHECK", "1")
  # With ``GCMOE_SOLO=0`` and T <= `abi.FINALIZE_EARLY_TOKENS` role 3 runs beside role 2 on the green contexts (on the
  # stream's own context after it: `test_three_role_graph_on_the_stream_context_is_exact`).
  monkeypatch.setenv("GCMOE_GRAPH_CONTEXT", "green")
  items_done = {}
  for solo_env, sms, tokens_list in (("1", "compute", (1, 5, 8, 9)), ("1", "all", (1, 5, 8)), ("0", "compute", (2,))):
    monkeypatch.setenv("GCMOE_SOLO", solo_env)
    monkeypatch.setenv("GCMOE_SOLO_SMS", sms)
    for tokens in tokens_list:
      shape = dataclasses.replace(SMALL, tokens=tokens, shared_intermediate=256 if shared else None,
                                  shared_group=shared or 128)
      # A clamp of its own: the runtime (and so the workspace read back) is this loop's, not a cached one.
      clamp = (11.5 + tokens / 64 + (1 / 128 if shared else 0) + (1 / 256 if solo_env == "0" else 0)
               + (1 / 512 if sms == "all" else 0))
      step, inputs, variant, ws, raw, epochs = _exact_rotating_calls(shape, clamp, 90 + 7 * tokens, 12,
                                                                     f"T={tokens}")
      header = np.frombuffer(raw, np.uint32, abi.HEADER_BYTES // 4)
      alone = solo_env == "1" and tokens <= abi.scan_tokens(shape.top_k, variant.capacity)
      combining = int(header[abi.HEADER["solo"] // 4])
      args = (variant.experts, variant.capacity, variant.shared)
      words, at = abi.counter_words(*args), abi.role2_done(*args)
      last = np.frombuffer(raw, np.uint32, words, ws.counters + 4 * words * (epochs[-1] & 1))
      print(f"\n  T={tokens} GCMOE_SOLO={solo_env} GCMOE_SOLO_SMS={sms}: epochs {epochs[0]}..{epochs[-1]}, combining "
            f"CTAs {combining}, item CTAs done {last[at]}, combining CTAs in {last[at + 1]}")
      assert epochs == list(range(epochs[0], epochs[0] + 12))
      assert combining == (abi.solo_ctas(shape.hidden, tokens) if alone else 0)
      beside = not alone and tokens <= abi.FINALIZE_EARLY_TOKENS
      assert last[at] > 0 and last[at + 1] == (combining if alone else tokens if beside else 0)
      items_done[sms, tokens] = int(last[at])
      if sms == "all":  # the item grid scaled from the compute partition's SMs to the device's
        assert items_done["all", tokens] > items_done["compute", tokens], items_done
      if alone and tokens == 5:
        bad = inputs[0][1].ids.at[1, 0].set(shape.experts + 91)
        with pytest.raises(Exception, match=rf"role 1 read expert id {shape.experts + 91}"):
          step(inputs[0][0], gm.Routes(bad, inputs[0][1].weights)).block_until_ready()
        y = step(inputs[1][0], inputs[1][1])
        np.testing.assert_array_equal(np.asarray(y).view(np.uint16), inputs[1][2], err_msg="after the fault")


@pytest.mark.parametrize("shared", [None, 128], ids=["routed", "shared128"])
def test_three_role_graph_on_the_stream_context_is_exact(shared, monkeypatch):
  """``GCMOE_GRAPH_CONTEXT=stream``: the graph of roles 1-3 on the stream's own context instead of the green ones
  (role 2's grid still the compute partition's; the runtime counts that role 1 fits beside it). At T = 12, 40 and
  200 (capacities 16, 64, 256) against the green contexts: 6 calls each over three rotating inputs, every one
  bit-exact to the oracle, the epoch advancing by one per call; and at T = 5 with ``GCMOE_SOLO=0``, where on the
  green contexts role 3 runs beside role 2 (every role-3 CTA counts itself in), on the stream's context it runs
  after role 2 (none does): the setting reached the runtime."""
  from gcmoe_jax.kernels import abi
  monkeypatch.setenv("GCMOE_SYNC_CHECK", "1")
  for where in ("green", "stream"):
    monkeypatch.setenv("GCMOE_GRAPH_CONTEXT", where)
    for tokens in (5, 12, 40, 200):
      monkeypatch.setenv("GCMOE_SOLO", "0" if tokens == 5 else "1")
      shape = dataclasses.replace(SMALL, tokens=tokens, shared_intermediate=256 if shared else None,
                                  shared_group=shared or 128)
      # A clamp of its own: the runtime (and so the workspace read back) is this loop's, not a cached one.
      clamp = 10.25 + tokens / 1024 + (1 / 128 if shared else 0) + (1 / 512 if where == "stream" else 0)
      _, _, variant, ws, raw, epochs = _exact_rotating_calls(shape, clamp, 170 + 5 * tokens, 6,
                                                             f"{where} T={tokens}")
      header = np.frombuffer(raw, np.uint32, abi.HEADER_BYTES // 4)
      assert epochs == list(range(epochs[0], epochs[0] + 6)), (where, tokens, epochs)
      assert int(header[abi.HEADER["solo"] // 4]) == 0
      if tokens == 5:
        args = (variant.experts, variant.capacity, variant.shared)
        words, at = abi.counter_words(*args), abi.role2_done(*args)
        last = np.frombuffer(raw, np.uint32, words, ws.counters + 4 * words * (epochs[-1] & 1))
        print(f"\n  GCMOE_GRAPH_CONTEXT={where} T=5 GCMOE_SOLO=0: role-3 CTAs beside role 2 {last[at + 1]}")
        assert last[at + 1] == (tokens if where == "green" else 0)


_KPAIR_CHECK = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import gcmoe_jax as gm
from gcmoe_jax import reference
from gcmoe_jax.bench import sweep
from gcmoe_jax.kernels import build

emulated = jax.jit(reference.moe_emulated, static_argnames=("clamp",))
rng = np.random.default_rng(5)
small = (512, 256, 8, 4)  # (H, I, E, k)
cases = [(f"small T={t}", small, np.argsort(rng.random((t, 8)), axis=1)[:, :4]) for t in (1, 2, 3)]
cases.append(("small T=2, expert 0 in both", small, np.array([[0, 1, 2, 3], [0, 4, 5, 6]])))
cases.append(("small T=2, expert 1 three times", small, np.array([[1, 1, 1, 2], [3, 4, 5, 6]])))
for model in ("glm5.2", "dsv4.1-flash"):
  s = sweep.model_shape(model)
  for t in (1, 2):
    ids = np.argsort(rng.random((t, s.experts)), axis=1)[:, :s.top_k]
    ids[-1, 0] = ids[0, 0]  # at T = 2 one expert takes both tokens (the two-row body)
    cases.append((f"{model} T={t}", (s.hidden, s.intermediate, s.experts, s.top_k), ids))
try:
  for shape in {shape for _, shape, _ in cases}:
    build.load_or_build("sm_90a", build.Variant(*shape, 8))
except build.BuildError as e:
  print(f"MISSING: {e}")
  sys.exit(3)
bad = 0
weights = {}
for name, (h, i, e, k), ids in cases:
  if (h, i, e, k) not in weights:
    weights.clear()  # one shape's weights at a time
    k1, k2 = jax.random.split(jax.random.key(h + e))
    weights[h, i, e, k] = gm.quantize_experts(jax.random.normal(k1, (e, h, 2 * i)) / np.sqrt(h),
                                              jax.random.normal(k2, (e, i, h)) / np.sqrt(i))
  w = weights[h, i, e, k]
  t = ids.shape[0]
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  rw = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
  r = gm.Routes(jnp.asarray(ids, jnp.int32), rw)
  y = np.asarray(gm.moe(x, w, r, clamp=10.0, backend="cuda")).view(np.uint16)
  want = np.asarray(emulated(x, w, r.ids, rw, clamp=10.0)).view(np.uint16)
  same = float(np.mean(y == want))
  print(f"{name}: bit-exact share {same:.6f}")
  bad += same != 1.0
sys.exit(1 if bad else 0)
"""


def test_the_kpair_build_matches_the_oracle_bit_for_bit():
  """``GCMOE_ABLATION=kpair`` (docs/kernels_v2.md "Item balance": GEMM2 items of 64 rows with K split between warp
  pairs at up to 2 tokens, routed variants) gives the oracle's bits: the small shape at T = 1, 2 (one expert in both
  tokens: the two-row body) and 3 (normal items), T = 2 with an expert of three rows (normal items in that build),
  and both paper shapes at T = 1 and 2. In a process of its own (a registered variant is cached per process,
  whatever the build); skipped unless ``GCMOE_CUBIN_DIR`` holds that build's cubins (``GCMOE_ABLATION=kpair python
  -m gcmoe_jax build-kernels --variant ...`` of the T8 variants)."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, GCMOE_ABLATION="kpair", PYTHONWARNINGS="ignore::RuntimeWarning")
  run = subprocess.run([sys.executable, "-c", _KPAIR_CHECK], env=env, capture_output=True, text=True, timeout=900)
  print(run.stdout)
  if run.returncode == 3:
    pytest.skip(run.stdout.strip().splitlines()[-1][:300])
  assert run.returncode == 0, run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("ablation", ["", "bf16one", "bf16two"])
def test_the_bf16_wide_passes_meet_the_cosine_bar(ablation):
  """The routed wide passes on BF16 wgmma (`abi.bf16_passes`, docs/kernels_v2.md "Session 59": the block scales
  folded in, each K32 block summed on its own; by default two block sums in flight at one CTA per SM and one at two,
  ``GCMOE_ABLATION=bf16one`` / ``bf16two`` one / two everywhere) against the oracle at the numerics bar (cosine
  >= 0.9999999, NaN where it has NaN): passes of 17-64 rows at capacity 64 (two CTAs per SM) and 17-300 rows at 256
  (one), a token scaled by 2**50 (its passes' int8 body) and a NaN, every case family at T = 64 and 256, and the
  paper shapes at B = 64-256; and every weight scaled by 2**8 (scale bytes past the fold: each wide pass runs its
  int8 body again), bit for bit. In a process of its own; skipped unless ``GCMOE_CUBIN_DIR`` holds the build's
  cubins (``[GCMOE_ABLATION=bf16one] python -m gcmoe_jax build-kernels --variant ...``)."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, GCMOE_ABLATION=ablation, PYTHONWARNINGS="ignore::RuntimeWarning")
  run = subprocess.run([sys.executable, "-c", _BF16_CHECK, os.path.dirname(os.path.abspath(__file__))], env=env,
                       capture_output=True, text=True, timeout=900)
  print(f"GCMOE_ABLATION={ablation}:\n{run.stdout}")
  if run.returncode == 3:
    pytest.skip(run.stdout.strip().splitlines()[-1][:300])
  assert run.returncode == 0, run.stdout + run.stderr[-3000:]


_BF16_CHECK = r"""
import dataclasses, sys
sys.path.insert(0, sys.argv[1])  # (tests/: this file's `_compare` and `_deal`, conftest's SMALL)
import jax, jax.numpy as jnp, numpy as np
import gcmoe_jax as gm
from conftest import SMALL
from gcmoe_jax.bench import sweep
from gcmoe_jax.bench.problems import CASE_FAMILIES, make_problem
from gcmoe_jax.kernels import build
from test_cuda import _compare, _deal, emulated

small = dataclasses.replace(SMALL, tokens=64)
try:
  for k, cap in ((1, 64), (4, 64), (8, 64), (1, 256), (4, 256), (8, 256)):
    build.load_or_build("sm_90a", build.Variant(small.hidden, small.intermediate, small.experts, k, cap))
  for model, caps in (("glm5.2", (64, 128, 256)), ("dsv4.1-flash", (128, 256))):
    s = sweep.model_shape(model)
    for cap in caps:
      build.load_or_build("sm_90a", build.Variant(s.hidden, s.intermediate, s.experts, s.top_k, cap))
except build.BuildError as e:
  print(f"MISSING: {e}")
  sys.exit(3)
bad = 0

def check(name, x, w, ids, rw, clamp=None, exact_only=False):
  # (every case runs, so that a failing build shows them all)
  global bad
  y = gm.moe(x, w, gm.Routes(ids, rw), clamp=clamp, backend="cuda")
  try:
    exact = _compare(name, y, emulated(x, w, ids, rw, clamp=clamp))
    assert exact == 1.0 or not exact_only, f"{name}: bit-exact share {exact} < 1"
  except AssertionError as e:
    print(f"FAIL: {e}", flush=True)
    bad += 1

for tokens, counts in ((64, (17, 20, 24, 30, 32, 40, 45, 48)), (256, (20, 60, 64, 100, 130, 150, 200, 300))):
  shape = dataclasses.replace(small, tokens=tokens)
  p = make_problem("default", shape, seed=tokens)
  x, ids = jnp.asarray(p.x, jnp.bfloat16), jnp.asarray(_deal(counts, shape))
  w = gm.quantize_experts(p.w13, p.w2)
  rw = jnp.asarray(np.random.default_rng(tokens).dirichlet(np.ones(shape.top_k), tokens), jnp.float32)
  check(f"rows {counts[0]}-{counts[-1]} T={tokens}", x, w, ids, rw)
  check(f"T={tokens}, token 5 x 2**50, a NaN in token 9", x.at[5].multiply(2.0**50).at[9, 3].set(jnp.nan), w, ids, rw)
  w_big = gm.quantize_experts(p.w13 * 2.0**8, p.w2 * 2.0**8)
  check(f"T={tokens}, every weight scale byte past the fold (int8 again)", x, w_big, ids, rw, exact_only=True)
  for family in CASE_FAMILIES:
    q = make_problem(family, shape, seed=tokens + 1)
    wq = gm.quantize_experts(q.w13, q.w2)
    check(f"{family} T={tokens}", jnp.asarray(q.x, jnp.bfloat16), wq, jnp.asarray(q.ids), jnp.asarray(q.weights),
          clamp=q.shape.clamp)
rng = np.random.default_rng(59)
for model, batches in (("glm5.2", (64, 100, 256)), ("dsv4.1-flash", (128, 256))):
  s = sweep.model_shape(model)
  h, i, e, k = s.hidden, s.intermediate, s.experts, s.top_k
  k1, k2 = jax.random.split(jax.random.key(h + e))
  w = gm.quantize_experts(jax.random.normal(k1, (e, h, 2 * i)) / np.sqrt(h),
                          jax.random.normal(k2, (e, i, h)) / np.sqrt(i))
  for b in batches:
    x = jnp.asarray(rng.standard_normal((b, h)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((b, e)), axis=1)[:, :k], jnp.int32)
    rw = jnp.asarray(rng.dirichlet(np.ones(k), b), jnp.float32)
    check(f"{model} B={b}", x, w, ids, rw, clamp=10.0)
  del w
sys.exit(1 if bad else 0)
"""


def test_the_shared_bf16_groups_meet_the_cosine_bar():
  """``GCMOE_ABLATION=shbf16`` (`abi.shared_bf16`, docs/kernels_v2.md "Session 61"): the shared expert's token
  groups of 8 and 16 on BF16 wgmma, the weight scale applied to each block's sum, against the oracle at the numerics
  bar (cosine >= 0.9999999, NaN where it has NaN): the small shape's groups of 8 (capacity 16, 64) and 16 (256)
  with their tails, every case family, a token scaled by 2**-110 (flagged: its group on the digit MMAs) or holding
  a NaN, the shared weights scaled by 2**-110 (the two-multiplication scaling of each sum) and 2**8, and the paper
  shapes with their shared expert at B = 8-256; there not every bit is the digits' (the BF16 groups ran). In a
  process of its own; skipped unless ``GCMOE_CUBIN_DIR`` holds the build's cubins (``GCMOE_ABLATION=shbf16 python
  -m gcmoe_jax build-kernels --variant ...``)."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, GCMOE_ABLATION="shbf16", PYTHONWARNINGS="ignore::RuntimeWarning")
  run = subprocess.run([sys.executable, "-c", _SHARED_BF16_CHECK, os.path.dirname(os.path.abspath(__file__))],
                       env=env, capture_output=True, text=True, timeout=900)
  print(run.stdout)
  if run.returncode == 3:
    pytest.skip(run.stdout.strip().splitlines()[-1][:300])
  assert run.returncode == 0, run.stdout + run.stderr[-3000:]


_SHARED_BF16_CHECK = r"""
import dataclasses, sys
sys.path.insert(0, sys.argv[1])  # (tests/: this file's `_compare`, conftest's SMALL and `quantized`)
import jax, jax.numpy as jnp, numpy as np
import gcmoe_jax as gm
from conftest import SMALL, quantized
from gcmoe_jax import formats
from gcmoe_jax.bench import sweep
from gcmoe_jax.bench.problems import CASE_FAMILIES, make_problem
from gcmoe_jax.kernels import build
from test_cuda import _compare, emulated

try:
  for cap in (16, 64, 256):
    for group in (32, 128):
      build.load_or_build("sm_90a", build.Variant(SMALL.hidden, SMALL.intermediate, SMALL.experts, SMALL.top_k, cap,
                                                  256, group))
  for model, caps in (("glm5.2", (8, 16, 64, 256)), ("dsv4.1-flash", (16, 128, 256))):
    s = sweep.model_shape(model, shared=True)
    for cap in caps:
      build.load_or_build("sm_90a", build.Variant(s.hidden, s.intermediate, s.experts, s.top_k, cap,
                                                  s.shared_intermediate, s.shared_group))
except build.BuildError as e:
  print(f"MISSING: {e}")
  sys.exit(3)
bad = 0

def check(name, x, w, r, clamp):
  # (every case runs, so that a failing build shows them all)
  global bad
  y = gm.moe(x, w, r, clamp=clamp, backend="cuda")
  try:
    return _compare(name, y, emulated(x, w, r.ids, r.weights, clamp=clamp))
  except AssertionError as e:
    print(f"FAIL: {e}", flush=True)
    bad += 1
    return 1.0

for group in (32, 128):
  for tokens in (3, 8, 12, 16, 33, 45, 64, 129, 141, 144, 256):
    shape = dataclasses.replace(SMALL, tokens=tokens, shared_intermediate=256, shared_group=group)
    p = make_problem("default", shape, seed=tokens)
    x, w, r = quantized(p)
    check(f"g{group} T={tokens}", x, w, r, p.shape.clamp)
    if tokens in (12, 64, 256):
      tiny = x.at[-1].set((x[-1].astype(jnp.float32) * 2.0**-110).astype(x.dtype))
      check(f"g{group} T={tokens}, last token x 2**-110", tiny, w, r, p.shape.clamp)
      check(f"g{group} T={tokens}, a NaN in token 1", x.at[1, 7].set(jnp.nan), w, r, p.shape.clamp)
      for f in (2.0**-110, 2.0**8):
        ws = formats.quantize_experts(p.w13, p.w2, shared=(p.shared[0] * f, p.shared[1] * f), shared_group=group)
        check(f"g{group} T={tokens}, shared weights x {f:g}", x, ws, r, p.shape.clamp)
      for family in CASE_FAMILIES:
        q = make_problem(family, shape, seed=tokens + 1)
        xq, wq, rq = quantized(q)
        check(f"g{group} {family} T={tokens}", xq, wq, rq, q.shape.clamp)
rng = np.random.default_rng(61)
for model, batches in (("glm5.2", (8, 13, 64, 256)), ("dsv4.1-flash", (16, 100, 256))):
  s = sweep.model_shape(model, shared=True)
  h, i, e, k, i_s = s.hidden, s.intermediate, s.experts, s.top_k, s.shared_intermediate
  keys = jax.random.split(jax.random.key(h + e), 4)
  w = gm.quantize_experts(jax.random.normal(keys[0], (e, h, 2 * i)) / np.sqrt(h),
                          jax.random.normal(keys[1], (e, i, h)) / np.sqrt(i),
                          shared=(jax.random.normal(keys[2], (h, 2 * i_s)) / np.sqrt(h),
                                  jax.random.normal(keys[3], (i_s, h)) / np.sqrt(i_s)), shared_group=s.shared_group)
  for b in batches:
    x = jnp.asarray(rng.standard_normal((b, h)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((b, e)), axis=1)[:, :k], jnp.int32)
    rw = jnp.asarray(rng.dirichlet(np.ones(k), b), jnp.float32)
    exact = check(f"{model} + shared B={b}", x, w, gm.Routes(ids, rw), 10.0)
    if b >= 64 and exact == 1.0:
      print(f"FAIL: {model} + shared B={b}: every bit the digits' (the BF16 groups did not run)", flush=True)
      bad += 1
  del w
sys.exit(1 if bad else 0)
"""


_WHOLE_GREEN_CHECK = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import gcmoe_jax as gm
from gcmoe_jax import reference

emulated = jax.jit(reference.moe_emulated, static_argnames=("clamp",))
rng = np.random.default_rng(11)
h, i, e, k = 512, 256, 8, 4
k1, k2 = jax.random.split(jax.random.key(3))
w = gm.quantize_experts(jax.random.normal(k1, (e, h, 2 * i)) / np.sqrt(h), jax.random.normal(k2, (e, i, h)) / np.sqrt(i))
bad = 0
for t in (1, 5, 12, 40):  # role 2 alone over every SM (T <= 8), the three-node graph on the stream's context
  step = jax.jit(lambda x, r: gm.moe(x, w, r, clamp=9.0, backend="cuda"))
  for n in range(3):
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k], jnp.int32)
    rw = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
    y = np.asarray(step(x, gm.Routes(ids, rw))).view(np.uint16)
    same = float(np.mean(y == np.asarray(emulated(x, w, ids, rw, clamp=9.0)).view(np.uint16)))
    print(f"T={t} call {n}: bit-exact share {same:.6f}")
    bad += same != 1.0
sys.exit(1 if bad else 0)
"""


def test_nodes_on_a_green_context_of_every_sm_match_the_oracle():
  """``GCMOE_DEBUG_WHOLE_GREEN=1`` (docs/cuda_runtime.md "Debug switches"): the nodes the runtime puts on the stream's
  own context, role 2 alone over every SM (T = 1, 5) and with ``GCMOE_GRAPH_CONTEXT=stream`` the three-node graph
  (T = 12, 40), go on a green context of every SM instead, and give the oracle's bits, three calls each. In a process
  of its own (the runtime reads the switch once)."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, GCMOE_DEBUG_WHOLE_GREEN="1", GCMOE_GRAPH_CONTEXT="stream", GCMOE_SOLO_SMS="all")
  run = subprocess.run([sys.executable, "-c", _WHOLE_GREEN_CHECK], env=env, capture_output=True, text=True,
                       timeout=600)
  print(run.stdout)
  assert run.returncode == 0, run.stdout + run.stderr[-3000:]


# The paper's per-rank shapes (H, I, L, k), as the bench runs them (`bench.sweep.model_shape`: L = E / 8).
PAPER = {name: (s.hidden, s.intermediate, s.experts, s.top_k)
         for name, s in ((n, sweep.model_shape(n)) for n in ("glm5.2", "dsv4.1-flash"))}
_PAPER_WEIGHTS = {}


def _paper_weights(model, shared):
  """Quantized random weights of a paper per-rank shape, generated on the GPU once per (model, shared)."""
  if (model, shared) not in _PAPER_WEIGHTS:
    _PAPER_WEIGHTS.clear()  # one model's weights at a time (several GB)
    h, i, e, _ = PAPER[model]
    k1, k2, k3, k4 = jax.random.split(jax.random.key(hash(model) % 1000), 4)
    w13 = jax.random.normal(k1, (e, h, 2 * i), jnp.float32) / np.sqrt(h)
    w2 = jax.random.normal(k2, (e, i, h), jnp.float32) / np.sqrt(i)
    sh = None
    if shared:
      sh = (jax.random.normal(k3, (h, 2 * i), jnp.float32) / np.sqrt(h),
            jax.random.normal(k4, (i, h), jnp.float32) / np.sqrt(i))
    _PAPER_WEIGHTS[(model, shared)] = gm.quantize_experts(w13, w2, shared=sh, shared_group=128)
  return _PAPER_WEIGHTS[(model, shared)]


@pytest.mark.parametrize("model", sorted(PAPER))
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
# One per token capacity but 16, the halves of B = 2 and B = 4's four-token shared group.
@pytest.mark.parametrize("batch", [1, 2, 4, 8, 32, 64, 100, 256])
def test_paper_per_rank_shapes(model, shared, batch):
  h, i, e, k = PAPER[model]
  w = _paper_weights(model, shared)
  rng = np.random.default_rng(batch)
  x = jnp.asarray(rng.standard_normal((batch, h)), jnp.bfloat16)
  ids = jnp.asarray(np.argsort(rng.random((batch, e)), axis=1)[:, :k], jnp.int32)
  logits = rng.standard_normal((batch, k))
  rw = jnp.asarray(np.exp(logits) / np.exp(logits).sum(1, keepdims=True), jnp.float32)
  y = gm.moe(x, w, gm.Routes(ids, rw), clamp=10.0, backend="cuda")
  want = emulated(x, w, ids, rw, clamp=10.0)
  _compare(f"{model} shared={shared} B={batch}", y, want)


def test_loop_of_1000_calls_is_correct_with_one_graph_and_flat_memory():
  p = make_problem("default", SMALL_GPU, seed=4)
  x, w, r = quantized(p)
  step = jax.jit(lambda x, ids: gm.moe(x, w, gm.Routes(ids, r.weights), clamp=10.0, backend="cuda"))
  key = jax.random.key(0)
  y = step(x, r.ids).block_until_ready()
  before = ffi.graph_instantiations()
  stats = jax.devices()[0].memory_stats() or {}
  mem0 = stats.get("bytes_in_use")
  checked = 0
  for n in range(1000):
    key, k1, k2 = jax.random.split(key, 3)
    xn = jax.random.normal(k1, x.shape, jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(k2, r.ids.shape, 0, SMALL_GPU.experts, jnp.int32)
    y = step(xn, ids)
    if n % 100 == 99:
      np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                    np.asarray(emulated(xn, w, ids, r.weights, clamp=10.0)).view(np.uint16))
      checked += 1
  y.block_until_ready()
  assert ffi.graph_instantiations() == before, "a graph was instantiated inside the loop"
  mem1 = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
  print(f"\n  1000 calls: graphs instantiated {before} (unchanged), bytes in use {mem0} -> {mem1}, {checked} checked")
  if mem0 is not None:
    assert mem1 <= mem0 + (1 << 20), f"device memory grew from {mem0} to {mem1} bytes"


def test_forced_timeout_raises_and_the_next_call_works(monkeypatch):
  monkeypatch.setenv("GCMOE_SYNC_CHECK", "1")
  monkeypatch.setenv("GCMOE_WAIT_TIMEOUT_MS", "50")
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=5))
  stalled = int(np.asarray(r.ids)[0, 0])
  step = jax.jit(lambda x, w, r: gm.moe(x, w, r, clamp=10.0, backend="cuda"))
  ffi.debug_set_stall_expert(stalled)
  try:
    with pytest.raises(Exception, match=rf"role 2, block \d+, epoch \d+, counter {stalled}, .*spin-wait exceeded"):
      step(x, w, r).block_until_ready()
  finally:
    ffi.debug_set_stall_expert(-1)
  y = step(x, w, r)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                np.asarray(emulated(x, w, r.ids, r.weights, clamp=10.0)).view(np.uint16))


def test_role1_lists_every_expert_hit_once_in_the_active_queue():
  """Role 1 (v2) appends each expert with rows to the call's active queue as it publishes it and closes the queue
  with its size (`abi.active_queue`); role 2 takes its experts from there. After a call the queue of that call's
  parity holds every expert hit exactly once, nothing else, and count[e] is the expert's number of routes."""
  from gcmoe_jax.ffi import _cuda
  from gcmoe_jax.kernels import abi, build
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=23))
  ids = np.asarray(r.ids).copy()
  ids[ids == 3] = -1  # expert 3 gets no row: it must not be in the queue
  ids[1, :] = -1  # a padding token
  routes = gm.Routes(jnp.asarray(ids), r.weights)
  # A clamp of its own: the runtime (and so the workspace read back) is this test's, not a cached one
  step = jax.jit(lambda x, routes: gm.moe(x, w, routes, clamp=7.25, backend="cuda"))
  step(x, routes).block_until_ready()
  before = np.frombuffer(_cuda.debug_read_workspace(0, 4), np.uint32)[0]
  y = step(x, routes)
  y.block_until_ready()
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                np.asarray(emulated(x, w, routes.ids, routes.weights, clamp=7.25)).view(np.uint16))
  variant = build.Variant(SMALL_GPU.hidden, SMALL_GPU.intermediate, SMALL_GPU.experts, SMALL_GPU.top_k, 16)
  ws = variant.workspace("v2")
  raw = _cuda.debug_read_workspace(0, ws.total)
  epoch = np.frombuffer(raw, np.uint32, 1)[0]
  assert epoch == before + 1, f"the workspace read is not this call's runtime's (epoch {before} -> {epoch})"
  args = (variant.experts, variant.capacity, False)
  words, at = abi.counter_words(*args), abi.active_queue(*args)
  queue = np.frombuffer(raw, np.uint32, words, ws.counters + 4 * words * (epoch & 1))[at:]
  appended, closed, entries = int(queue[0]), int(queue[1]), queue[2:2 + variant.experts]
  hit = sorted(set(ids[ids >= 0].tolist()))
  print(f"\n  active queue: {appended} appended, closed at {closed - 1}, entries {(entries.astype(int) - 1).tolist()}, "
        f"hit {hit}")
  assert 3 not in hit and appended == closed - 1 == len(hit)
  assert sorted((entries[:len(hit)].astype(int) - 1).tolist()) == hit and not entries[len(hit):].any()
  counts = np.frombuffer(raw, np.int32, variant.experts, ws.count)
  np.testing.assert_array_equal(counts, np.bincount(ids[ids >= 0], minlength=variant.experts))


def test_out_of_range_id_under_jit_raises_naming_it(monkeypatch):
  monkeypatch.setenv("GCMOE_SYNC_CHECK", "1")
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=6))
  step = jax.jit(lambda ids: gm.moe(x, w, gm.Routes(ids, r.weights), backend="cuda"))
  with pytest.raises(Exception, match=r"role 1 read expert id 99"):
    step(r.ids.at[2, 1].set(99)).block_until_ready()
  np.testing.assert_array_equal(np.asarray(step(r.ids)).view(np.uint16),
                                np.asarray(emulated(x, w, r.ids, r.weights)).view(np.uint16))


def test_a_grid_that_cannot_be_resident_is_rejected_with_the_numbers():
  from gcmoe_jax.ffi import _cuda, _moe
  from gcmoe_jax.kernels import build
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=7))
  variant = build.Variant(512, 256, 8, 4, 16)
  built = build.load_or_build("sm_90a", variant)
  ws = variant.workspace()
  _cuda.register_raw("too-big", (16, 6, 10**9, ws.total, ws.silu_table),
                     (1, 256, 0, 100000, 256, 0, 0, 256, 0),  # role 2: 100000 CTAs
                     [built.cubin(i) for i in (1, 2, 3)], reference.silu_table())
  attrs = _moe.MoeAttrs.from_weights(w, 4, None, variant="too-big")
  with pytest.raises(Exception,
                     match=r"role 2 grid of 100000 CTAs cannot be resident: \d+ CTA\(s\) per SM .* \(eq. 6\)"):
    _moe.moe_ffi(x, w.w13, w.w13_scale, w.w2, w.w2_scale, r.ids, r.weights, *_moe.no_shared_operands(),
                 attrs=attrs).block_until_ready()


def test_explain_picks_cuda():
  e = gm.explain()
  assert e.backend == "cuda", str(e)
  print("\n" + str(e))


def _host_rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * 4096


def _device_free_bytes() -> int:
  from cuda.bindings import driver as cu

  err, free, _ = cu.cuMemGetInfo()
  assert err == cu.CUresult.CUDA_SUCCESS, err
  return int(free)


def test_10000_replays_of_a_decode_step_stay_exact_with_flat_memory():
  """Issue 12: a jitted decode step replayed 10,000 times on fresh inputs: exact throughout, one graph, flat
  device and host memory."""
  p = make_problem("default", SMALL_GPU, seed=7)
  x, w, r = quantized(p)
  step = jax.jit(lambda x, ids, rw: gm.moe(x, w, gm.Routes(ids, rw), clamp=10.0, backend="cuda"))
  # 32 fresh input sets on the device, rotated: the loop measures the operator, not input generation.
  keys = jax.random.split(jax.random.key(1), 32)
  xs = [jax.random.normal(k, x.shape, jnp.float32).astype(jnp.bfloat16) for k in keys]
  idss = [jax.random.randint(jax.random.fold_in(k, 1), r.ids.shape, -1, SMALL_GPU.experts, jnp.int32) for k in keys]
  rws = [jax.nn.softmax(jax.random.normal(jax.random.fold_in(k, 2), r.weights.shape), -1) for k in keys]
  wants = [np.asarray(emulated(a, w, b, c, clamp=10.0)).view(np.uint16) for a, b, c in zip(xs, idss, rws)]
  step(xs[0], idss[0], rws[0]).block_until_ready()
  graphs = ffi.graph_instantiations()
  dev0 = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
  free0, rss0 = _device_free_bytes(), _host_rss_bytes()
  checked = 0
  for n in range(10_000):
    i = n % 32
    y = step(xs[i], idss[i], rws[i])
    if n % 250 == 249:
      np.testing.assert_array_equal(np.asarray(y).view(np.uint16), wants[i], err_msg=f"replay {n}")
      checked += 1
  y.block_until_ready()
  dev1 = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
  free1, rss1 = _device_free_bytes(), _host_rss_bytes()
  print(f"\n  10000 replays: {checked} checked bit-exact, graphs instantiated {graphs} -> "
        f"{ffi.graph_instantiations()}, XLA bytes in use {dev0} -> {dev1}, device free {free0} -> {free1}, "
        f"host RSS {rss0} -> {rss1}")
  assert ffi.graph_instantiations() == graphs, "a graph was instantiated inside the loop"
  if dev0 is not None:
    assert dev1 <= dev0 + (1 << 20), f"XLA device memory grew from {dev0} to {dev1} bytes"
  assert free1 >= free0 - (8 << 20), f"device free memory fell from {free0} to {free1} bytes"
  assert rss1 <= rss0 + (64 << 20), f"host RSS grew from {rss0} to {rss1} bytes"


def test_100_layers_created_and_dropped_release_their_workspaces():
  """Issue 12: 100 differently shaped layers (variant x token count, each its own FFI state, runtime, workspace and
  graph; the green contexts are the device's, shared), each called then dropped: device free memory returns to its
  baseline and no runtime stays alive."""
  import gc

  shapes = []
  for k in (1, 4, 8):
    for shared in (None, 128, 32):
      for t in range(1, 17):
        shapes.append((k, shared, t))
  shapes = shapes[:100]
  layers = {}
  for k, shared in {(k, s) for k, s, _ in shapes}:
    shape = dataclasses.replace(SMALL, top_k=k, tokens=16, shared_intermediate=None if shared is None else 256,
                                shared_group=shared)
    x, w, r = quantized(make_problem("default", shape, seed=3))
    # Tokens are independent: the first t rows of the oracle at T = 16 are the oracle of the first t tokens.
    want = np.asarray(emulated(x, w, r.ids, r.weights, clamp=10.0)).view(np.uint16)
    layers[(k, shared)] = (x, w, r, want)

  def run_one(k, shared, t):
    x, w, r, want = layers[(k, shared)]
    f = jax.jit(lambda x, ids, rw: gm.moe(x, w, gm.Routes(ids, rw), clamp=10.0, backend="cuda"))
    y = f(x[:t], r.ids[:t], r.weights[:t])
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want[:t], err_msg=f"k={k} shared={shared} T={t}")
    return f

  run_one(*shapes[0])  # process-wide one-time costs (library, variant registry, green contexts) before the baseline
  jax.clear_caches()
  gc.collect()
  free0, live0, rt0 = _device_free_bytes(), ffi.live_states(), ffi.live_runtimes()
  lowest, peak = free0, rt0
  alive = []
  for i, s in enumerate(shapes):
    alive.append(run_one(*s))  # the jitted function keeps its executable (and FFI state) alive
    if i % 10 == 9:
      lowest, peak = min(lowest, _device_free_bytes()), max(peak, ffi.live_runtimes())
      alive.clear()
      jax.clear_caches()  # drops the executables, and with them the FFI states
      gc.collect()
  jax.clear_caches()
  gc.collect()
  free1 = _device_free_bytes()
  print(f"\n  100 layers: device free {free0} -> lowest {lowest} -> {free1} after dropping them; live FFI states "
        f"{live0} -> {ffi.live_states()}, runtimes {rt0} -> peak {peak} -> {ffi.live_runtimes()}")
  # Ten layers were alive at each check: their runtimes (workspaces, graphs) existed, then were all freed. (Free
  # memory need not fall while they live: the driver serves small allocations from memory it already holds.)
  assert peak >= rt0 + 10, f"live runtimes peaked at {peak}, expected >= {rt0 + 10} (the measurement is broken)"
  assert ffi.live_states() == live0 and ffi.live_runtimes() == rt0
  assert free1 >= free0 - (16 << 20), f"device free memory did not return: {free0} -> {free1} bytes"


def test_identical_layers_share_one_graph_and_workspace():
  """Issue 5, graph cache: call sites whose static arguments, cubins and launch triples agree (a model's identical
  layers with different weights) share one runtime: one graph instantiated, one workspace; results stay exact."""
  x, w1, r = quantized(make_problem("default", SMALL_GPU, seed=31))
  _, w2, _ = quantized(make_problem("default", SMALL_GPU, seed=32))
  n0, rt0 = ffi.graph_instantiations(), ffi.live_runtimes()
  layers = jax.jit(lambda x: gm.moe(gm.moe(x, w1, r, clamp=7.0, backend="cuda"), w2, r, clamp=7.0,
                                    backend="cuda"))
  for _ in range(3):
    y = layers(x)
  want = emulated(emulated(x, w1, r.ids, r.weights, clamp=7.0), w2, r.ids, r.weights, clamp=7.0)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(want).view(np.uint16))
  print(f"\n  two identical layers: graphs {n0} -> {ffi.graph_instantiations()}, runtimes {rt0} -> "
        f"{ffi.live_runtimes()}")
  # clamp 7 is this test's own, so its key is new: exactly one graph and one runtime for both call sites.
  assert ffi.graph_instantiations() - n0 == 1
  assert ffi.live_runtimes() - rt0 == 1


def test_donated_and_strided_inputs_are_read_correctly():
  """Issue 12: x donated to the jit, and x, ids, weights as strided/transposed views (XLA hands the custom call
  dense row-major copies): results equal the oracle's."""
  x, w, r = quantized(make_problem("default", SMALL_GPU, seed=33))
  want = np.asarray(emulated(x, w, r.ids, r.weights, clamp=10.0)).view(np.uint16)
  donating = jax.jit(lambda x, ids, rw: gm.moe(x, w, gm.Routes(ids, rw), clamp=10.0, backend="cuda"),
                     donate_argnums=(0,))
  y = donating(jnp.array(x, copy=True), r.ids, r.weights)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want)
  wide = jnp.zeros((x.shape[0], 2 * x.shape[1]), x.dtype).at[:, ::2].set(x)
  strided = jax.jit(lambda xw, idt, rwt: gm.moe(xw[:, ::2], w, gm.Routes(idt.T, rwt.T), clamp=10.0,
                                                backend="cuda"))
  y = strided(wide, r.ids.T, r.weights.T)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want)


def test_two_layers_in_one_jit_and_one_layer_from_two_jits_stay_exact():
  """Issue 12, concurrency: two differently shaped layers in one program (each its own workspace), and one layer
  called alternately from two jitted functions."""
  x1, w1, r1 = quantized(make_problem("default", SMALL_GPU, seed=8))
  shape2 = dataclasses.replace(SMALL_GPU, top_k=8, tokens=10, shared_intermediate=256, shared_group=128)
  x2, w2, r2 = quantized(make_problem("zipf", shape2, seed=9))
  both = jax.jit(lambda a, b: (gm.moe(a, w1, r1, clamp=10.0, backend="cuda"),
                               gm.moe(b, w2, r2, clamp=None, backend="cuda")))
  y1, y2 = both(x1, x2)
  np.testing.assert_array_equal(np.asarray(y1).view(np.uint16),
                                np.asarray(emulated(x1, w1, r1.ids, r1.weights, clamp=10.0)).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(y2).view(np.uint16),
                                np.asarray(emulated(x2, w2, r2.ids, r2.weights, clamp=None)).view(np.uint16))
  f = jax.jit(lambda a: gm.moe(a, w1, r1, clamp=10.0, backend="cuda"))
  g = jax.jit(lambda a: gm.moe(a, w1, r1, clamp=10.0, backend="cuda") + 0)
  for n in range(20):
    xn = jax.random.normal(jax.random.key(n), x1.shape, jnp.float32).astype(jnp.bfloat16)
    y = (f if n % 2 else g)(xn)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                  np.asarray(emulated(xn, w1, r1.ids, r1.weights, clamp=10.0)).view(np.uint16),
                                  err_msg=f"call {n}")


def test_randomized_sweep_of_small_shapes():
  """Issue 12: a short randomized sweep (top-k, shared expert, token count, padding and duplicate routes, clamp)
  over the prebuilt small variants, bit for bit against the oracle."""
  rng = np.random.default_rng(12)
  for n in range(16):
    k = int(rng.choice([1, 4, 8]))
    shared = [None, 128, 32][int(rng.integers(3))]
    t = int(rng.integers(1, 17))
    shape = dataclasses.replace(SMALL, top_k=k, tokens=t, shared_intermediate=None if shared is None else 256,
                                shared_group=shared)
    x, w, r = quantized(make_problem("default", shape, seed=100 + n))
    ids = rng.integers(-1, SMALL.experts, size=(t, k)).astype(np.int32)  # padding and duplicates included
    routes = gm.Routes(jnp.asarray(ids), r.weights)
    clamp = None if rng.random() < 0.3 else float(rng.uniform(0.5, 20.0))
    y = gm.moe(x, w, routes, clamp=clamp, backend="cuda")
    want = emulated(x, w, routes.ids, routes.weights, clamp=clamp)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(want).view(np.uint16),
                                  err_msg=f"case {n}: k={k} shared={shared} T={t} clamp={clamp}")


@pytest.mark.parametrize("k, tokens", [(1, 600), (4, 300)])
def test_more_tokens_than_a_call_holds_run_in_chunks(k, tokens):
  """T > 256 runs as chunks of 256 tokens through one call site (`ffi._moe.in_chunks`; k = 1 rows sorted by expert
  first, as the expert-parallel local op sees them): bit for bit against the oracle."""
  shape = dataclasses.replace(SMALL, top_k=k, tokens=tokens)
  x, w, r = quantized(make_problem("zipf", shape, seed=77))
  ids = r.ids.at[3, 0].set(-1)
  y = jax.jit(lambda x, ids, wt: gm.moe(x, w, gm.Routes(ids, wt), clamp=10.0, backend="cuda"))(x, ids, r.weights)
  want = emulated(x, w, ids, r.weights, clamp=10.0)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(want).view(np.uint16))


def _peer_probe_cubin() -> bytes:
  """csrc/kernels/peer_probe.cu for sm_90a: prebuilt under $GCMOE_CUBIN_DIR/probe, else compiled with nvcc."""
  import os
  import pathlib
  import shutil
  import subprocess

  prebuilt = pathlib.Path(os.environ.get("GCMOE_CUBIN_DIR", ".")) / "probe" / "peer_probe.cubin"
  if prebuilt.is_file():
    return prebuilt.read_bytes()
  nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
  if nvcc is None:
    pytest.skip(f"no {prebuilt} and no nvcc to build it")
  src = pathlib.Path(__file__).parent.parent / "csrc" / "kernels" / "peer_probe.cu"
  out = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "gcmoe_peer_probe.cubin"
  subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(out), str(src)], check=True)
  return out.read_bytes()


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_virtual_ranks_reach_each_other_from_disjoint_partitions(ranks):
  """Issue 9's one-GPU mode: R green-context pairs as `geometry.split_virtual_ranks` plans them (R = 4 with the
  32-SM floor lowered), R workspaces with a peer table, R probe kernels at once: each rank sees every rank's write
  (which needs the R kernels to run concurrently in their disjoint partitions)."""
  from gcmoe_jax import geometry
  from gcmoe_jax.ffi import _cuda

  facts, _ = _cuda.device_facts(0, "sm_90a")
  split, bad = geometry.split_virtual_ranks(facts, ranks, min_compute_sms=16)
  assert not bad, bad
  # Compute 0: as many SM groups as the driver's split leaves each rank (it makes fewer aligned groups than the SM
  # count suggests: 15 groups of 8 from the H200's 132 SMs, so R = 2 gets 8 + 48, not the geometry's 8 + 56).
  seen, partition = ffi.debug_peer_probe(ranks, split.dispatch_sms, 0, _peer_probe_cubin())
  print(f"\n  R={ranks}: partitions (dispatch, compute) {partition.tolist()}, seen {seen.tolist()}")
  assert (partition[:, 0] == split.dispatch_sms).all() and (partition[:, 1] == partition[0, 1]).all()
  assert partition[0, 1] >= 16
  np.testing.assert_array_equal(seen, np.tile(np.arange(1, ranks + 1, dtype=np.uint32), (ranks, 1)))
