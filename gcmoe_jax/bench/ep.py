"""Expert parallelism end to end over R devices (issues 9, 11): dispatch, experts and combine of a whole layer.

Times ``gm.moe(..., backend=b, axis_name="ep", transport=t)`` inside `jax.shard_map` over the first R devices on
the paper's per-rank shapes (L = E / R local experts, B tokens per rank), against the JAX user's expert-parallel
baseline: the same exchange over ``ragged_all_to_all`` with BF16 `jax.lax.ragged_dot` experts (``baseline``; GPU
only, XLA:CPU does not implement ``ragged_all_to_all``). ``transport="fused"`` rows run ``gm.moe(...,
ep_axis="ep", transport="fused")`` on the sharded global arrays under `jax.jit` instead (the in-kernel transport
needs the mesh's devices; CUDA only), so fused and collective compare on the same shapes in one run.

Timing is `sweep`'s: one jitted program chains ``chain`` layers (a pre-norm residual stream: x + layer(rmsnorm(x))
is the next one's tokens, fresh routes per layer, two alternating weight copies), the median over ``iters`` runs of
program time / chain.
One process drives every device, so a program ends with its slowest rank: the latency is the maximum over ranks.

The floor of a point is the weight-streaming time of its busiest rank: per layer, the most distinct local experts
one rank's experts are hit by (over all R·B tokens' routes) times the MXFP4 bytes of one expert, at the device
bandwidth measured in the same run (`sweep.measure_bandwidth`), averaged over the chain. The exchange is not in it.
Rows are printed as they complete, so a point that stops the run does not lose the others.

  python -m gcmoe_jax.bench.ep --model glm5.2 --ranks 8 --batch 1,2,4,8,16 --impl gcmoe:cuda,baseline --out ep-results

writes ``ep_<model>_r<R>.csv`` and ``.png`` to ``--out`` (when given).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gcmoe_jax import api, formats, sharding
from gcmoe_jax.bench import baselines, sweep
from gcmoe_jax.bench.problems import make_routes

__all__ = ["EpRow", "floor_us", "measure", "plot", "program", "run", "to_markdown", "write_csv"]

TRANSPORTS = ("collective", "ragged")


@dataclasses.dataclass
class EpRow:
  """One (implementation, transport, B per rank) point on R devices; latency in microseconds (nan with a note)."""

  impl: str
  transport: str
  ranks: int
  batch: int
  latency_us: float = math.nan
  floor_us: float = math.nan
  note: str = ""


def _weights(shape: sweep.BenchShape, ranks: int, mesh: jax.sharding.Mesh, seed: int, bf16: bool):
  """(quantized, BF16-or-None) global weights of E = L R experts, generated and quantized on their devices."""
  e, h, i = shape.experts * ranks, shape.hidden, shape.intermediate

  def make(key):
    k1, k2 = jax.random.split(key)
    w13 = (jax.random.normal(k1, (e, h, 2 * i), jnp.float32) / math.sqrt(h)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (e, i, h), jnp.float32) / math.sqrt(i)).astype(jnp.bfloat16)
    return w13, w2

  experts = NamedSharding(mesh, P("ep"))
  w13, w2 = jax.jit(make, out_shardings=(experts, experts))(jax.random.key(seed))
  q = jax.jit(lambda a, b: formats.quantize_experts(a.astype(jnp.float32), b.astype(jnp.float32)))(w13, w2)
  q = jax.device_put(q, sharding.expert_shardings(q, mesh))
  return q, ((w13, w2) if bf16 else None)


def _inputs(shape: sweep.BenchShape, ranks: int, batch: int, seed: int, chain: int):
  """Global routes ``[chain, R B, k]`` (ids, weights; fresh per layer) and tokens ``[R B, H]`` bf16, as numpy."""
  e, t = shape.experts * ranks, batch * ranks
  rng = np.random.default_rng([seed, batch])
  routes = [make_routes(rng, "default", t, e, shape.top_k) for _ in range(chain)]
  x = rng.standard_normal((t, shape.hidden)).astype(jnp.bfloat16)
  return np.stack([r[0] for r in routes]).astype(np.int32), np.stack([r[1] for r in routes]), x


def floor_us(shape: sweep.BenchShape, ranks: int, batch: int, *, bandwidth: float, expert_bytes: float,
             seed: int = 0, chain: int = sweep.DEFAULT_CHAIN) -> float:
  """The weight-streaming floor of a point in microseconds (module doc): per layer, the busiest rank's distinct
  experts hit times ``expert_bytes`` at ``bandwidth`` bytes/s, averaged over the ``chain`` layers `program` runs."""
  ids = _inputs(shape, ranks, batch, seed, chain)[0]
  per_layer = []
  for layer in ids:
    hit = np.unique(layer[(layer >= 0) & (layer < shape.experts * ranks)])
    per_layer.append(np.bincount(hit // shape.experts, minlength=ranks).max())
  return 1e6 * float(np.mean(per_layer)) * expert_bytes / bandwidth


def program(shape: sweep.BenchShape, ranks: int, batch: int, impl: str, transport: str, *,
            chain: int = sweep.DEFAULT_CHAIN, seed: int = 0, weights=None):
  """``(f, args)``: the jitted chain of ``chain`` expert-parallel layers of ``impl`` (``gcmoe:<backend>`` or
  ``baseline``) on R devices, and its arguments ``(x, quantized weights, the two copies the layers read, ids
  [chain, T, k], weights [chain, T, k])`` (global arrays, sharded over the mesh)."""
  mesh = jax.make_mesh((ranks,), ("ep",), devices=jax.devices()[:ranks])
  q, bf = weights if weights is not None else _weights(shape, ranks, mesh, seed, impl == "baseline")
  # Two copies of the weights the layer reads (the baseline's BF16 pair; gcmoe's quantized experts).
  read = bf if impl == "baseline" else q
  copies = (read, sweep.copy_weights(read))
  ids, rw, x = (jnp.asarray(a) for a in _inputs(shape, ranks, batch, seed, chain))

  if impl == "baseline":
    def layer(x, q, read, ids, rw):
      # The exchange is the library's (it needs the quantized experts' count only); the experts are BF16
      # ragged_dot on this rank's slice of the BF16 weights.
      def local(x, w, ids, weights, *, clamp):
        del w
        return baselines.ragged_dot_moe(x, read[0], read[1], ids, weights, clamp=clamp)
      return sharding.moe_shard_map_body(x, q, ids, rw, axis_name="ep", local_fn=local, clamp=shape.clamp,
                                         transport=transport)
  else:
    backend = impl.split(":", 1)[1]

    def layer(x, q, read, ids, rw):
      return api.moe(x, read, api.Routes(ids, rw), clamp=shape.clamp, backend=backend, axis_name="ep",
                     transport=transport)

  tokens = NamedSharding(mesh, P("ep"))
  routes_spec = P(None, "ep")
  per_layer = NamedSharding(mesh, routes_spec)
  args = (jax.device_put(x, tokens), q, copies, jax.device_put(ids, per_layer), jax.device_put(rw, per_layer))
  if transport == "fused":
    # The in-kernel transport sees the mesh's devices only on sharded global arrays (ep_axis under jit).
    if impl == "baseline":
      raise ValueError("bench.ep: the baseline has no fused transport")

    def fused(x, q, copies, ids, rw):
      del q
      for n in range(chain):
        x = x + api.moe(sweep.pre_norm(x), copies[n % 2], api.Routes(ids[n], rw[n]), clamp=shape.clamp,
                        backend=backend, ep_axis="ep", transport="fused")  # `sweep`'s pre-norm residual stream
      return x

    return jax.jit(fused), args

  def body(x, q, copies, ids, rw):
    for n in range(chain):
      x = x + layer(sweep.pre_norm(x), q, copies[n % 2], ids[n], rw[n])  # `sweep`'s pre-norm residual stream
    return x

  qspec = sharding.expert_specs(q)
  rspec = (P("ep"), P("ep")) if impl == "baseline" else qspec
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), qspec, (rspec, rspec), routes_spec, routes_spec),
                            out_specs=P("ep")))
  return f, args


def measure(shape: sweep.BenchShape, ranks: int, batch: int, impl: str, transport: str, *, iters: int = 10,
            warmup: int = 2, chain: int = sweep.DEFAULT_CHAIN, seed: int = 0, weights=None) -> tuple[float, bool]:
  """Median seconds of one expert-parallel layer (``impl`` ``gcmoe:<backend>`` or ``baseline``) on R devices, and
  whether the chain's output was finite (checked after the timed runs)."""
  f, args = program(shape, ranks, batch, impl, transport, chain=chain, seed=seed, weights=weights)
  seconds = statistics.median(sweep.time_call(f, args, iters=iters, warmup=warmup)) / chain
  return seconds, bool(jnp.isfinite(f(*args)).all())


