"""Latency sweep: `gcmoe_jax.moe` against BF16 JAX MoEs and the weight-streaming floor, over decode batch sizes.

One run times, on the default device, for every batch B in the sweep:

* ``ragged_dot``    BF16 weights, rows sorted by expert, `jax.lax.ragged_dot` for both GEMMs (`baselines`);
* ``dense_gather``  BF16 weights gathered per token and contracted with einsum (`baselines`);
* ``emulated``      `reference.moe_emulated` under `jax.jit` (the oracle; slow by design);
* ``gcmoe:<b>``     `gcmoe_jax.moe(..., backend=b)` for every backend `gcmoe_jax.explain` reports available.

Timing, as a decode step runs layers: one jitted program chains ``chain`` layers on a pre-norm residual stream
(x_n = x_{n-1} + layer(rmsnorm(x_{n-1})), one fused add and norm per layer for every implementation), every layer
with its own routes and alternating between two copies of the weights, so no layer finds its weights in L2 and no
input repeats. A run dispatches programs back to back, each reading the previous one's output as its residual
stream, as a jitted decode loop does, and ends with one `block_until_ready` (the only host synchronisation in the
timed region; inputs live on the device beforehand), so the host's dispatch of a program overlaps the device's
work on the one before. The program is compiled and run ``warmup`` times, then ``iters`` pairs of runs of
``back_to_back`` and ``2 back_to_back`` programs are timed (`time_marginal`); the latency of a point is the median
over the pairs of (the longer run's time less the shorter one's) / (``back_to_back`` x ``chain``): the device time
per layer of a long decode loop, what CUDA events around the layers would measure, without what a run pays once
(the first program's dispatch, the final wait; its median is the row's ``run_overhead_us``). Until 2026-12-04 the
latency was run time / (``back_to_back`` x ``chain``) of one run, which kept 1 / (4 x 8) of that once-per-run cost
in every layer: 11-31 us on the H200, 12 % of GLM5.2's per-rank layer at B = 1 and 1.4 % at B = 256 (docs/perf.md,
session 28). A point whose output is not finite, or whose longer runs were not slower (noise), says so in its note.

The floor of a batch is the larger of two times (issue 6):

* memory: reading, once, the quantized weights the batch must touch (the distinct experts its routes hit times the
  MXFP4 bytes of one expert, payload and scales, plus the shared expert's MXFP8 bytes) at the device memory
  bandwidth measured in the same run (`measure_bandwidth`);
* compute: the expert GEMMs' ``6 H I`` FLOPs per routed assignment (``6 H Is`` per token for the shared expert) at
  the dense FP8 GEMM rate measured in the same run (`measure_fp8_rate`).

It holds for every implementation (BF16 baselines read 3.8x more bytes, so they cannot reach it).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import api, formats, geometry, reference
from gcmoe_jax.bench import baselines
from gcmoe_jax.bench.problems import DEMO_SHAPE, make_routes

__all__ = ["BASELINES", "IMPLS", "BenchShape", "Row", "bandwidth_probes", "check_counts", "default_impls",
           "expert_bytes", "measure_bandwidth", "measure_fp8_rate", "model_shape", "plot", "run", "time_back_to_back",
           "time_marginal", "to_markdown", "write_csv"]

BASELINES = ("ragged_dot", "dense_gather")
IMPLS = (*BASELINES, "emulated", *(f"gcmoe:{b}" for b in api.BACKENDS if b != "auto"))
DEFAULT_RANKS = 8
DEFAULT_MAX_GATHER_BYTES = 8 << 30
DEFAULT_CHAIN = 8
DEFAULT_BACK_TO_BACK = 4
NOT_FINITE_NOTE = "output not finite: the timed layers ran exceptional paths"
NOT_POSITIVE_NOTE = "timing noise: the longer runs were not slower (raise --iters or --back-to-back)"
CSV_COLUMNS = ("model", "device", "impl", "batch", "experts", "hidden", "intermediate", "top_k",
               "shared_intermediate", "distinct_experts", "weight_bytes", "bandwidth_gbs", "flops", "fp8_tflops",
               "floor_us", "floor_term", "latency_us", "min_us", "run_overhead_us", "latency_over_floor", "floor_pct",
               *(f"speedup_vs_{b}" for b in BASELINES), "note")


@dataclasses.dataclass(frozen=True)
class BenchShape:
  """One rank's MoE layer: E local experts of H x I, top-k, an optional shared expert (Is, K-group)."""

  name: str
  experts: int
  hidden: int
  intermediate: int
  top_k: int
  shared_intermediate: int | None = None
  shared_group: int = 128
  clamp: float | None = None

  def __post_init__(self):
    # H, I and Is are checked by quantize_experts; k is checked here because the baselines never call gm.moe.
    if not 1 <= self.top_k <= min(api.MAX_TOP_K, self.experts):
      raise ValueError(f"bench: top-k must be in [1, min(32, E)] = [1, {min(api.MAX_TOP_K, self.experts)}], got "
                       f"{self.top_k}")

  def describe(self) -> str:
    shared = f", shared Is={self.shared_intermediate} (group {self.shared_group})" if self.shared_intermediate else ""
    return (f"{self.name}: E={self.experts} local experts, H={self.hidden}, I={self.intermediate}, "
            f"top-{self.top_k}{shared}, clamp={self.clamp}")


