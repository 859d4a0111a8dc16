"""Replays role 2's item queue of one timeline call with the measured item times, with the routed items first and
with the shared expert's first (`abi.item_order`), to predict the layer's end (docs/kernels_v2.md "The shared
expert's items first").

    GCMOE_ABLATION=timeline python -m gcmoe_jax.bench.timeline --model glm5.2 --shared --batch 1 --save tl.npz
    python docs/probes/queue_replay.py tl.npz [routedfirst]   # anywhere the package imports (no GPU)

The second argument names the order the timeline was recorded in: ``routedfirst`` for a timeline of the kernels
before session 18 (the one of docs/kernels_v2.md), else the default order of the batch's variant.

The model: every CTA claims the next item when it is free (the queue), an item takes its kind's median time, a
GEMM2 item starts after its expert's (or token group's) GEMM1 items; GLM5.2's item counts per expert and group.
A shared GEMM2 item's work is taken from the end of the call's last shared GEMM1 item (exact for one token group).
A one-token group's halves (session 23) replay as two groups of half-length items. A timeline of another build's
queue (a count that does not match) is refused by `timeline.call_ranges`.
"""
import heapq
import sys

import numpy as np

from gcmoe_jax.bench import timeline as tl
from gcmoe_jax.ffi import _cuda
from gcmoe_jax.kernels import abi


def measured(words, hit, j1, j2, n_cb, n_hb, order, tokens, group):
  """Per-kind pure work times (us): GEMM1 claim to end, GEMM2 from the end of its wait to its end (``group``: the
  variant's shared-expert token group, `timeline.shared_group_tokens`)."""
  _, c, t0, rec = tl.records(words)
  r = tl.call_ranges(len(rec), hit, j1, j2, n_cb, n_hb, order, tokens, group)
  n_tg = (r["shared GEMM1"][1] - r["shared GEMM1"][0]) // n_cb
  pick = lambda k: rec[(rec[:, 0] >= r[k][0]) & (rec[:, 0] < r[k][1])]
  r1, s1, r2, s2 = (pick(k) for k in ("routed GEMM1", "shared GEMM1", "routed GEMM2", "shared GEMM2"))
  s1_end = s1[:, 3].max() if len(s1) else 0
  work = {"R1": (r1[:, 3] - r1[:, 1]) / 1e3, "R2": (r2[:, 3] - r2[:, 2]) / 1e3,
          "S1": (s1[:, 3] - s1[:, 1]) / 1e3, "S2": (s2[:, 3] - np.maximum(s2[:, 1], s1_end)) / 1e3}
  start = (c[:, 2].max() - t0) / 1e3  # the expert table: items start after it
  end = (c[:, 3].max() - t0) / 1e3
  return work, start, end, len(c), n_tg


def simulate(order, work, start, ctas, hit, j1, j2, n_tg, n_cb, n_hb):
  """Greedy claims in queue order by the first free CTA; a GEMM2 item starts when its dependencies are done."""
  counts = {"R1": hit * j1, "S1": n_tg * n_cb, "R2": hit * j2, "S2": n_tg * n_hb}
  med = {k: float(np.median(v)) for k, v in work.items() if len(v)}
  done_r1 = np.zeros(hit)  # when each expert's GEMM1 items are all done
  left_r1 = np.full(hit, j1)
  done_s1, left_s1 = np.zeros(max(n_tg, 1)), np.full(max(n_tg, 1), n_cb)
  free = [(start, i) for i in range(ctas)]
  heapq.heapify(free)
  last = start
  for kind in order:
    for i in range(counts[kind]):
      t, cta = heapq.heappop(free)
      if kind == "R1":
        e = i // j1
        end = t + med["R1"]
        left_r1[e] -= 1
        done_r1[e] = max(done_r1[e], end)
      elif kind == "S1":
        g = i % n_tg
        end = t + med["S1"]
        left_s1[g] -= 1
        done_s1[g] = max(done_s1[g], end)
      elif kind == "R2":
        e = i // j2
        end = max(t, done_r1[e]) + med["R2"]
      else:
        g = i % n_tg
        end = max(t, done_s1[g]) + med["S2"]
      last = max(last, end)
      heapq.heappush(free, (end, cta))
  return last


if __name__ == "__main__":
  z = np.load(sys.argv[1])
  recorded_as = sys.argv[2] if len(sys.argv) > 2 else ""
  hit_of = lambda ids, layer: np.unique(ids[layer][ids[layer] >= 0]).size
  j1, j2, n_cb, n_hb = 32, 48, 64, 96  # GLM5.2: 2I/128, H/128, Is/32, H/64
  for key in [k for k in z.files if k.startswith("slots_b")]:
    b = int(key[7:])
    recorded = abi.item_order(b, recorded_as)  # B <= 32 iff the variant's capacity is
    for layer in range(len(z[key])):
      hit = hit_of(z[f"ids_b{b}"], layer)
      group = tl.shared_group_tokens(_cuda.capacity_for(b), 8, 32, recorded_as)  # GLM5.2: k 8, E 32
      work, start, end, ctas, n_tg = measured(z[key][layer], hit, j1, j2, n_cb, n_hb, recorded, b, group)
      args = (work, start, ctas, hit, j1, j2, n_tg, n_cb, n_hb)
      d = simulate(("R1", "S1", "R2", "S2"), *args)
      f = simulate(("S1", "R1", "S2", "R2"), *args)
      print(f"B={b} layer {layer}: measured end {end:.1f} us; replayed routed first {d:.1f}, shared first {f:.1f}; "
            f"work medians " + ", ".join(f"{k} {np.median(v):.1f}" for k, v in work.items() if len(v)))
