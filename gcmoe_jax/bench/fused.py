"""The fused EP transport on one GPU with virtual ranks (issue 9): R ranks sharing the device, against references.

Each virtual rank holds the paper's per-rank experts (L = E_model / 8, so the layer has E = R L experts) and B
tokens, with its own green-context pair of the GPU (`ffi.VirtualRanks`); all R graphs run at once. Two references:
ONE rank computing the same whole layer (E = R L experts, T = R B tokens) with the local operator on the whole
device (the same expert work without a transport, on more SMs), and the collective transport's program for the
same R ranks on this one device (`collective_on_one_gpu`: its exchanges are on-device transposes, its ranks' local
ops run one after the other on the whole device). All are timed back to back over ``iters`` steps with the same
inputs (host wall time per step after a warm-up). The floor is the weight-streaming time of
the busiest rank (its distinct local experts hit x one expert's MXFP4 bytes at the bandwidth measured in the same
run), as in `bench.ep`.

  python -m gcmoe_jax.bench.fused --model glm5.2 --ranks 2 --batch 1,2,4,8,16

needs cubins for the fused variants (``build-kernels --preset fused``), for the one-rank layer (the local variants
of E = R L experts at capacities 8, 16, 32, 64) and for the collective reference (L experts, k = 1, the capacities
of R B k rows); ``--reference none`` times the fused ranks alone.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import api, ffi, formats, geometry, sharding
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


def _timed(f, args, iters: int) -> tuple[float, jax.Array]:
  y = f(*args)
  y.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(iters):
    y = f(*args)
  y.block_until_ready()
  return (time.perf_counter() - t0) / iters, y


def collective_on_one_gpu(w: formats.ExpertWeights, ranks: int, clamp: float | None, backend: str = "cuda"):
  """The collective transport's program for R ranks on ONE device: `sharding.moe_shard_map_body` under
  ``jax.vmap(..., axis_name="ep")`` over the ranks' stacked tokens and experts, so its all_to_alls are on-device
  transposes (no interconnect) and each rank's local op (k = 1 over R B k rows, the CUDA backend) runs after the
  other's, each on the whole device. A same-shapes reference for the fused transport on virtual ranks, not a
  measurement of the collective transport across GPUs. Takes x ``[R, B, H]``, ids and weights ``[R, B, k]``;
  ``backend``: the local op's (another than cuda for tests)."""
  stacked = jax.tree.map(lambda a: a.reshape(ranks, a.shape[0] // ranks, *a.shape[1:]), w)

  def local(x, w_local, ids, weights, *, clamp):
    return api.moe(x, w_local, api.Routes(ids, weights), clamp=clamp, backend=backend)

  def body(x, w_local, ids, weights):
    return sharding.moe_shard_map_body(x, w_local, ids, weights, axis_name="ep", local_fn=local, clamp=clamp,
                                       transport="collective")

  layer = jax.jit(jax.vmap(body, axis_name="ep"))
  return lambda x, ids, weights: layer(x, stacked, ids, weights)


REFERENCES = ("one-rank", "collective")


def measure(w: formats.ExpertWeights, top_k: int, ranks: int, batch: int, *, iters: int, clamp: float | None,
            seed: int = 0, references: tuple[str, ...] = REFERENCES) -> tuple[float, dict[str, float], np.ndarray]:
  """(fused seconds per step, {reference: seconds per step}, global ids) of one point. ``references``: "one-rank"
  (one rank computing the whole layer with the local operator on the whole device), "collective"
  (`collective_on_one_gpu`; its output is checked bit-equal to the fused ranks')."""
  t = ranks * batch
  rng = np.random.default_rng([seed, batch])
  ids, rw = make_routes(rng, "default", t, w.num_experts, top_k)
  x = jnp.asarray(rng.standard_normal((t, w.hidden)), jnp.bfloat16)
  split = lambda a: [jnp.asarray(p) for p in np.split(np.asarray(a), ranks)]
  with ffi.VirtualRanks(w, top_k=top_k, ranks=ranks, capacity=CAPACITY, tokens=[batch] * ranks,
                        clamp=clamp) as vr:
    args = (split(x), split(ids), split(rw))
    vr.run(*args, repeat=max(2, iters // 10))
    ys, fused = vr.run(*args, repeat=iters)
  out = {}
  if "one-rank" in references:
    f = jax.jit(lambda x, w, i, wt: api.moe(x, w, api.Routes(i, wt), clamp=clamp, backend="cuda"))
    out["one-rank"], _ = _timed(f, (x, w, jnp.asarray(ids), jnp.asarray(rw)), iters)
  if "collective" in references:
    stack = lambda a: jnp.asarray(np.asarray(a).reshape(ranks, batch, *np.shape(a)[1:]))
    out["collective"], y = _timed(collective_on_one_gpu(w, ranks, clamp), (stack(x), stack(ids), stack(rw)), iters)
    got = np.asarray(jnp.concatenate(ys)).view(np.uint16)
    if not np.array_equal(got, np.asarray(y).reshape(t, -1).view(np.uint16)):
      raise AssertionError(f"bench.fused: the fused ranks' output differs from the collective program's at B = "
                           f"{batch} (both must equal the oracle bit for bit)")
  return fused, out, ids


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="glm5.2", choices=sorted(geometry.MODELS))
  p.add_argument("--ranks", type=int, default=2, help="virtual ranks R (default 2)")
  p.add_argument("--batch", default="1,2,4,8,16", help=f"tokens per rank, a comma list (at most {CAPACITY})")
  p.add_argument("--iters", type=int, default=200)
  p.add_argument("--clamp", type=float, default=10.0)
  p.add_argument("--reference", default=",".join(REFERENCES),
                 help="what to time beside the fused ranks, a comma list of " + ", ".join(REFERENCES) + " or none "
                 "(one-rank: one rank computing the whole layer; collective: the collective transport's program "
                 "for the same ranks on this one GPU, `collective_on_one_gpu`; each needs its local cubins)")
  args = p.parse_args(argv)
  m = geometry.MODELS[args.model]
  local = m.E // 8
  w = _weights(args.ranks * local, m.H, m.I, seed=0)
  routed_bytes, _ = sweep.expert_bytes(w)
  bandwidth = sweep.measure_bandwidth()
  print(f"{args.ranks} virtual ranks on one {jax.devices()[0].device_kind}: {m.name} L = {local} per rank "
        f"(E = {w.num_experts}), H {m.H}, I {m.I}, top-{m.k}; bandwidth {bandwidth / 1e9:.0f} GB/s\n")
  refs = () if args.reference == "none" else tuple(args.reference.split(","))
  bad = [r for r in refs if r not in REFERENCES]
  if bad:
    p.error(f"--reference: {bad[0]!r} is not one of {', '.join(REFERENCES)} or none")
  names = {"one-rank": "one rank, whole layer", "collective": "collective on this GPU"}
  head = ["B per rank", "floor us", "fused, R virtual ranks us", *(f"{names[r]} us" for r in refs),
          *(f"fused / {r}" for r in refs), "fused x floor"]
  print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head), flush=True)
  for b in (int(v) for v in args.batch.split(",")):
    fused, ref, ids = measure(w, m.k, args.ranks, b, iters=args.iters, clamp=args.clamp, references=refs)
    hit = np.unique(ids[ids >= 0])
    floor = np.bincount(hit // local, minlength=args.ranks).max() * routed_bytes / bandwidth
    cells = [f"{b}", f"{floor * 1e6:.1f}", f"{fused * 1e6:.1f}", *(f"{ref[r] * 1e6:.1f}" for r in refs),
             *(f"{fused / ref[r]:.2f}" for r in refs), f"{fused / floor:.1f}"]
    print("| " + " | ".join(cells) + " |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