def model_shape(model: str, *, ranks: int = DEFAULT_RANKS, shared: bool = False,
                clamp: float | None = None) -> BenchShape:
  """The per-rank shape of a preset: ``"demo"`` (`problems.DEMO_SHAPE`) or a `geometry.MODELS` key.

  A preset's E experts are split over ``ranks`` (L = E / R local experts, each hit by all k routes of a token).

  Raises:
    ValueError: for an unknown model or ranks that do not divide E.
  """
  if model == "demo":
    s = DEMO_SHAPE
    return BenchShape("demo", s.experts, s.hidden, s.intermediate, s.top_k,
                      s.shared_intermediate if shared else None, s.shared_group, clamp)
  if model not in geometry.MODELS:
    raise ValueError(f"bench: model must be one of {['demo', *geometry.MODELS]}, got {model!r}")
  m = geometry.MODELS[model]
  if ranks < 1 or m.E % ranks:
    raise ValueError(f"bench: ranks must divide {m.name}'s E = {m.E}, got {ranks}")
  local = m.E // ranks
  return BenchShape(m.name, local, m.H, m.I, min(m.k, local), m.shared_I if shared else None, m.shared_group, clamp)


def default_impls() -> tuple[str, ...]:
  """The baselines, the emulation, and `gcmoe:<b>` for each backend `explain` reports available here."""
  available = [name for name, s in api.explain().reasons if s.ok]
  return (*BASELINES, "emulated", *(f"gcmoe:{b}" for b in available))


# -----------------------------------------------------------------------------------------------------------------
# Measurement
# -----------------------------------------------------------------------------------------------------------------


def time_call(fn: Callable[..., Any], args: Sequence[Any], *, iters: int, warmup: int) -> list[float]:
  """Seconds of each of ``iters`` calls ``fn(*args)`` after ``warmup`` calls (the first compiles)."""
  return time_back_to_back(fn, args, iters=iters, warmup=warmup, depth=1)


def _run_seconds(fn: Callable[..., Any], args: Sequence[Any], depth: int) -> float:
  """Seconds of one run: ``depth`` calls ``x = fn(x, *args[1:])`` from ``x = args[0]``, then a wait for the last."""
  x = args[0]
  rest = tuple(args[1:])
  t0 = time.perf_counter()
  for _ in range(depth):
    x = fn(x, *rest)
  jax.block_until_ready(x)
  return time.perf_counter() - t0