def run(shape: sweep.BenchShape, ranks: int, batches: Sequence[int], impls: Sequence[str],
        transports: Sequence[str] = TRANSPORTS, *, bandwidth: float | None = None,
        on_row: Callable[[EpRow], None] | None = None, **kw) -> list[EpRow]:
  """Every (impl, transport, B) point; the baseline runs on ``ragged`` only (the JAX user's choice). A point that
  cannot run here (no ``ragged_all_to_all`` on XLA:CPU, a backend that is unavailable) keeps its row with the
  reason. ``bandwidth`` (bytes/s) gives the floor; None measures it on the default device. ``on_row`` sees each
  row as it completes."""
  for impl in impls:
    if impl != "baseline" and not impl.startswith("gcmoe:"):
      raise ValueError(f"bench.ep: impl must be gcmoe:<backend> or baseline, got {impl!r}")
  if not 2 <= ranks <= len(jax.devices()):
    raise ValueError(f"bench.ep: ranks must be in [2, {len(jax.devices())}] (the devices here), got {ranks}")
  bandwidth = sweep.measure_bandwidth() if bandwidth is None else bandwidth
  # MXFP4 bytes of one expert, payload and scales: 3 H I elements at 4 bits plus one UE8M0 byte per 32.
  expert_bytes = 3 * shape.hidden * shape.intermediate * (0.5 + 1 / 32)
  floor_kw = {k: kw[k] for k in ("seed", "chain") if k in kw}
  if kw.get("weights") is None:  # generated and quantized once for every point (GLM5.2 at R = 2: 128 experts)
    mesh = jax.make_mesh((ranks,), ("ep",), devices=jax.devices()[:ranks])
    kw["weights"] = _weights(shape, ranks, mesh, kw.get("seed", 0), "baseline" in impls)
  rows = []
  for b in batches:
    floor = floor_us(shape, ranks, b, bandwidth=bandwidth, expert_bytes=expert_bytes, **floor_kw)
    for impl in impls:
      for t in (("ragged",) if impl == "baseline" else transports):
        row = EpRow(impl, t, ranks, b, floor_us=floor)
        try:
          seconds, finite = measure(shape, ranks, b, impl, t, **kw)
          row.latency_us = 1e6 * seconds
          if not finite:
            row.note = sweep.NOT_FINITE_NOTE
        except Exception as e:  # noqa: BLE001 - one point that cannot run must not lose the others
          row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
        if on_row is not None:
          on_row(row)
  return rows


