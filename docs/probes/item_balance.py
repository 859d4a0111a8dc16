"""How evenly role 2's queue spreads the routed items over its CTAs: a schedule model, no GPU.

    python docs/probes/item_balance.py [--model glm5.2 dsv4.1-flash] [--batch 1 2 4 8 16 32] [--ctas 256 264]
                                       [--parts 1/1 1/2 2/2] [--draws 50]

Role 2 (v2, one GPU) hands its items out in queue order (`abi.item_order`: every routed GEMM1 item of the experts
hit, then every GEMM2 item) to whichever CTA asks first, and a GEMM2 item starts only once all GEMM1 items of its
expert are done. An item is 128 weight rows (`roles_v2.TILE_M`) over the whole K: GEMM1 H / 128 K128 stages, GEMM2
I / 128. This replays that list schedule for the bench's routes (k distinct uniform experts per token, as
`bench.sweep` draws them) with every stage taking one time unit, and prints per point the mean over ``--draws`` draws
of: the last CTA's end (makespan), the work per CTA (all stages / CTAs: what a perfect spread would take) and the
chain (one GEMM1 item then one GEMM2 item: the shortest a call can be at these item sizes), and the loss, makespan /
max(work per CTA, chain).

``--ctas``: 256 is two CTAs on each of the 128 SMs of the compute partition (H100 and H200), 264 all 132 SMs
(`GCMOE_SOLO_SMS=all`, where role 2 runs alone at B <= 8). ``--parts P1/P2`` splits each GEMM1 / GEMM2 item along K
into P parts that any CTA may take (a hypothetical build: the semantics' FP32 sum in increasing K would have the
parts keep their blocks' contributions for one ordered sum; see docs/kernels_v2.md "Item balance").

What the model leaves out: a stage's time depends on the pass body (rows per expert) and on how many CTAs share an
SM (one left alone on its SM runs its stages faster), role 2's prologue and its combine, and the shared expert's
items. So it tells where the item sizes cost a round of work, not how long a layer takes.
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from gcmoe_jax.bench import sweep  # noqa: E402
from gcmoe_jax.kernels import roles_v2  # noqa: E402


def schedule(hit: int, j1: int, j2: int, s1: float, s2: float, ctas: int) -> float:
  """The makespan, in stages, of ``hit`` experts' j1 GEMM1 items of s1 stages then j2 GEMM2 items of s2 stages each
  (in queue order, expert by expert), list-scheduled on ``ctas`` CTAs; a GEMM2 item waits for its expert's GEMM1."""
  free = [0.0] * ctas
  gemm1_done = [0.0] * hit
  for e in range(hit):
    for _ in range(j1):
      end = heapq.heappop(free) + s1
      gemm1_done[e] = max(gemm1_done[e], end)
      heapq.heappush(free, end)
  last = max(free)
  for e in range(hit):
    for _ in range(j2):
      end = max(heapq.heappop(free), gemm1_done[e]) + s2
      last = max(last, end)
      heapq.heappush(free, end)
  return last


def point(shape: sweep.BenchShape, batch: int, ctas: int, parts: tuple[int, int], draws: int,
          seed: int = 0) -> tuple[float, float, float]:
  """(makespan, work per CTA, chain) in stages, means over ``draws`` route draws of ``batch`` tokens."""
  rng = np.random.default_rng(seed)
  tile = roles_v2.TILE_M
  j1, j2 = 2 * shape.intermediate // tile * parts[0], shape.hidden // tile * parts[1]
  s1, s2 = shape.hidden / 128 / parts[0], shape.intermediate / 128 / parts[1]
  out = []
  for _ in range(draws):
    hit = len(np.unique(np.stack([rng.choice(shape.experts, shape.top_k, replace=False) for _ in range(batch)])))
    out.append((schedule(hit, j1, j2, s1, s2, ctas), hit * (j1 * s1 + j2 * s2) / ctas))
  made, work = np.mean(out, axis=0)
  return float(made), float(work), s1 + s2


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", nargs="+", default=["glm5.2", "dsv4.1-flash"])
  ap.add_argument("--batch", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
  ap.add_argument("--ctas", nargs="+", type=int, default=[256, 264])
  ap.add_argument("--parts", nargs="+", default=["1/1"], help="K parts of GEMM1/GEMM2 items, e.g. 1/1 1/2 2/2")
  ap.add_argument("--draws", type=int, default=50)
  args = ap.parse_args(argv)
  try:
    splits = [tuple(int(p) for p in s.split("/")) for s in args.parts]
  except ValueError:
    splits = []
  if not splits or any(len(s) != 2 or min(s) < 1 for s in splits):
    ap.error(f"--parts: each must be P1/P2 with integers P1, P2 >= 1, got {args.parts}")
  print("| model | B | CTAs | K parts | makespan | work / CTA | chain | loss |")
  print("| --- " * 8 + "|")
  for model in args.model:
    shape = sweep.model_shape(model)
    for b in args.batch:
      for ctas in args.ctas:
        for parts in splits:
          made, work, chain = point(shape, b, ctas, parts, args.draws)
          print(f"| {shape.name} | {b} | {ctas} | {parts[0]}/{parts[1]} | {made:.1f} | {work:.1f} | {chain:.1f} | "
                f"{made / max(work, chain):.3f} |")


if __name__ == "__main__":
  main()