def time_back_to_back(fn: Callable[..., Any], args: Sequence[Any], *, iters: int, warmup: int,
                      depth: int) -> list[float]:
  """Seconds per program of each of ``iters`` runs after ``warmup`` untimed ones: a run dispatches ``depth`` calls,
  ``x = fn(x, *args[1:])`` from ``x = args[0]`` (so ``fn`` returns its first argument's shape and type), and waits
  for the last. With ``depth`` > 1 the device runs the programs back to back while the host dispatches the next."""
  for _ in range(max(warmup, 1)):
    _run_seconds(fn, args, depth)
  return [_run_seconds(fn, args, depth) / depth for _ in range(iters)]


def time_marginal(fn: Callable[..., Any], args: Sequence[Any], *, iters: int, warmup: int,
                  depth: int) -> tuple[list[float], list[float]]:
  """Seconds per program in a long decode loop, without the cost a run pays once: ``iters`` pairs of runs (as in
  `time_back_to_back`) of ``depth`` and of ``2 depth`` programs, after ``warmup`` untimed pairs.

  A run of d programs takes F + d P: P the time of one more program, F what the run pays once (the first
  program's dispatch before the device starts, the final wait's wake-up, a device idle since the last run). Each
  pair gives P = (t(2 d) - t(d)) / d and F = 2 t(d) - t(2 d); returned as (P per pair, F per pair). The longer run
  goes first in every other pair, so neither always follows an idle device."""
  for _ in range(max(warmup, 1)):
    _run_seconds(fn, args, depth)
    _run_seconds(fn, args, 2 * depth)
  per_program, per_run = [], []
  for i in range(iters):
    if i % 2:
      t2 = _run_seconds(fn, args, 2 * depth)
      t1 = _run_seconds(fn, args, depth)
    else:
      t1 = _run_seconds(fn, args, depth)
      t2 = _run_seconds(fn, args, 2 * depth)
    per_program.append((t2 - t1) / depth)
    per_run.append(2 * t1 - t2)
  return per_program, per_run


