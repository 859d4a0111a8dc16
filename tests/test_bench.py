"""The benchmark: BF16 baselines against the yardstick, a tiny sweep's CSV and PNG, shapes, CLI errors."""

import csv
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gcmoe_jax as gm
from gcmoe_jax import __main__ as cli
from gcmoe_jax import reference
from gcmoe_jax.bench import ab, baselines, sweep
from gcmoe_jax.bench.accuracy import cosine
from gcmoe_jax.bench.problems import Shape, make_problem

TINY = sweep.BenchShape("tiny", experts=4, hidden=512, intermediate=256, top_k=2, clamp=10.0)


@pytest.mark.parametrize("family", ["default", "padding"])
@pytest.mark.parametrize("impl", [baselines.ragged_dot_moe, baselines.dense_gather_moe],
                         ids=["ragged_dot", "dense_gather"])
def test_baselines_match_bf16_yardstick(impl, family):
  p = make_problem(family, Shape(experts=8, hidden=512, intermediate=256, top_k=3, tokens=5,
                                 shared_intermediate=256), seed=3)
  x = jnp.asarray(p.x, jnp.bfloat16)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  shared = (bf(p.shared[0]), bf(p.shared[1]))
  ids, w = jnp.asarray(p.ids), jnp.asarray(p.weights)
  y = jax.jit(lambda *a: impl(*a[:5], shared=a[5], clamp=1.0))(x, bf(p.w13), bf(p.w2), ids, w, shared)
  want = reference.moe_bf16(x, bf(p.w13), bf(p.w2), ids, w, shared=shared, clamp=1.0)
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape
  assert cosine(np.asarray(y, np.float32), np.asarray(want, np.float32)) > 0.999


def _steady_clock(mp):
  """Make `sweep._run_seconds` run the programs as the bench does but report 1 ms + 0.5 ms per program. The tests of
  the rows' contents must not depend on timing a few programs on a loaded 2-core machine, where the longer run is at
  times not the slower one (the row then says so, `sweep.NOT_POSITIVE_NOTE`); the marginal timing's arithmetic is
  tested on a fake clock below."""
  real = sweep._run_seconds

  def run(fn, args, depth):
    real(fn, args, depth)
    return 1e-3 + 5e-4 * depth

  mp.setattr(sweep, "_run_seconds", run)


@pytest.fixture(scope="module")
def tiny_rows():
  impls = ("ragged_dot", "dense_gather", "emulated", "gcmoe:reference")
  with pytest.MonkeyPatch.context() as mp:
    _steady_clock(mp)
    return sweep.run(TINY, (1, 3), impls, iters=2, warmup=1, bandwidth=2e10, fp8_rate=1e18, chain=2,
                     progress=False)


