"""The fused EP transport on one GPU with virtual ranks (issue 9): R ranks sharing the device, against one rank.

Each virtual rank holds the paper's per-rank experts (L = E_model / 8, so the layer has E = R L experts) and B
tokens, with its own green-context pair of the GPU (`ffi.VirtualRanks`); all R graphs run at once. The reference
point is ONE rank computing the same whole layer (E = R L experts, T = R B tokens) with the local operator on the
whole device: the same expert work without a transport, on more SMs. Both are timed back to back over ``iters``
steps with the same inputs (host wall time per step after a warm-up). The floor is the weight-streaming time of
the busiest rank (its distinct local experts hit x one expert's MXFP4 bytes at the bandwidth measured in the same
run), as in `bench.ep`.

  python -m gcmoe_jax.bench.fused --model glm5.2 --ranks 2 --batch 1,2,4,8,16

needs cubins for the fused variants (``build-kernels --preset fused``) and for the one-rank layer (the local
variants of E = R L experts at capacities 8, 16, 32, 64).
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import api, ffi, formats, geometry
from gcmoe_jax.bench import sweep
from gcmoe_jax.bench.problems import make_routes

__all__ = ["main", "measure"]

CAPACITY = 16  # tokens per rank of the `fused` preset's variants


def _weights(e: int, h: int, i: int, seed: int) -> formats.ExpertWeights:
  def make(key):
    k1, k2 = jax.random.split(key)
    w13 = jax.random.normal(k1, (e, h, 2 * i), jnp.float32) / math.sqrt(h)
    w2 = jax.random.normal(k2, (e, i, h), jnp.float32) / math.sqrt(i)
    return formats.quantize_experts(w13, w2)

  return jax.jit(make)(jax.random.key(seed))


def measure(w: formats.ExpertWeights, top_k: int, ranks: int, batch: int, *, iters: int, clamp: float | None,
            seed: int = 0, reference: bool = True) -> tuple[float, float, np.ndarray]:
  """(fused seconds per step, one-rank seconds per step (NaN without ``reference``), global ids) of one point."""
  t = ranks * batch
  rng = np.random.default_rng([seed, batch])
  ids, rw = make_routes(rng, "default", t, w.num_experts, top_k)
  x = jnp.asarray(rng.standard_normal((t, w.hidden)), jnp.bfloat16)
  split = lambda a: [jnp.asarray(p) for p in np.split(np.asarray(a), ranks)]
  with ffi.VirtualRanks(w, top_k=top_k, ranks=ranks, capacity=CAPACITY, tokens=[batch] * ranks,
                        clamp=clamp) as vr:
    args = (split(x), split(ids), split(rw))
    vr.run(*args, repeat=max(2, iters // 10))
    _, fused = vr.run(*args, repeat=iters)
  if not reference:
    return fused, float("nan"), ids
  f = jax.jit(lambda x, w, i, wt: api.moe(x, w, api.Routes(i, wt), clamp=clamp, backend="cuda"))
  a = (x, w, jnp.asarray(ids), jnp.asarray(rw))
  f(*a).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(iters):
    y = f(*a)
  y.block_until_ready()
  return fused, (time.perf_counter() - t0) / iters, ids


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="glm5.2", choices=sorted(geometry.MODELS))
  p.add_argument("--ranks", type=int, default=2, help="virtual ranks R (default 2)")
  p.add_argument("--batch", default="1,2,4,8,16", help=f"tokens per rank, a comma list (at most {CAPACITY})")
  p.add_argument("--iters", type=int, default=200)
  p.add_argument("--clamp", type=float, default=10.0)
  p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                 help="also time one rank computing the whole layer (needs its local cubins; default on)")
  args = p.parse_args(argv)
  m = geometry.MODELS[args.model]
  local = m.E // 8
  w = _weights(args.ranks * local, m.H, m.I, seed=0)
  routed_bytes, _ = sweep.expert_bytes(w)
  bandwidth = sweep.measure_bandwidth()
  print(f"{args.ranks} virtual ranks on one {jax.devices()[0].device_kind}: {m.name} L = {local} per rank "
        f"(E = {w.num_experts}), H {m.H}, I {m.I}, top-{m.k}; bandwidth {bandwidth / 1e9:.0f} GB/s\n")
  print("| B per rank | floor us | fused, R virtual ranks us | one rank, whole layer us | fused / one rank | "
        "fused x floor |\n| --- | --- | --- | --- | --- | --- |", flush=True)
  for b in (int(v) for v in args.batch.split(",")):
    fused, one, ids = measure(w, m.k, args.ranks, b, iters=args.iters, clamp=args.clamp, reference=args.reference)
    hit = np.unique(ids[ids >= 0])
    floor = np.bincount(hit // local, minlength=args.ranks).max() * routed_bytes / bandwidth
    print(f"| {b} | {floor * 1e6:.1f} | {fused * 1e6:.1f} | {one * 1e6:.1f} | {fused / one:.2f} | "
          f"{fused / floor:.1f} |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