def bandwidth_probes(nbytes: int | None = None, *, iters: int = 10, passes: int = 8,
                     depth: int = 4) -> dict[str, float]:
  """Device memory bandwidth in bytes/s by each probe (`measure_bandwidth` keeps the fastest).

  The copy (``x + 1``: read once, written once) is the usual probe on GPUs. On CPU, each call's output is a fresh
  allocation whose first touch page-faults, which caps the copy at a few GB/s; weight streaming only reads, so the
  read pass (a scaled sum) is measured too. Each kind is timed three ways: one pass per program (``"copy"``,
  ``"read"``); ``passes`` dependent passes in a loop (``"copy x8"``...), whose programs spread the dispatch and the
  host synchronisation of a call over the passes (one pass per call alone measured 2.2-3.3 TB/s on the H200, whose
  copies run at ~4.3 TB/s: a floor from it was up to 1.5x too generous); and one pass per program back to back
  (``"copy b2b"``, ``"read b2b"``: `time_marginal` over runs of ``depth`` and 2 ``depth`` programs, the way the
  operators are timed, so neither a run's dispatch nor its final wait is in it: with the first two kinds alone one
  H100 read 2670 and 2921 GB/s in two bench processes a minute apart; on another the back-to-back read gave
  3124-3129 GB/s in nine readings where the looped one gave 2990-3009, session 50). A back-to-back probe whose median
  difference is not positive (a noisy host on a buffer the caches hold) is left out.

  Args:
    nbytes: buffer size; defaults to 1 GiB on accelerators (far beyond their caches) and 64 MiB on CPU.
    iters: timed programs, or pairs of runs, of each probe (median).
    passes: passes over the buffer per program of the looped probes.
    depth: programs in the shorter run of a back-to-back probe's pairs.
  """
  if nbytes is None:
    nbytes = (64 << 20) if jax.default_backend() == "cpu" else (1 << 30)
  x = jnp.ones((nbytes // 4,), jnp.float32)
  # `+ 1`, not `+ 0`: XLA may simplify `x + 0` to the input buffer and move nothing; the read pass scales by the
  # loop index so no pass is loop-invariant.
  def copy(n):
    return jax.jit(lambda a: jax.lax.fori_loop(0, n, lambda i, b: b + 1.0, a))

  def read(n):
    return jax.jit(lambda a: jax.lax.fori_loop(0, n, lambda i, t: t + jnp.sum(a * (i + 1).astype(a.dtype)),
                                               jnp.zeros((), a.dtype)))

  out = {}
  for n in sorted({1, passes}):
    for name, probe, traffic in (("copy", copy(n), 2), ("read", read(n), 1)):
      seconds = statistics.median(time_call(probe, (x,), iters=iters, warmup=2)) / n
      out[name if n == 1 else f"{name} x{n}"] = traffic * x.nbytes / seconds
  # Back to back: each program's output is the next one's first argument (`time_marginal`), so the read pass
  # carries its running sum.
  read_b2b = jax.jit(lambda t, a: t + jnp.sum(a))
  for name, probe, args, traffic in (("copy b2b", copy(1), (x,), 2), ("read b2b", read_b2b, (jnp.zeros(()), x), 1)):
    seconds = statistics.median(time_marginal(probe, args, iters=iters, warmup=2, depth=depth)[0])
    if seconds > 0:
      out[name] = traffic * x.nbytes / seconds
  return out


def measure_bandwidth(nbytes: int | None = None, *, iters: int = 10, passes: int = 8) -> float:
  """Device memory bandwidth in bytes/s: the fastest of `bandwidth_probes` (so the floor stays a lower bound on
  time; XLA:CPU runs the looped passes slower than single ones, the GPU's single passes pay their dispatch)."""
  return max(bandwidth_probes(nbytes, iters=iters, passes=passes).values())


def measure_fp8_rate(n: int | None = None, *, iters: int = 10) -> float:
  """Dense FP8 GEMM rate in FLOP/s: ``[n, n] x [n, n]`` E4M3 operands, FP32 result, under `jax.jit` (cuBLASLt on
  Hopper). ``n`` defaults to 8192 on accelerators and 256 on CPU (where XLA emulates FP8 and the rate only keeps
  the compute floor of CPU runs honest, not meaningful)."""
  if n is None:
    n = 256 if jax.default_backend() == "cpu" else 8192
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(jnp.float8_e4m3fn)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(jnp.float8_e4m3fn)
  f = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32))  # both operands K-major
  return 2 * n**3 / statistics.median(time_call(f, (a, b), iters=iters, warmup=2))


def expert_bytes(w: formats.ExpertWeights) -> tuple[float, int]:
  """(MXFP4 bytes of one routed expert incl. scales, MXFP8 bytes of the shared expert incl. scales or 0)."""
  routed = sum(a.nbytes for a in (w.w13, w.w13_scale, w.w2, w.w2_scale)) / w.num_experts
  s = w.shared
  shared = 0 if s is None else sum(a.nbytes for a in (s.s13, s.s13_scale, s.s2, s.s2_scale))
  return routed, shared


@dataclasses.dataclass
class Row:
  """One (implementation, batch) measurement; times in microseconds (nan when skipped, with a note)."""

  model: str
  device: str
  impl: str
  batch: int
  shape: BenchShape
  distinct_experts: int
  weight_bytes: int
  bandwidth: float  # bytes/s
  flops: float = 0.0  # expert GEMM FLOPs of one call (6 H I per assignment, 6 H Is per token for the shared)
  fp8_rate: float = math.inf  # FLOP/s
  latency_us: float = math.nan
  min_us: float = math.nan
  run_overhead_us: float = math.nan  # what a timed run pays once (`time_marginal`'s F), not per layer
  speedup: dict[str, float] = dataclasses.field(default_factory=dict)
  note: str = ""

  @property
  def floor_us(self) -> float:
    return max(1e6 * self.weight_bytes / self.bandwidth, 1e6 * self.flops / self.fp8_rate)

  @property
  def floor_term(self) -> str:
    """Which bound the floor is: "memory" or "compute"."""
    return "compute" if self.flops / self.fp8_rate > self.weight_bytes / self.bandwidth else "memory"

  @property
  def latency_over_floor(self) -> float:
    return self.latency_us / self.floor_us

  def as_dict(self) -> dict[str, Any]:
    s = self.shape
    d = {"model": self.model, "device": self.device, "impl": self.impl, "batch": self.batch, "experts": s.experts,
         "hidden": s.hidden, "intermediate": s.intermediate, "top_k": s.top_k,
         "shared_intermediate": s.shared_intermediate or 0, "distinct_experts": self.distinct_experts,
         "weight_bytes": self.weight_bytes, "bandwidth_gbs": self.bandwidth / 1e9, "flops": self.flops,
         "fp8_tflops": self.fp8_rate / 1e12, "floor_us": self.floor_us, "floor_term": self.floor_term,
         "latency_us": self.latency_us, "min_us": self.min_us, "run_overhead_us": self.run_overhead_us,
         "latency_over_floor": self.latency_over_floor,
         "floor_pct": 100.0 / self.latency_over_floor, "note": self.note}
    for b in BASELINES:
      d[f"speedup_vs_{b}"] = self.speedup.get(b, math.nan)
    return d