_HEADER = ("| B per rank | R | impl | transport | median us per layer | floor us | x floor | vs baseline | note |\n"
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def _fmt(v: float, spec: str) -> str:
  return "-" if math.isnan(v) else format(v, spec)


def _line(r: EpRow, base: float) -> str:
  return (f"| {r.batch} | {r.ranks} | {r.impl} | {r.transport} | {_fmt(r.latency_us, '.1f')} | "
          f"{_fmt(r.floor_us, '.1f')} | {_fmt(r.latency_us / r.floor_us, '.1f')} | "
          f"{_fmt(base / r.latency_us, '.2f')}{'' if math.isnan(base / r.latency_us) else 'x'} | {r.note} |")


def to_markdown(rows: Sequence[EpRow]) -> str:
  base = {r.batch: r.latency_us for r in rows if r.impl == "baseline"}
  return "\n".join([_HEADER, *(_line(r, base.get(r.batch, math.nan)) for r in rows)])


def write_csv(rows: Sequence[EpRow], path: str | os.PathLike) -> None:
  fields = [f.name for f in dataclasses.fields(EpRow)]
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    for r in rows:
      w.writerow(dataclasses.asdict(r))


def plot(rows: Sequence[EpRow], path: str | os.PathLike, *, title: str = "") -> None:
  """A PNG with two panels over B: latency of each (implementation, transport) with the floor, and the speed-up
  over the baseline."""
  import matplotlib

  matplotlib.use("Agg")  # files only: no display on benchmark machines
  import matplotlib.pyplot as plt

  base = {r.batch: r.latency_us for r in rows if r.impl == "baseline"}
  fig, (ax_lat, ax_up) = plt.subplots(1, 2, figsize=(12, 5))
  for n, key in enumerate(dict.fromkeys((r.impl, r.transport) for r in rows)):
    pts = [r for r in rows if (r.impl, r.transport) == key and not math.isnan(r.latency_us)]
    if not pts:
      continue
    label = f"{key[0]} ({key[1]})"
    ax_lat.plot([r.batch for r in pts], [r.latency_us for r in pts], marker="o", color=f"C{n}", label=label)
    up = [(r.batch, base[r.batch] / r.latency_us) for r in pts if r.impl != "baseline" and r.batch in base]
    if up:
      ax_up.plot(*zip(*up), marker="o", color=f"C{n}", label=label)
  floor = sorted({(r.batch, r.floor_us) for r in rows if not math.isnan(r.floor_us)})
  if floor:
    ax_lat.plot(*zip(*floor), color="k", linestyle=":", label="weight-streaming floor (busiest rank)")
  sweep.style_axes(((ax_lat, "median latency per layer (us), max over ranks"),
                    (ax_up, "speed-up over ragged_all_to_all + BF16 ragged_dot")),
                   sorted({r.batch for r in rows}), "tokens per rank B")
  ax_up.axhline(1.0, color="k", linewidth=0.8)
  sweep.save_figure(fig, path, title)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="glm5.2", choices=["glm5.2", "dsv4.1-flash", "demo"])
  p.add_argument("--ranks", type=int, default=None, help="mesh size R (default: every device)")
  p.add_argument("--batch", default="1,2,4,8,16", help="tokens per rank, a comma list")
  p.add_argument("--impl", default="gcmoe:cuda,baseline", help="gcmoe:<backend> and/or baseline")
  p.add_argument("--transport", default="collective,ragged",
                 help="transports of the gcmoe rows: collective, ragged, fused (gcmoe:cuda on GPUs of one process)")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--chain", type=int, default=sweep.DEFAULT_CHAIN)
  p.add_argument("--out", default=None, help="directory for the CSV and PNG (default: print only)")
  args = p.parse_args(argv)
  ranks = args.ranks or len(jax.devices())
  shape = sweep.model_shape(args.model, ranks=ranks)
  bandwidth = sweep.measure_bandwidth()
  print(f"{ranks} x {jax.devices()[0].device_kind}; {shape.describe()} per rank; bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s\n{_HEADER}", flush=True)
  rows = run(shape, ranks, [int(v) for v in args.batch.split(",")], args.impl.split(","),
             args.transport.split(","), bandwidth=bandwidth, iters=args.iters, chain=args.chain,
             on_row=lambda r: print(_line(r, math.nan), flush=True))
  print("\nall points, with the baseline ratios:\n" + to_markdown(rows))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"ep_{args.model}_r{ranks}")
    write_csv(rows, stem + ".csv")
    written = [stem + ".csv"]
    try:
      plot(rows, stem + ".png", title=f"{shape.describe()} per rank, R = {ranks}\n"
                                      f"{jax.devices()[0].device_kind}, {bandwidth / 1e9:.0f} GB/s")
      written.append(stem + ".png")
    except ImportError:
      print("matplotlib is not installed: no plot (pip install 'gcmoe_jax[bench]')", file=sys.stderr)
    print(f"\nwrote {', '.join(written)}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
