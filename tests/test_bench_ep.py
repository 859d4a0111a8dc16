"""The expert-parallel benchmark (gcmoe_jax.bench.ep) on CPU devices: its programs compute the layer, rows say why
a point cannot run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gcmoe_jax import reference
from gcmoe_jax.bench import ep, sweep
from gcmoe_jax.bench.accuracy import cosine

TINY = sweep.BenchShape("tiny", experts=4, hidden=512, intermediate=256, top_k=2, clamp=10.0)
R = 2


@pytest.fixture(autouse=True)
def _devices():
  if len(jax.devices()) < R:
    pytest.skip(f"needs {R} devices (tests run with jax_num_cpu_devices=8)")


def test_gcmoe_program_is_the_oracle_layer_by_layer():
  def oracle(x, copies, ids, rw, chain, norm):
    want = jnp.asarray(x)
    for n in range(chain):  # the bench's pre-norm residual stream
      want = want + reference.moe_emulated(norm(want), copies[n % 2], np.asarray(ids)[n], np.asarray(rw)[n],
                                           clamp=10.0)
    return np.asarray(want)

  for chain in (1, 2):
    f, args = ep.program(TINY, R, 3, "gcmoe:cpu", "collective", chain=chain)
    x, _, copies, ids, rw = jax.device_get(args)  # host copies: the oracle runs unsharded
    got, want = np.asarray(f(*args)), oracle(x, copies, ids, rw, chain, sweep.pre_norm)
    if chain == 1:
      np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    else:  # XLA may keep the fused residual add in f32 before the norm (excess precision): not the same bits
      assert cosine(got.astype(np.float32), want.astype(np.float32)) > 0.9999
      plain = oracle(x, copies, ids, rw, chain, lambda v: v)  # the stream without the norm is told apart
      assert cosine(got.astype(np.float32), plain.astype(np.float32)) < 0.9999


def test_baseline_program_is_the_bf16_moe():
  # On CPU the baseline runs over the collective transport (XLA:CPU has no ragged_all_to_all); the experts are the
  # BF16 ragged_dot ones either way.
  f, args = ep.program(TINY, R, 3, "baseline", "collective", chain=1)
  x, _, copies, ids, rw = jax.device_get(args)
  w13, w2 = copies[0]
  want = jnp.asarray(x) + reference.moe_bf16(sweep.pre_norm(jnp.asarray(x)), w13, w2, ids[0], rw[0], clamp=10.0)
  assert cosine(np.asarray(f(*args), np.float32), np.asarray(want, np.float32)) > 0.999


def test_floor_is_the_busiest_ranks_distinct_experts():
  # The routes `program` runs: per layer, the rank whose local experts are hit most (distinct) sets the floor.
  chain, b = 3, 2
  f, args = ep.program(TINY, R, b, "gcmoe:cpu", "collective", chain=chain)
  ids = np.asarray(jax.device_get(args[3]))
  busiest = [max(np.unique(layer[(layer >= 0) & (layer // TINY.experts == r)]).size for r in range(R)) for layer in ids]
  got = ep.floor_us(TINY, R, b, bandwidth=1e12, expert_bytes=1e6, chain=chain)
  assert got == pytest.approx(1e6 * np.mean(busiest) * 1e6 / 1e12) and got > 0


def test_fused_rows_run_gm_moe_on_sharded_global_arrays_and_say_why_not_here():
  """A fused row is `gm.moe(..., ep_axis="ep", transport="fused")` under jit (the kernels need the mesh's devices):
  on the CPU backend it keeps its row with the reason; the baseline has no fused transport."""
  rows = ep.run(TINY, R, [1], ["gcmoe:cpu"], ["fused"], iters=1, warmup=1, chain=1, bandwidth=1e11)
  assert [(r.impl, r.transport) for r in rows] == [("gcmoe:cpu", "fused")] and np.isnan(rows[0].latency_us)
  assert "transport='fused' runs in the CUDA kernels (backend='cuda'), got backend='cpu'" in rows[0].note
  with pytest.raises(ValueError, match="the baseline has no fused transport"):
    ep.program(TINY, R, 1, "baseline", "fused", chain=1)


def test_run_keeps_a_row_for_every_point_with_the_reason(tmp_path):
  seen = []
  rows = ep.run(TINY, R, [1], ["gcmoe:cpu", "baseline"], iters=1, warmup=1, chain=1, bandwidth=1e11,
                on_row=seen.append)
  assert seen == rows and all(r.floor_us > 0 for r in rows)
  assert [(r.impl, r.transport) for r in rows] == [("gcmoe:cpu", "collective"), ("gcmoe:cpu", "ragged"),
                                                   ("baseline", "ragged")]
  assert rows[0].latency_us > 0 and rows[0].note == ""
  if jax.default_backend() == "cpu":
    assert "ragged-all-to-all" in rows[1].note and np.isnan(rows[1].latency_us)
  ep.plot(rows, tmp_path / "ep.png", title="tiny")
  assert (tmp_path / "ep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  ep.write_csv(rows, tmp_path / "ep.csv")
  lines = (tmp_path / "ep.csv").read_text().splitlines()
  assert lines[0].split(",")[:5] == ["impl", "transport", "ranks", "batch", "latency_us"]
  assert len(lines) == 1 + len(rows)
  table = ep.to_markdown(rows).splitlines()
  assert table[0].startswith("| B per rank | R | impl |") and len(table) == 2 + len(rows)
  with pytest.raises(ValueError, match="impl must be gcmoe:<backend> or baseline, got 'pallas'"):
    ep.run(TINY, R, [1], ["pallas"])
  with pytest.raises(ValueError, match=r"ranks must be in \[2, \d+\]"):
    ep.run(TINY, 1, [1], ["gcmoe:cpu"])