class _Problem:
  """The layer's weights (BF16 for the baselines, quantized for the rest), on the device, built once per shape."""

  def __init__(self, shape: BenchShape, seed: int):
    self.shape = shape
    s = shape
    self.bf16 = _random_bf16_weights(jax.random.key(seed), s.experts, s.hidden, s.intermediate,
                                     s.shared_intermediate)
    w13, w2, shared = self.bf16
    # Under jit: quantizing eagerly dispatches many small ops; random normals need no finiteness check.
    self.quantized = jax.jit(formats.quantize_experts, static_argnames="shared_group")(
      w13, w2, shared=shared, shared_group=s.shared_group)
    self.routed_bytes, self.shared_bytes = expert_bytes(self.quantized)
    self.seed = seed

  # Two copies of each weight set (same values, other buffers): consecutive layers of a timed chain alternate, so a
  # layer never finds its weights in L2. Made on first use: a run that times no baseline copies no BF16 weights.
  @functools.cached_property
  def bf16_sets(self) -> tuple[Any, Any]:
    return self.bf16, copy_weights(self.bf16)

  @functools.cached_property
  def quantized_sets(self) -> tuple[Any, Any]:
    return self.quantized, copy_weights(self.quantized)

  def inputs(self, batch: int, chain: int = 1) -> tuple[jax.Array, jax.Array, jax.Array, float, float]:
    """x bf16 [B, H]; ids int32 [chain, B, k] and weights float32 [chain, B, k], fresh routes per layer; the mean
    over the layers of the distinct experts hit and of the valid assignments."""
    s = self.shape
    rng = np.random.default_rng([self.seed, batch])
    x = jnp.asarray(rng.standard_normal((batch, s.hidden), np.float32), jnp.bfloat16)
    routes = [make_routes(rng, "default", batch, s.experts, s.top_k) for _ in range(chain)]
    ids = np.stack([r[0] for r in routes])
    weights = np.stack([r[1] for r in routes])
    distinct = float(np.mean([np.unique(i[i >= 0]).size for i in ids]))
    assignments = float(np.mean([(i >= 0).sum() for i in ids]))
    return x, jnp.asarray(ids), jnp.asarray(weights), distinct, assignments


def copy_weights(tree: Any) -> Any:
  """A copy of every array of ``tree`` in new buffers (same values, same shardings)."""
  return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), tree)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_bf16_weights(key: jax.Array, e: int, h: int, i: int, i_s: int | None):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(jnp.bfloat16)
  shared = None if i_s is None else (normal(k3, (h, 2 * i_s), h), normal(k4, (i_s, h), i_s))
  return normal(k1, (e, h, 2 * i), h), normal(k2, (e, i, h), i), shared


