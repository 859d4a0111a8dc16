"""Role 2's items at small B with the SM's pace: a time-stepped schedule model, no GPU.

    python docs/probes/item_pace.py [--model glm5.2 dsv4.1-flash] [--batch 1 2] [--draws 10] [--item-spread 0.25]

`item_balance.py` counts stages; the session-41 timeline (docs/kernels_v2.md "The H100 timeline, and four ideas that
did not pay") says a stage's time depends on the SM: a GEMM1 item alone on its SM (the SM's other CTA waiting)
took 31 us at GLM5.2 B = 1 and 46 us beside another GEMM1 item (DSV4.1-Flash 26 and 37), so two CTAs that both
compute share their SM at ~1.4x the throughput of one, and a waiting CTA (its bounded spin sleeps) leaves its SM to
the other. This model replays role 2's queue (items claimed in queue order by whichever CTA is free, two CTAs on
each of 132 SMs, every GEMM1 item of the experts hit and then every GEMM2 item) in steps of ``--dt`` us, where a CTA
that computes takes ``alone`` us per stage when its SM's other CTA does not compute and ``beside`` us when it does
(`PACE`); each expert's stages take a random factor around 1 (``--spread``) and each item's another
(``--item-spread``; 0.25 reproduces the timeline's GEMM phases at B = 1-2 within 3 %).

GEMM2 rules: ``expert`` (the kernel: a GEMM2 item starts once every GEMM1 item of its expert is done), ``block`` (a
hypothetical build: its K128 stage kb waits only for the two GEMM1 items that produce that block of the
intermediate, GEMM1 items 2 kb and 2 kb + 1, so the item runs while its expert's last GEMM1 items do; the K order,
and so the bits, are unchanged), ``any`` (the stages out of K order: the item computes whichever of its stages has
both GEMM1 items done, keeps each block's exact product and adds them in K order at the end, so the bits are
unchanged too; `GCMOE_ABLATION=kbany` builds it for one-row items) and ``none`` (no GEMM2 item waits: a bound on
what the dependency costs). It prints
their makespans, in us, beside the timeline's measured GEMM phases (first GEMM1 start to last GEMM2 end) where it
has them. What it leaves out: copies (a stage's time is its math at B <= 2, as the timeline and Nsight Compute
say), role 2's prologue and combine, the shared expert, and the longer stages of the four-row body (B >= 4).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from gcmoe_jax.bench import sweep  # noqa: E402
from gcmoe_jax.kernels import roles_v2  # noqa: E402

# us per K128 stage, one CTA alone on its SM / beside another computing CTA (the H100 timeline of session 41: GEMM1
# items of 48 stages at GLM5.2 B = 1, 31.2 / 46.0 us; GEMM2 items of 16 stages 11.6 us, most beside another)
PACE = {"glm5.2": {1: (31.2 / 48, 46.0 / 48), 2: (11.6 / 16 / 1.45, 11.6 / 16)},
        "dsv4.1-flash": {1: (25.9 / 40, 36.6 / 40), 2: (13.2 / 18 / 1.4, 13.2 / 18)}}
# us, the timeline's medians over 8 layers (its paces hold for passes of one or two rows, B <= 2; from B = 4 the
# four-row body's stages take longer than the model's)
MEASURED = {("glm5.2", 1): 82.3 - 3.1, ("glm5.2", 2): 121.0 - 3.1, ("glm5.2", 4): 188.9 - 3.3,
            ("dsv4.1-flash", 1): 65.0 - 3.1, ("dsv4.1-flash", 2): 97.4 - 3.1, ("dsv4.1-flash", 4): 151.6 - 3.1}


def simulate(hit: int, j1: int, j2: int, s1: int, s2: int, pace: dict, factor: np.ndarray, rule: str,
             sms: int = 132, dt: float = 0.05, parts: int = 1, one_row: np.ndarray | None = None,
             lag: float = 0.0) -> float:
  """The makespan (us) of ``hit`` experts' items on 2 ``sms`` CTAs under ``rule`` ("expert", "block", or "none": no
  GEMM2 item waits, a bound);
  ``factor``: each item's stage-time factor, GEMM1 items then GEMM2 items in queue order; ``parts``: GEMM2 items of
  s2 stages that are K parts (part q % parts of the expert's GEMM2 item q covers K128 blocks from part * s2);
  ``one_row`` (rule "any"): the experts whose items may take their stages out of order (the build's: one row), the
  others' GEMM2 items take theirs in K order, each waiting for its two GEMM1 items, as rule "block" (default: every
  expert out of order); ``lag`` (us, rules "block" and "any"): a GEMM1 item counts as done for GEMM2 stages this long
  after it ends (the build's polls and pipeline: a stage found ready is computed some stages later)."""
  ctas = 2 * sms
  n1, n2 = hit * j1, hit * j2
  alone = np.array([pace[1][0], pace[2][0]])  # us per stage: GEMM1, GEMM2
  beside = np.array([pace[1][1], pace[2][1]])
  nxt = 0  # the queue's next item: GEMM1 items 0 .. n1 - 1 (expert-major), then GEMM2 items
  item = np.full(ctas, -1)
  left = np.zeros(ctas)  # stages left of the CTA's item
  g1_end = np.full((hit, j1), np.inf)  # when each GEMM1 item ended (inf: not yet)
  t, done2 = 0.0, 0
  stage_done = np.zeros((ctas, s2), bool)  # rule "any": the GEMM2 item's stages done
  on = np.full(ctas, -1)  # rule "any": the stage the CTA computes
  while done2 < n2:
    for c in np.flatnonzero(item < 0):  # free CTAs claim in queue order
      if nxt >= n1 + n2:
        break
      item[c], left[c] = nxt, (s1 if nxt < n1 else s2)
      stage_done[c] = False
      on[c] = -1
      nxt += 1
    busy = item >= 0
    g2 = busy & (item >= n1)
    e = np.clip(np.where(item >= n1, (item - n1) // j2, item // j1), 0, hit - 1)
    # A GEMM2 item computes only while the inputs of its next stage are done; else its CTA waits (and sleeps).
    part = np.where(item >= n1, (item - n1) % j2 % parts, 0)
    seen = g1_end <= t - lag  # (rules block and any: the GEMM1 items the build would have seen done)
    if rule == "expert":
      inputs = np.isfinite(g1_end).all(axis=1)[e]
    elif rule == "none":
      inputs = np.ones(ctas, bool)
    elif rule == "any":
      # Out of K order: the CTA takes the lowest stage not yet done whose two GEMM1 items are done (its exact
      # products kept until the ordered sum at the end), so it waits only where none of its stages is ready.
      ready = seen[e][:, 0::2] & seen[e][:, 1::2]  # [ctas, K128 blocks of the expert]
      cols = part[:, None] * s2 + np.arange(s2)[None, :]
      open_ = ready[np.arange(ctas)[:, None], cols] & ~stage_done
      if one_row is not None:  # the other experts' items: stages in K order, each waiting for its two items
        first = (~stage_done).argmax(axis=1)  # their next stage in K order
        in_order = ready[np.arange(ctas)[:, None], cols] & (np.arange(s2)[None, :] == first[:, None]) & ~stage_done
        open_ = np.where(one_row[e][:, None], open_, in_order)
      on = np.where(on >= 0, on, np.where(open_.any(axis=1), open_.argmax(axis=1), -1))
      on = np.where(g2, on, -1)
      inputs = on >= 0
    else:
      kb = part * s2 + np.clip(s2 - np.ceil(left - 1e-9).astype(int), 0, s2 - 1)  # the K128 block it is on
      inputs = seen[e, 2 * kb] & seen[e, 2 * kb + 1]
    computing = busy & (~g2 | inputs)
    shared = np.repeat(computing.reshape(sms, 2).sum(axis=1) == 2, 2)
    kind = (item >= n1).astype(int)
    us_per_stage = np.where(shared, beside[kind], alone[kind]) * factor[np.maximum(item, 0)]
    before = left
    left = np.where(computing, left - dt / us_per_stage, left)
    if rule == "any":  # a whole stage crossed: that stage is done, the CTA picks its next one
      crossed = g2 & computing & (np.floor(before - 1e-9) > np.floor(left - 1e-9))
      for c in np.flatnonzero(crossed):
        stage_done[c, on[c]] = True
        on[c] = -1
    t += dt
    for c in np.flatnonzero(busy & (left <= 1e-9)):
      if item[c] < n1:
        g1_end[item[c] // j1, item[c] % j1] = t
      else:
        done2 += 1
      item[c] = -1
  return t


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", nargs="+", default=["glm5.2", "dsv4.1-flash"])
  ap.add_argument("--batch", nargs="+", type=int, default=[1, 2])
  ap.add_argument("--draws", type=int, default=10)
  ap.add_argument("--spread", type=float, default=0.08, help="relative spread of the experts' stage times")
  ap.add_argument("--item-spread", type=float, default=0.25, help="relative spread of each item's stage times")
  ap.add_argument("--dt", type=float, default=0.05, help="time step, us")
  ap.add_argument("--lag", type=float, default=0.0, help="us after a GEMM1 item's end until rules block and any see "
                  "it done (the build's polls and pipeline depth)")
  ap.add_argument("--g2-parts", type=int, default=1, help="GEMM2 items split along K into this many parts that any "
                  "CTA may take (a hypothetical build; each part waits as its rule says), e.g. 2")
  a = ap.parse_args(argv)
  print("| model | B | rule expert (us) | rule block (us) | change | rule any (us) | change | any for one-row items, "
        "block for the others (us) | change | no waits (a bound) | timeline, GEMM phases (us) |")
  print("| --- " * 11 + "|")
  for model in a.model:
    shape = sweep.model_shape(model)
    tile = roles_v2.TILE_M
    j1, j2 = 2 * shape.intermediate // tile, shape.hidden // tile * a.g2_parts
    s1, s2 = shape.hidden // 128, shape.intermediate // 128 // a.g2_parts
    if s2 * a.g2_parts != shape.intermediate // 128:
      ap.error(f"--g2-parts {a.g2_parts} does not divide {shape.name}'s {shape.intermediate // 128} GEMM2 stages")
    for b in a.batch:
      rng = np.random.default_rng(0)
      res = []
      for _ in range(a.draws):
        _, rows = np.unique(np.stack([rng.choice(shape.experts, shape.top_k, replace=False) for _ in range(b)]),
                            return_counts=True)
        hit = len(rows)
        per_expert = 1 + a.spread * rng.uniform(-1, 1, hit)
        factor = np.concatenate([np.repeat(per_expert, j1), np.repeat(per_expert, j2)])
        factor = factor * (1 + a.item_spread * rng.uniform(-1, 1, factor.size))
        res.append([simulate(hit, j1, j2, s1, s2, PACE[model], factor, rule, dt=a.dt, parts=a.g2_parts, lag=a.lag)
                    for rule in ("expert", "block", "any", "none")]
                   + [simulate(hit, j1, j2, s1, s2, PACE[model], factor, "any", dt=a.dt, parts=a.g2_parts,
                               one_row=rows == 1, lag=a.lag)])
      ex, bl, anyo, free, any1 = np.mean(res, axis=0)
      m = MEASURED.get((model, b))
      print(f"| {shape.name} | {b} | {ex:.1f} | {bl:.1f} | {100 * (bl / ex - 1):+.1f} % | {anyo:.1f} | "
            f"{100 * (anyo / ex - 1):+.1f} % | {any1:.1f} | {100 * (any1 / ex - 1):+.1f} % | {free:.1f} | "
            f"{'-' if m is None else f'{m:.1f}'} |")


if __name__ == "__main__":
  main()
