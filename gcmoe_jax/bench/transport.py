"""The expert-parallel transports alone: `all_to_all` ("collective") against `ragged_all_to_all` ("ragged").

The per-rank expert op is replaced by one that returns its input rows, so what is timed is the dispatch of every
route to its expert's rank, the return of the rows and the owner's combine: the part the transport choice decides.
Per-rank shapes of the paper's GLM5.2 (H 6144, k 8, L = 32 local experts). Usage on a machine with R >= 2 devices:

  python -m gcmoe_jax.bench.transport --batch 1,8,64,256
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gcmoe_jax import formats, sharding


def _rows_back(x, w, ids, weights, *, clamp):
  """A stand-in expert op: each received row comes back unchanged (no expert math)."""
  del w, ids, weights, clamp
  return x


def measure(batch: int, ranks: int, *, hidden: int = 6144, top_k: int = 8, local_experts: int = 32,
            transport: str = "collective", iters: int = 20) -> float:
  """Median seconds of one expert-parallel layer with the stand-in op, B tokens per rank."""
  mesh = jax.make_mesh((ranks,), ("ep",), devices=jax.devices()[:ranks])
  e = local_experts * ranks
  # The stand-in op never reads the weights: the smallest Table 10 experts keep the arrays small.
  i = 256
  w = formats.ExpertWeights(jnp.zeros((e, hidden // 128, 2 * i, 64), jnp.int8), jnp.zeros((e, 2 * i, hidden // 128),
                            jnp.int32), jnp.zeros((e, i // 128, hidden, 64), jnp.int8),
                            jnp.zeros((e, hidden, i // 128), jnp.int32), None, e, hidden, i)
  rng = np.random.default_rng(0)
  t = batch * ranks
  x = jnp.asarray(rng.standard_normal((t, hidden)), jnp.bfloat16)
  ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :top_k], jnp.int32)
  wts = jnp.full((t, top_k), 1.0 / top_k, jnp.float32)

  def body(x, w, ids, wts):
    return sharding.moe_shard_map_body(x, w, ids, wts, axis_name="ep", local_fn=_rows_back, transport=transport)

  specs = (P("ep"), sharding.expert_specs(w), P("ep"), P("ep"))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("ep")))
  shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
  args = jax.device_put((x, w, ids, wts), shardings)
  f(*args).block_until_ready()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    f(*args).block_until_ready()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", default="1,8,64,256", help="tokens per rank, a comma list")
  p.add_argument("--ranks", type=int, default=None, help="mesh size (default: every device)")
  args = p.parse_args(argv)
  ranks = args.ranks or len(jax.devices())
  print(f"{ranks} x {jax.devices()[0].device_kind}; GLM5.2 per rank (H 6144, k 8, L 32); "
        "the expert op returns its rows")
  print("| B per rank | collective (all_to_all) us | ragged (ragged_all_to_all) us | ragged / collective |")
  print("| --- | --- | --- | --- |")
  for b in (int(v) for v in args.batch.split(",")):
    c = measure(b, ranks, transport="collective") * 1e6
    try:
      r = measure(b, ranks, transport="ragged") * 1e6
      cell, ratio = f"{r:.1f}", f"{r / c:.2f}"
    except Exception as e:  # noqa: BLE001 - XLA:CPU does not implement ragged_all_to_all: say so in the table
      cell, ratio = f"unavailable ({type(e).__name__})", "-"
    print(f"| {b} | {c:.1f} | {cell} | {ratio} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