def _layer(impl: str, clamp: float | None) -> Callable:
  """``layer(x, weights, ids, rw) -> y`` of ``impl`` (weights: the BF16 triple or `ExpertWeights`)."""
  if impl in BASELINES:
    f = baselines.ragged_dot_moe if impl == "ragged_dot" else baselines.dense_gather_moe
    return lambda x, w, ids, rw: f(x, w[0], w[1], ids, rw, shared=w[2], clamp=clamp)
  if impl == "emulated":
    return lambda x, w, ids, rw: reference.moe_emulated(x, w, ids, rw, clamp=clamp)
  backend = impl.split(":", 1)[1]
  return lambda x, w, ids, rw: api.moe(x, w, api.Routes(ids, rw), clamp=clamp, backend=backend)


def pre_norm(x: jax.Array) -> jax.Array:
  """RMS-normalized rows of ``x`` (in f32, returned in x's dtype): a decoder's pre-norm, the input of a layer of the
  timed chain. Without it the residual stream grows quadratically (the SwiGLU of large inputs): with the paper
  models' random weights past 1e3 by layer 13 and Inf by layer 16, so the later layers of a long chain ran the
  kernels' exceptional-exponent and NaN paths (2x slower per layer at GLM5.2 B = 64, docs/perf.md session 14)."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def _impl_call(impl: str, p: _Problem, x: jax.Array, ids: jax.Array, rw: jax.Array) -> tuple[Callable, tuple]:
  """The jitted chain of ``impl`` over the layers' routes ``ids``/``rw`` ``[chain, B, k]``, and its arguments
  (weights are arguments, never baked-in constants): layer n reads weight copy n % 2 and
  x_n = x_{n-1} + layer(pre_norm(x_{n-1}))."""
  layer = _layer(impl, p.shape.clamp)
  chain = int(ids.shape[0])

  def run(x, sets, ids, rw):
    for n in range(chain):
      # A pre-norm residual stream, as in a decoder: without the residual the activations shrink ~10x per layer and
      # quadratically (the SwiGLU of small inputs), by layer 4 ~1e-19 and then zero; without the norm they grow
      # quadratically to Inf (`pre_norm`). Either way the layers leave every kernel's common path.
      x = x + layer(pre_norm(x), sets[n % 2], ids[n], rw[n])
    return x

  sets = p.bf16_sets if impl in BASELINES else p.quantized_sets
  return jax.jit(run), (x, sets, ids, rw)


def check_impls(impls: Sequence[str]) -> None:
  """Raises ValueError for an unknown implementation, RuntimeError for a `gcmoe:<b>` that cannot run here."""
  for impl in impls:
    if impl not in IMPLS:
      raise ValueError(f"bench: impl must be among {list(IMPLS)}, got {impl!r}")
    if impl.startswith("gcmoe:"):
      backend = impl.split(":", 1)[1]
      e = api.explain(backend)
      if e.backend is None:
        raise RuntimeError(f"moe: backend={backend!r} cannot run here: {dict(e.reasons)[backend].reason}")


class Progress:
  """A one-line ``\\r`` progress bar on a text stream (stderr), without dependencies."""

  def __init__(self, total: int, stream: TextIO | None = None, width: int = 30):
    self.total, self.done, self.width = total, 0, width
    self.stream = sys.stderr if stream is None else stream
    self.t0 = time.perf_counter()

  def step(self, label: str) -> None:
    filled = self.width * self.done // max(self.total, 1)
    elapsed = time.perf_counter() - self.t0
    self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                      f"{elapsed:5.1f}s  {label:<28}")
    self.stream.flush()
    self.done += 1

  def close(self) -> None:
    self.done = self.total
    self.step("done")
    self.stream.write("\n")
    self.stream.flush()


def check_counts(batches: Sequence[int], *, iters: int, chain: int, back_to_back: int) -> None:
  """Raises ValueError naming the first of `run`'s counts below 1."""
  if any(b < 1 for b in batches):
    raise ValueError(f"bench: batch sizes must be >= 1, got {list(batches)}")
  if iters < 1:
    raise ValueError(f"bench: iters must be >= 1, got {iters}")
  if chain < 1:
    raise ValueError(f"bench: chain must be >= 1, got {chain}")
  if back_to_back < 1:
    raise ValueError(f"bench: back_to_back must be >= 1, got {back_to_back}")