def test_sweep_rows(tiny_rows):
  assert [(r.impl, r.batch) for r in tiny_rows] == [
    (i, b) for b in (1, 3) for i in ("ragged_dot", "dense_gather", "emulated", "gcmoe:reference")]
  for r in tiny_rows:
    assert r.latency_us > 0 and r.min_us <= r.latency_us and r.note == ""
    assert 1 <= r.distinct_experts <= min(TINY.experts, r.batch * TINY.top_k)
    assert r.floor_us == pytest.approx(1e6 * r.weight_bytes / 2e10) and r.floor_term == "memory"
    # 6 H I FLOPs per routed assignment (no padding in the default routes): B k of them per layer.
    assert r.flops == pytest.approx(6 * 512 * 256 * r.batch * TINY.top_k)
    assert r.speedup[r.impl] == 1.0 if r.impl in sweep.BASELINES else r.speedup["ragged_dot"] > 0
  # One MXFP4 expert of H x I with its scales: 3 H I / 2 payload bytes + 3 H I / 32 scale bytes.
  r = tiny_rows[0]
  assert r.weight_bytes == r.distinct_experts * (3 * 512 * 256 // 2 + 3 * 512 * 256 // 32)


def test_the_timed_chain_is_pre_normed_so_long_chains_stay_finite(monkeypatch):
  """Unclamped SwiGLU layers grow a plain residual stream quadratically to Inf (the paper models' by layer 16);
  the bench's chain feeds each layer its RMS-normed input, as a pre-norm decoder does, and says when an output is
  not finite."""
  shape = sweep.BenchShape("tiny-unclamped", experts=4, hidden=512, intermediate=256, top_k=2, clamp=None)
  x = jax.random.normal(jax.random.key(1), (3, 512), jnp.float32).astype(jnp.bfloat16) * 7.0
  normed = np.asarray(sweep.pre_norm(x), np.float32)
  np.testing.assert_allclose(np.sqrt(np.mean(normed**2, axis=-1)), 1.0, rtol=1e-2)
  _steady_clock(monkeypatch)
  chain = 16
  rows = sweep.run(shape, (3,), ("ragged_dot",), iters=1, warmup=1, bandwidth=2e10, fp8_rate=1e18, chain=chain,
                   progress=False)
  assert rows[0].note == "" and rows[0].latency_us > 0
  monkeypatch.setattr(sweep, "pre_norm", lambda x: x)  # the plain stream: the row says what it timed
  rows = sweep.run(shape, (3,), ("ragged_dot",), iters=1, warmup=1, bandwidth=2e10, fp8_rate=1e18, chain=chain,
                   progress=False)
  assert rows[0].note == "output not finite: the timed layers ran exceptional paths" and rows[0].latency_us > 0


def test_back_to_back_runs_chain_each_program_on_the_previous_output():
  """A timed run dispatches ``depth`` programs, each on the last one's output (a decode loop's data dependence),
  and a run's time is divided by ``depth``."""
  seen = []

  def step(x, inc):
    seen.append(float(x[0]))
    return x + inc

  times = sweep.time_back_to_back(step, (jnp.ones(4), jnp.full(4, 2.0)), iters=3, warmup=2, depth=5)
  assert len(times) == 3 and all(t > 0 for t in times)
  assert seen == [1.0, 3.0, 5.0, 7.0, 9.0] * 5  # every run starts again from args[0]
  one = sweep.time_back_to_back(step, (jnp.ones(4), jnp.full(4, 2.0)), iters=1, warmup=1, depth=1)
  assert len(one) == 1 and len(seen) == 25 + 2


def test_marginal_timing_separates_the_per_program_time_from_what_a_run_pays_once(monkeypatch):
  """`time_marginal` times pairs of runs of d and 2 d programs: their difference over d is one program's time, and
  2 t(d) - t(2 d) what a run pays once, whichever run of a pair goes first."""
  clock = [0.0]
  monkeypatch.setattr(sweep.time, "perf_counter", lambda: clock[0])
  depths = []

  def step(x, inc):
    if x[0] == 1.0:  # a run's first program: its dispatch and the final wait cost 5 s once per run
      clock[0] += 5.0
      depths.append(0)
    clock[0] += 0.25  # each program: 0.25 s
    depths[-1] += 1
    return x + inc

  per_program, per_run = sweep.time_marginal(step, (jnp.ones(4), jnp.full(4, 2.0)), iters=3, warmup=1, depth=4)
  assert per_program == [0.25] * 3 and per_run == [5.0] * 3
  assert depths == [4, 8, 4, 8, 8, 4, 4, 8]  # warm-up pair, then the longer run first in every other pair
  # With a per-run cost F, one run's time per program (`time_back_to_back`) keeps F / d in it.
  assert sweep.time_back_to_back(step, (jnp.ones(4), jnp.full(4, 2.0)), iters=1, warmup=1, depth=4) == [
    0.25 + 5.0 / 4]


def test_a_point_whose_longer_runs_were_not_slower_says_so(monkeypatch):
  monkeypatch.setattr(sweep, "time_marginal", lambda *a, **k: ([-1e-6, 0.0], [1e-3, 1e-3]))
  rows = sweep.run(TINY, (1,), ("ragged_dot",), iters=2, warmup=1, bandwidth=2e10, fp8_rate=1e18, chain=2,
                   progress=False)
  assert rows[0].note == sweep.NOT_POSITIVE_NOTE and rows[0].run_overhead_us == pytest.approx(1e3)


def test_sweep_writes_csv_png_and_table(tiny_rows, tmp_path):
  sweep.write_csv(tiny_rows, tmp_path / "b.csv")
  sweep.plot(tiny_rows, tmp_path / "b.png", title="tiny")
  with open(tmp_path / "b.csv") as f:
    table = list(csv.DictReader(f))
  assert tuple(table[0]) == sweep.CSV_COLUMNS
  assert {"impl", "batch", "latency_us", "floor_us", "latency_over_floor", "floor_pct", "speedup_vs_ragged_dot",
          "speedup_vs_dense_gather", "bandwidth_gbs"} <= set(table[0])
  assert len(table) == len(tiny_rows)
  for row, r in zip(table, tiny_rows):
    assert float(row["latency_over_floor"]) == pytest.approx(r.latency_us / r.floor_us, rel=1e-4)
    assert float(row["floor_pct"]) == pytest.approx(100 * r.floor_us / r.latency_us, rel=1e-4)
  assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  md = sweep.to_markdown(tiny_rows).splitlines()
  assert md[0].startswith("| impl | B |") and len(md) == 2 + len(tiny_rows)


def test_compute_floor_takes_over_at_a_low_fp8_rate():
  rows = sweep.run(TINY, (3,), ("gcmoe:reference",), iters=1, warmup=1, bandwidth=1e15, fp8_rate=1e9, chain=1,
                   progress=False)
  r = rows[0]
  assert r.floor_term == "compute" and r.floor_us == pytest.approx(1e6 * r.flops / 1e9)


def test_measure_fp8_rate():
  assert sweep.measure_fp8_rate(128, iters=2) > 1e6  # 1 MFLOP/s: any machine


def test_dense_gather_skipped_above_budget():
  rows = sweep.run(TINY, (2,), ("dense_gather",), iters=1, warmup=1, bandwidth=1e10, fp8_rate=1e18,
                   max_gather_bytes=1, progress=False)
  assert math.isnan(rows[0].latency_us) and rows[0].note.startswith("skipped: gathers")


def test_measure_bandwidth_and_progress():
  assert sweep.measure_bandwidth(1 << 20, iters=2) > 1e8  # 100 MB/s: any machine
  probes = sweep.bandwidth_probes(1 << 20, iters=2, passes=2)
  # The back-to-back probes may be left out on a noisy host; the four others always report.
  assert {"copy", "read", "copy x2", "read x2"} <= set(probes) <= {"copy", "read", "copy x2", "read x2", "copy b2b",
                                                                   "read b2b"}
  assert min(probes.values()) > 1e8
  out = io.StringIO()
  bar = sweep.Progress(2, stream=out)
  bar.step("a")
  bar.close()
  assert out.getvalue().count("\r") == 2 and "2/2" in out.getvalue() and out.getvalue().endswith("\n")


def test_model_shapes():
  glm = sweep.model_shape("glm5.2")
  assert (glm.experts, glm.hidden, glm.intermediate, glm.top_k, glm.shared_intermediate) == (32, 6144, 2048, 8, None)
  dsv = sweep.model_shape("dsv4.1-flash", shared=True)
  assert (dsv.experts, dsv.hidden, dsv.intermediate, dsv.top_k) == (48, 5120, 2304, 6)
  assert (dsv.shared_intermediate, dsv.shared_group) == (2304, 32)
  assert sweep.model_shape("demo").experts == 16
  with pytest.raises(ValueError, match=r"^bench: model must be one of \['demo', 'glm5.2', 'dsv4.1-flash'\], got 'x'$"):
    sweep.model_shape("x")
  with pytest.raises(ValueError, match=r"^bench: ranks must divide GLM5.2's E = 256, got 3$"):
    sweep.model_shape("glm5.2", ranks=3)


def test_default_impls_follow_explain():
  impls = sweep.default_impls()
  assert impls[:3] == ("ragged_dot", "dense_gather", "emulated")
  assert {f"gcmoe:{b}" for b, s in gm.explain().reasons if s.ok} == set(impls[3:])


def test_run_errors():
  with pytest.raises(ValueError, match=r"^bench: impl must be among \[.*'ragged_dot'.*\], got 'pallas'$"):
    sweep.run(TINY, (1,), ("pallas",), progress=False)
  with pytest.raises(ValueError, match=r"^bench: batch sizes must be >= 1, got \[0\]$"):
    sweep.run(TINY, (0,), ("ragged_dot",), progress=False)
  with pytest.raises(ValueError, match=r"^bench: iters must be >= 1, got 0$"):
    sweep.run(TINY, (1,), ("ragged_dot",), iters=0, progress=False)
  with pytest.raises(ValueError, match=r"^bench: back_to_back must be >= 1, got 0$"):
    sweep.run(TINY, (1,), ("ragged_dot",), back_to_back=0, progress=False)
  if not dict(gm.explain().reasons)["cuda"].ok:
    with pytest.raises(RuntimeError, match=r"^moe: backend='cuda' cannot run here"):
      sweep.check_impls(("gcmoe:cuda",))


@pytest.mark.parametrize("argv, match", [
  (["--model", "glm5.2", "--experts", "4"], "bench: --experts applies only to --model custom, got --model glm5.2"),
  (["--model", "custom", "--experts", "4"],
   ("bench: --model custom requires --experts, --hidden, --intermediate and --topk, got no --hidden, "
   "--intermediate, --topk")),
  (["--model", "custom", "--experts", "4", "--hidden", "512", "--intermediate", "256", "--topk", "2",
    "--shared-intermediate", "256"], "bench: --shared-intermediate requires --shared, got it without --shared"),
  (["--impl", "ragged_dot,foo"], "bench: impl must be among"),
  (["--batch", "0", "--impl", "ragged_dot"], r"bench: batch sizes must be >= 1, got \[0\]"),
  (["--back-to-back", "0", "--impl", "ragged_dot"], r"bench: back_to_back must be >= 1, got 0"),
  (["--model", "custom", "--experts", "4", "--hidden", "512", "--intermediate", "256", "--topk", "5"],
   r"bench: top-k must be in \[1, min\(32, E\)\] = \[1, 4\], got 5"),
])
def test_cli_errors(argv, match, capsys):
  assert cli.main(["bench", *argv]) == 2
  assert re.match(match, capsys.readouterr().err)


def test_cli_writes_reports(tmp_path, capsys):
  rc = cli.main(["bench", "--model", "custom", "--experts", "4", "--hidden", "512", "--intermediate", "256",
                 "--topk", "2", "--batch", "2", "--impl", "ragged_dot", "--iters", "1", "--out", str(tmp_path)])
  out = capsys.readouterr()
  assert rc == 0
  assert "| ragged_dot | 2 |" in out.out and "measured memory bandwidth" in out.out
  # Every probe's reading is printed, the fastest being the floor's bandwidth.
  probes = dict(re.findall(r"(copy|read|copy x8|read x8|copy b2b|read b2b) ([0-9.]+)",
                           out.out.split("bandwidth probes, GB/s (the fastest is the floor's): ")[1].splitlines()[0]))
  floor_bw = float(re.search(r"measured memory bandwidth: ([0-9.]+) GB/s", out.out).group(1))
  assert {"copy", "read"} <= set(probes) and max(map(float, probes.values())) == floor_bw
  assert "\r[" in out.err  # the progress bar
  assert (tmp_path / "bench_custom.csv").exists() and (tmp_path / "bench_custom.png").exists()


def test_ab_report_gives_each_settings_mean_with_its_rounds_and_the_change_against_the_first():
  settings = [ab.Setting(()), ab.Setting((("X", "1"),))]
  res = [ab.Result(0, 0, "gcmoe", 4, 100.0, 90.0, 50.0), ab.Result(0, 1, "gcmoe", 4, 102.0, 91.0, 50.0),
         ab.Result(1, 0, "gcmoe", 4, 90.0, 80.0, 50.0), ab.Result(1, 1, "gcmoe", 4, 92.0, 81.0, 50.0),
         ab.Result(0, 0, "gcmoe", 8, -3.0, 1.0, 50.0), ab.Result(1, 0, "gcmoe", 8, 5.0, 4.0, 50.0)]
  md = ab.to_markdown(res, settings).splitlines()
  assert md[0] == f"| impl | B | 0: {settings[0].label} | 1: {settings[1].label} |"
  assert md[2] == "| gcmoe | 4 | 101.0 (100.0, 102.0) | 91.0 (90.0, 92.0) **-9.9 %** |"
  assert md[3] == "| gcmoe | 8 | -3.0 (-3.0) | 5.0 (5.0) |"  # a noisy (non-positive) base gives no ratio


_AB_TINY = ["--model", "custom", "--experts", "4", "--hidden", "512", "--intermediate", "256", "--topk", "2",
            "--batch", "1,2", "--iters", "1", "--warmup", "1", "--chain", "1", "--back-to-back", "1", "--bandwidth",
            "10", "--fp8-tflops", "1"]


def test_ab_runs_each_setting_in_its_own_process_and_reports_the_changes(tmp_path, capsys):
  """``--ab`` twice: one sweep per setting, each in a child process with its variables set, the report a row per
  point with each setting's latency and the change against the first, and a CSV of every child's points; a setting
  under which the sweep fails stops the run with exit 1, naming the setting and showing the child's output."""
  impl = "gcmoe:cpu" if dict(gm.explain().reasons)["cpu"].ok else "ragged_dot"
  # Five pairs of 4- and 8-program runs: one pair of 1 and 2 measured a negative marginal time on a busy 2-core CI.
  rc = cli.main(["bench", *_AB_TINY, "--iters", "5", "--back-to-back", "4", "--impl", impl, "--ab", "", "--ab",
                 "GCMOE_WAIT_TIMEOUT_MS=1500", "--rounds", "1", "--out", str(tmp_path)])
  out = capsys.readouterr()
  assert rc == 0, out.err
  assert "| impl | B | 0: (as is) | 1: GCMOE_WAIT_TIMEOUT_MS=1500 |" in out.out
  # The change column needs a positive first mean, which timing noise does not promise: its format is tested below.
  assert re.search(rf"\| {impl} \| 1 \| -?[0-9.]+ \(-?[0-9.]+\) \| -?[0-9.]+ \(-?[0-9.]+\)", out.out), out.out
  with open(tmp_path / "ab_custom.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert sorted((r["setting"], r["env"], r["batch"]) for r in rows) == [
    ("0", "(as is)", "1"), ("0", "(as is)", "2"), ("1", "GCMOE_WAIT_TIMEOUT_MS=1500", "1"),
    ("1", "GCMOE_WAIT_TIMEOUT_MS=1500", "2")]
  children = {}  # each child's own CSV, by setting and batch
  for setting in ("0", "1"):
    with open(tmp_path / "ab" / f"s{setting}_r0" / "bench_custom.csv", newline="") as f:
      children[setting] = {c["batch"]: c for c in csv.DictReader(f) if c["impl"] == impl}
  for r in rows:  # each child's own figures, carried over unchanged
    child = children[r["setting"]][r["batch"]]
    assert math.isfinite(float(r["latency_us"]))
    assert float(r["latency_us"]) == pytest.approx(float(child["latency_us"]), rel=1e-5)
    assert float(r["floor_us"]) == pytest.approx(float(child["floor_us"]), rel=1e-5)
    assert float(r["floor_us"]) > 0
  # The setting reaches the child's environment: a platform jax does not know makes that child fail.
  rc = cli.main(["bench", *_AB_TINY, "--impl", "ragged_dot", "--ab", "", "--ab", "JAX_PLATFORMS=nosuchplatform",
                 "--rounds", "1", "--out", str(tmp_path / "failing")])
  err = capsys.readouterr().err
  assert rc == 1
  assert "bench: --ab setting 1 (JAX_PLATFORMS=nosuchplatform), round 1: the sweep exited with" in err
  assert "nosuchplatform" in err.split("the sweep exited with", 1)[1]


@pytest.mark.parametrize("argv, match", [
  (["--ab", "GCMOE_SOLO_SMS=all"], r"bench: --ab needs at least two settings to compare, got 1"),
  (["--ab", "", "--ab", "GCMOE_SOLO_SMS"], r"bench: --ab 'GCMOE_SOLO_SMS': expected space-separated NAME=VALUE"),
  (["--ab", "", "--ab", "GCMOE_SOLO_SMZ=all"], r"bench: --ab 'GCMOE_SOLO_SMZ=all': GCMOE_SOLO_SMZ is not a gcmoe_jax "
                                                r"setting"),
  (["--ab", "", "--ab", "GCMOE_SOLO_SMS=most"], r"bench: --ab 'GCMOE_SOLO_SMS=most': GCMOE_SOLO_SMS must be compute "
                                                 r"or all, got 'most'"),
  (["--ab", "", "--ab", "A=1 A=2"], r"bench: --ab 'A=1 A=2': A is set twice"),
  (["--ab", "", "--ab", "A=1", "--rounds", "0"], r"bench: --rounds must be >= 1, got 0"),
  (["--rounds", "2"], r"bench: --rounds applies only with --ab, got --rounds 2 without it"),
  (["--model", "glm5.2", "--experts", "4", "--ab", "", "--ab", "A=1"],
   "bench: --experts applies only to --model custom, got --model glm5.2"),
])
def test_ab_argument_errors(argv, match, capsys):
  """Every --ab / --rounds mistake is refused before any sweep runs, naming the argument and what is accepted."""
  assert cli.main(["bench", *argv]) == 2
  assert re.match(match, capsys.readouterr().err)


def test_ab_children_get_every_option_of_the_parent():
  """The arguments a child sweep gets parse to the parent's own (but --ab, --rounds and --out): an option added to
  `bench` and not passed on would make the A/B compare something else than what was asked."""
  import argparse

  from gcmoe_jax.commands import bench
  parser = argparse.ArgumentParser()
  bench.register(parser.add_subparsers())
  full = ["bench", "--model", "custom", "--experts", "8", "--hidden", "1024", "--intermediate", "512", "--topk", "3",
          "--shared", "--shared-intermediate", "768", "--ranks", "4", "--batch", "1,3", "--impl",
          "ragged_dot,gcmoe:cpu", "--iters", "7", "--warmup", "3", "--clamp", "7.5", "--seed", "11",
          "--max-gather-gib", "2.5", "--bandwidth", "1234.5", "--bandwidth-mib", "96", "--fp8-tflops", "987.5",
          "--chain", "5", "--back-to-back", "3", "--ab", "", "--ab", "A=1", "--rounds", "3", "--out", "x"]
  for argv in (full, ["bench"]):
    parent = vars(parser.parse_args(argv))
    child = vars(parser.parse_args(["bench", *bench._child_argv(argparse.Namespace(**parent))]))
    for drop in ("ab", "rounds", "out", "func"):
      parent.pop(drop), child.pop(drop)
    assert child == parent


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_fused_benchs_collective_reference_equals_the_oracle(ranks):
  """`bench.fused.collective_on_one_gpu` (the collective transport's program for R ranks on one device, under
  ``jax.vmap(axis_name=...)``), here with the reference backend as the local op: bit-equal to `moe_emulated` on the
  global inputs, so the bench's check of the fused ranks against it is a check against the oracle."""
  from gcmoe_jax.bench import fused
  from gcmoe_jax.bench.problems import make_routes

  e, k, b = 4 * ranks, 4, 3
  rng = np.random.default_rng([7, ranks])
  w13 = jnp.asarray(rng.standard_normal((e, 512, 512)) / 22, jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((e, 256, 512)) / 16, jnp.float32)
  w = gm.formats.quantize_experts(w13, w2)
  ids, wt = make_routes(rng, "default", ranks * b, e, k)
  x = jnp.asarray(rng.standard_normal((ranks * b, 512)), jnp.bfloat16)
  stack = lambda a: jnp.asarray(np.asarray(a).reshape(ranks, b, *np.shape(a)[1:]))
  y = fused.collective_on_one_gpu(w, ranks, 10.0, backend="reference")(stack(x), stack(ids), stack(wt))
  want = reference.moe_emulated(x, w, jnp.asarray(ids), jnp.asarray(wt), clamp=10.0)
  np.testing.assert_array_equal(np.asarray(y).reshape(ranks * b, -1).view(np.uint16),
                                np.asarray(want).view(np.uint16))