def run(shape: BenchShape, batches: Sequence[int], impls: Sequence[str] | None = None, *, iters: int = 10,
        warmup: int = 2, seed: int = 0, bandwidth: float | None = None, bandwidth_nbytes: int | None = None,
        fp8_rate: float | None = None, chain: int = DEFAULT_CHAIN, back_to_back: int = DEFAULT_BACK_TO_BACK,
        max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES, progress: bool = True) -> list[Row]:
  """Times every implementation at every batch size; one `Row` each, baseline speed-ups filled in.

  Args:
    shape: the layer (`model_shape` or a custom `BenchShape`).
    batches: tokens per call, B.
    impls: names from `IMPLS`; default `default_impls()`.
    iters, warmup: timed pairs of runs (`time_marginal`; the median reported) and untimed pairs before them.
    seed: weights and routes seed (random, never zeros).
    bandwidth: bytes/s for the floor; measured with `measure_bandwidth` when None.
    bandwidth_nbytes: the probe's buffer size (`measure_bandwidth`'s default when None).
    fp8_rate: dense FP8 GEMM FLOP/s for the compute floor; measured with `measure_fp8_rate` when None.
    chain: layers per timed program (module docstring).
    back_to_back: programs dispatched in the shorter run of a timed pair, each on the previous one's output (the
      longer run dispatches twice as many; module docstring).
    max_gather_bytes: ``dense_gather`` is skipped (with a note) when one slot's gathered weights exceed this.
    progress: draw a progress bar on stderr.

  Raises:
    ValueError, RuntimeError: from `check_impls`; ValueError for a batch, iters, chain or back_to_back < 1.
  """
  impls = tuple(default_impls() if impls is None else impls)
  check_impls(impls)
  check_counts(batches, iters=iters, chain=chain, back_to_back=back_to_back)
  bar = Progress((bandwidth is None) + (fp8_rate is None) + len(batches) * len(impls)) if progress else None
  if bar and bandwidth is None:
    bar.step("measuring bandwidth")
  bw = measure_bandwidth(bandwidth_nbytes) if bandwidth is None else bandwidth
  if bar and fp8_rate is None:
    bar.step("measuring the FP8 GEMM rate")
  rate = measure_fp8_rate() if fp8_rate is None else fp8_rate
  device = jax.devices()[0].device_kind
  p = _Problem(shape, seed)
  rows = []
  for b in batches:
    x, ids, rw, distinct, assignments = p.inputs(b, chain)
    weight_bytes = round(distinct * p.routed_bytes) + p.shared_bytes
    flops = 6.0 * shape.hidden * (assignments * shape.intermediate + b * (shape.shared_intermediate or 0))
    for impl in impls:
      if bar:
        bar.step(f"{impl} B={b}")
      row = Row(shape.name, device, impl, b, shape, round(distinct), weight_bytes, bw, flops, rate)
      gathered = baselines.dense_gather_bytes(b, shape.hidden, shape.intermediate)
      if impl == "dense_gather" and gathered > max_gather_bytes:
        row.note = f"skipped: gathers {gathered / 2**30:.1f} GiB per slot (> --max-gather-gib)"
      else:
        fn, args = _impl_call(impl, p, x, ids, rw)
        try:
          times, per_run = time_marginal(fn, args, iters=iters, warmup=warmup, depth=back_to_back)
          finite = bool(jnp.isfinite(fn(*args)).all())  # outside the timed runs
        except Exception as e:  # noqa: BLE001 - one failing point (e.g. out of memory) must not lose the sweep
          row.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        else:
          row.latency_us, row.min_us = 1e6 * statistics.median(times) / chain, 1e6 * min(times) / chain
          row.run_overhead_us = 1e6 * statistics.median(per_run)
          if not row.latency_us > 0:
            row.note = NOT_POSITIVE_NOTE
          elif not finite:
            row.note = NOT_FINITE_NOTE
      rows.append(row)
  if bar:
    bar.close()
  _fill_speedups(rows)
  return rows


def _fill_speedups(rows: list[Row]) -> None:
  base = {(r.impl, r.batch): r.latency_us for r in rows if r.impl in BASELINES}
  for r in rows:
    r.speedup = {b: base.get((b, r.batch), math.nan) / r.latency_us for b in BASELINES}


# -----------------------------------------------------------------------------------------------------------------
# Reports
# -----------------------------------------------------------------------------------------------------------------


def write_csv(rows: Sequence[Row], path: str | os.PathLike) -> None:
  """One line per row, columns `CSV_COLUMNS`."""
  with open(path, "w", newline="") as f:
    out = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
    out.writeheader()
    for r in rows:
      out.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.as_dict().items()})


def _fmt(v: float, spec: str) -> str:
  return "-" if math.isnan(v) else format(v, spec)


def to_markdown(rows: Sequence[Row]) -> str:
  """A Markdown table: latency, floor, latency / floor and the speed-up over each baseline."""
  head = ["impl", "B", "experts hit", "median us", "floor us (term)", "x floor", "% of floor",
          *(f"vs {b}" for b in BASELINES), "note"]
  lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for r in rows:
    cells = [r.impl, str(r.batch), str(r.distinct_experts), _fmt(r.latency_us, ".1f"),
             f"{_fmt(r.floor_us, '.2f')} ({r.floor_term})",
             _fmt(r.latency_over_floor, ".1f"), _fmt(100.0 / r.latency_over_floor, ".2f"),
             *(_fmt(r.speedup[b], ".2f") + "x" if not math.isnan(r.speedup[b]) else "-" for b in BASELINES), r.note]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def save_figure(fig: Any, path: str | os.PathLike, title: str) -> None:
  """Titles, lays out, writes (110 dpi) and closes a figure."""
  import matplotlib.pyplot as plt

  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def style_axes(axes: Sequence[tuple[Any, str]], batches: Sequence[int], xlabel: str) -> None:
  """Log-log panels over the batch sizes (one tick per batch), each with its y label, a grid and a legend."""
  import matplotlib.ticker

  for ax, ylabel in axes:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=7)


def plot(rows: Sequence[Row], path: str | os.PathLike, *, title: str = "") -> None:
  """A PNG with three panels over B: latency per implementation, speed-up over each baseline, % of the floor."""
  import matplotlib

  matplotlib.use("Agg")  # files only: no display on benchmark machines
  import matplotlib.pyplot as plt

  impls = list(dict.fromkeys(r.impl for r in rows))
  colors = {impl: f"C{n}" for n, impl in enumerate(impls)}  # one color per implementation in every panel
  fig, (ax_lat, ax_up, ax_floor) = plt.subplots(1, 3, figsize=(17, 5))
  for impl in impls:
    pts = [r for r in rows if r.impl == impl and not math.isnan(r.latency_us)]
    if not pts:
      continue
    bs, c = [r.batch for r in pts], colors[impl]
    ax_lat.plot(bs, [r.latency_us for r in pts], marker="o", color=c, label=impl)
    ax_floor.plot(bs, [100.0 / r.latency_over_floor for r in pts], marker="o", color=c, label=impl)
    if impl not in BASELINES:
      for b, style in zip(BASELINES, ("-", "--")):
        up = [(r.batch, r.speedup[b]) for r in pts if not math.isnan(r.speedup[b])]
        if up:
          ax_up.plot(*zip(*up), marker="o", color=c, linestyle=style, label=f"{impl} vs {b}")
  floor = sorted({(r.batch, r.floor_us) for r in rows})
  ax_lat.plot(*zip(*floor), color="k", linestyle=":", label="weight-streaming floor")
  style_axes(((ax_lat, "median latency (us)"), (ax_up, "speed-up (baseline latency / latency)"),
              (ax_floor, "% of the weight-streaming floor (floor / latency)")),
             sorted({r.batch for r in rows}), "tokens per call B")
  ax_up.axhline(1.0, color="k", linewidth=0.8)
  save_figure(fig, path, title)
