"""Where a call's time goes: the %globaltimer timeline of a ``GCMOE_ABLATION=timeline`` build (issue 6).

    GCMOE_ABLATION=timeline python -m gcmoe_jax.bench.timeline --model glm5.2 --batch 1,8,64
    GCMOE_ABLATION=timeline+kbany python -m gcmoe_jax.bench.timeline ...   # the stamps in another ablation's build

The timeline build (results exact) stamps, for each call, role 1's and role 3's block 0 entry and exit and, for
every role-2 CTA, its entry, the end of phase 0 (x quantized), the end of the expert table (role 1's active
queue closed), its exit and its SM (``%smid`` + 1, word 5 of its record), and per item the claim, the start of its
MMAs (after a GEMM2 item's wait for its expert's GEMM1 tiles) and its end (`kernels.abi` ``TL_*``), into a region
after the workspace (``--save`` keeps them for analyses such as per-SM item times). This runs the bench's chain
(``--chain`` layers in one jitted program, alternating weight copies, fresh routes per layer) once more after
warming up, reads the last call slots back (`ffi._cuda.debug_read_workspace`) and prints, per layer, the phases
in microseconds from the layer's first stamp, and the role-2 item statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

import numpy as np

from gcmoe_jax import _config
from gcmoe_jax.kernels import abi

__all__ = ["ItemStats", "LayerTimeline", "SmSharing", "call_ranges", "item_ranges", "item_stats", "kinds_markdown",
           "parse_slot", "records", "sharing_markdown", "sm_sharing", "summarize", "to_markdown"]


@dataclasses.dataclass
class LayerTimeline:
  """One call's phases (us from its first stamp) and role 2's item statistics."""

  cur: int
  role1: tuple[float, float]  # entry, exit (block 0)
  role2_entry: tuple[float, float]  # first and last CTA entry
  phase0: float  # the last CTA's end of phase 0
  table: float  # the last CTA's expert table (the active queue closed and read)
  gemm1: tuple[float, float]  # first GEMM1 item start, last GEMM1 item end
  gemm2: tuple[float, float]  # first GEMM2 MMA start, last GEMM2 item end
  role2_exit: float  # the last CTA's exit
  role3: tuple[float, float]  # entry, exit (block 0)
  ctas: int
  items: int
  gemm1_us: tuple[float, float]  # median, max duration of a GEMM1 item
  gemm2_us: tuple[float, float]  # median, max duration of a GEMM2 item's MMAs (after its wait)
  gemm2_wait_us: float  # the sum over GEMM2 items of the wait for their expert's GEMM1 tiles
  busy: float  # role 2's item time over (CTAs x (last exit - last table)), the share of the grid kept working
  start_ns: int = 0  # the first stamp (ns), to measure the gaps between calls


def parse_slot(words: np.ndarray) -> dict[str, np.ndarray]:
  """One call slot (`abi.TL_CALL_WORDS` uint64) as arrays: ``head`` [TL_HEAD], ``cta`` [TL_CTAS, 8] and
  ``item`` [TL_CTAS, TL_ITEMS, 4] (item, start, MMA start, end), ``used`` [TL_CTAS] (CTAs that stamped)."""
  words = np.asarray(words, np.uint64)
  if words.shape != (abi.TL_CALL_WORDS,):
    raise ValueError(f"timeline: a call slot has {abi.TL_CALL_WORDS} words, got shape {words.shape}")
  head = words[:abi.TL_HEAD]
  per = words[abi.TL_HEAD:].reshape(abi.TL_CTAS, abi.TL_CTA_WORDS)
  return dict(head=head, cta=per[:, :8], item=per[:, 8:].reshape(abi.TL_CTAS, abi.TL_ITEMS, 4),
              used=per[:, 0] != 0)


def records(words: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
  """One call slot's (head, the stamped CTAs' words [n, 8], the call's first stamp t0 in ns, every recorded item
  [m, 4]: item, start, MMA start, end)."""
  s = parse_slot(words)
  head, cta, used = s["head"].astype(np.int64), s["cta"].astype(np.int64), s["used"]
  if not used.any() or head[0] == 0:
    raise ValueError("timeline: the slot holds no stamps (was the build GCMOE_ABLATION=timeline?)")
  c = cta[used]
  t0 = int(min(head[0], c[:, 0].min()))
  n = np.minimum(c[:, 4], abi.TL_ITEMS)
  items = s["item"][used].astype(np.int64)
  rec = np.concatenate([items[i, :n[i]] for i in range(len(c))]) if n.sum() else np.zeros((0, 4), np.int64)
  return head, c, t0, rec


def summarize(words: np.ndarray, gemm1_items: int | tuple[int, int]) -> LayerTimeline:
  """The phases of one call slot; ``gemm1_items``: the queue's routed GEMM1 items, as [first, end) or as their
  count from 0 (experts hit x 2I/128); every other item counts as GEMM2 (in routed-only variants: the GEMM2 items;
  the shared expert's kinds are in `item_stats`)."""
  head, c, t0, rec = records(words)
  us = lambda t: (np.asarray(t, np.float64) - t0) / 1e3
  lo, hi = (0, gemm1_items) if isinstance(gemm1_items, int) else gemm1_items
  in_g1 = (rec[:, 0] >= lo) & (rec[:, 0] < hi)
  g1 = rec[in_g1]
  g2 = rec[~in_g1]
  dur = lambda r, a, b: (r[:, b] - r[:, a]) / 1e3
  stat = lambda d: (float(np.median(d)), float(d.max())) if d.size else (0.0, 0.0)
  last_table = c[:, 2].max()
  span = (c[:, 3].max() - last_table) * len(c)
  return LayerTimeline(
    cur=int(head[4]), role1=(float(us(head[0])), float(us(head[1]))),
    role2_entry=(float(us(c[:, 0].min())), float(us(c[:, 0].max()))), phase0=float(us(c[:, 1].max())),
    table=float(us(last_table)),
    gemm1=(float(us(g1[:, 1].min())), float(us(g1[:, 3].max()))) if g1.size else (0.0, 0.0),
    gemm2=(float(us(g2[:, 2].min())), float(us(g2[:, 3].max()))) if g2.size else (0.0, 0.0),
    role2_exit=float(us(c[:, 3].max())), role3=(float(us(head[2])), float(us(head[3]))), ctas=int(len(c)),
    items=int(c[:, 4].sum()), gemm1_us=stat(dur(g1, 1, 3)), gemm2_us=stat(dur(g2, 2, 3)),
    gemm2_wait_us=float(dur(g2, 1, 2).sum()) if g2.size else 0.0,
    busy=float((rec[:, 3] - rec[:, 1]).sum() / span) if span > 0 and rec.size else 0.0, start_ns=t0)


@dataclasses.dataclass
class ItemStats:
  """One kind of role-2 item in one call: how many, when the first was claimed and the last ended (us from the
  call's first stamp), and the median and longest claim-to-end time (a GEMM2 item's includes its wait)."""

  kind: str
  items: int
  first_start: float
  last_end: float
  median_us: float
  max_us: float


def item_ranges(n1: int, n2: int, n_s1: int = 0, n_s2: int = 0,
                order: Sequence[str] = abi.ITEM_ORDER_ROUTED_FIRST) -> dict[str, tuple[int, int]]:
  """Each item kind's [first, end) in role 2's queue, its kinds in ``order``: `abi.item_order` of the call's variant
  (the timeline build queues as the normal one), by default routed first (the variants above 32 tokens); without
  the shared expert both orders are the same."""
  sizes = {"routed GEMM1": n1, "routed GEMM2": n2, "shared GEMM1": n_s1, "shared GEMM2": n_s2}
  out, at = {}, 0
  for kind in order:
    out[kind] = (at, at + sizes[kind])
    at += sizes[kind]
  return out


def shared_group_tokens(capacity: int, top_k: int, experts: int, ablation: str = "") -> int:
  """Tokens per shared-expert token group in role 2's sm_90a variant of token capacity ``capacity``: 16 in the
  one-CTA variants (`abi.pass_tier`), else 8 (`roles_v2.RoleKernelsV2`'s ``sh``)."""
  return 16 if abi.pass_tier(capacity, top_k, experts, ablation)[1] == 1 else 8


def call_ranges(items: int, hit: int, j1: int, j2: int, n_cb: int = 0, n_hb: int = 0,
                order: Sequence[str] = abi.ITEM_ORDER_ROUTED_FIRST, tokens: int = 0,
                group: int = 8) -> dict[str, tuple[int, int]]:
  """`item_ranges` of a call of ``tokens`` tokens with ``items`` items in all, ``hit`` experts hit, ``j1``/``j2``
  routed GEMM1/GEMM2 items per expert and ``n_cb``/``n_hb`` shared GEMM1/GEMM2 items per token group of ``group``
  tokens (0: no shared expert). A last group of one or two tokens (`abi.HALVES_TOKENS`) takes two items (halves)
  per column block of both shared GEMMs, as if it were two groups. The count must match, else ValueError (another
  build's queue)."""
  groups = -(-tokens // group) if n_cb + n_hb else 0
  per = groups + (1 if groups and tokens - (groups - 1) * group <= abi.HALVES_TOKENS else 0)
  want = hit * (j1 + j2) + per * (n_cb + n_hb)
  if items != want:
    raise ValueError(f"call_ranges: {items} items, expected {want} for {hit} experts x ({j1} + {j2}) and {tokens} "
                     f"tokens in groups of {group} x ({n_cb} + {n_hb}) shared items")
  return item_ranges(hit * j1, hit * j2, per * n_cb, per * n_hb, order)


def item_stats(words: np.ndarray, ranges: dict[str, tuple[int, int]]) -> list[ItemStats]:
  """Per item kind of ``ranges`` (`item_ranges`) with at least one recorded item, its `ItemStats`."""
  _, _, t0, rec = records(words)
  out = []
  for kind, (lo, hi) in ranges.items():
    r = rec[(rec[:, 0] >= lo) & (rec[:, 0] < hi)]
    if len(r):
      d = (r[:, 3] - r[:, 1]) / 1e3
      out.append(ItemStats(kind, len(r), float((r[:, 1].min() - t0) / 1e3), float((r[:, 3].max() - t0) / 1e3),
                           float(np.median(d)), float(d.max())))
  return out


@dataclasses.dataclass
class SmSharing:
  """Routed GEMM1 items by what ran beside them on their SM (``%smid``, word 5 of a CTA's record): the durations
  (us) of those that were their CTA's first item, ``alone`` where no other CTA on the SM began with a GEMM1 item,
  ``beside`` where one did and ``crowded`` where two or more did (three CTAs per SM: `GCMOE_ABLATION=threecta`); and
  ``per_sm``, the median duration of every recorded GEMM1 item per SM."""

  alone: np.ndarray
  beside: np.ndarray
  per_sm: dict[int, float]
  crowded: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))


def sm_sharing(words: np.ndarray, gemm1_items: int | tuple[int, int]) -> SmSharing | None:
  """`SmSharing` of one call slot (``gemm1_items`` as for `summarize`); None where the build recorded no SM (a
  timeline build before session 41)."""
  s = parse_slot(words)
  lo, hi = (0, gemm1_items) if isinstance(gemm1_items, int) else gemm1_items
  used = np.flatnonzero(s["used"])
  cta, it = s["cta"].astype(np.int64)[used], s["item"].astype(np.int64)[used]
  sm = cta[:, 5] - 1
  if not used.size or (sm < 0).any():
    return None
  n = np.minimum(cta[:, 4], abi.TL_ITEMS)
  in_g1 = (it[:, :, 0] >= lo) & (it[:, :, 0] < hi) & (np.arange(abi.TL_ITEMS)[None, :] < n[:, None])
  dur = (it[:, :, 3] - it[:, :, 1]) / 1e3
  first = in_g1[:, 0]
  starts = np.bincount(sm[first], minlength=int(sm.max()) + 1)  # CTAs per SM that began with a GEMM1 item
  per_sm = {int(m): float(np.median(dur[sm == m][in_g1[sm == m]])) for m in np.unique(sm) if in_g1[sm == m].any()}
  return SmSharing(dur[first & (starts[sm] == 1), 0], dur[first & (starts[sm] == 2), 0], per_sm,
                   dur[first & (starts[sm] > 2), 0])


def sharing_markdown(rows: Sequence[tuple[int, list[SmSharing]]]) -> str:
  """A line per batch over its layers' `SmSharing`: the first GEMM1 items alone on their SM, beside another and
  beside two or more (count, median us), and the range of the per-SM medians."""
  out = ["| B | GEMM1 items alone on their SM (n, median us) | beside another GEMM1 item (n, median us) | "
         "beside two or more (n, median us) | per-SM medians (min-max us, SMs) |", "| --- " * 5 + "|"]
  for b, layers in rows:
    alone = np.concatenate([x.alone for x in layers])
    beside = np.concatenate([x.beside for x in layers])
    crowded = np.concatenate([x.crowded for x in layers])
    per_sm = {}
    for x in layers:
      for m, v in x.per_sm.items():
        per_sm.setdefault(m, []).append(v)
    meds = [float(np.median(v)) for v in per_sm.values()]
    f = lambda d: f"{d.size}, {np.median(d):.1f}" if d.size else "0, -"
    span = f"{min(meds):.1f}-{max(meds):.1f}, {len(meds)}" if meds else "-, 0"
    out.append(f"| {b} | {f(alone)} | {f(beside)} | {f(crowded)} | {span} |")
  return "\n".join(out)


def kinds_markdown(rows: Sequence[tuple[int, int, list[ItemStats]]]) -> str:
  """A table of ``(batch, layer, item stats)`` rows, one line per item kind."""
  out = ["| B | layer | items | count | first claim | last end | claim to end med/max |", "| --- " * 7 + "|"]
  for b, layer, stats in rows:
    for k in stats:
      out.append(f"| {b} | {layer} | {k.kind} | {k.items} | {k.first_start:.1f} | {k.last_end:.1f} | "
                 f"{k.median_us:.1f}/{k.max_us:.1f} |")
  return "\n".join(out)


def to_markdown(rows: Sequence[tuple[int, int, LayerTimeline]]) -> str:
  """A table of ``(batch, layer, timeline)`` rows; the gap is from the previous layer's role 3 exit."""
  out = ["| B | layer | gap | role 1 | role 2 entries | phase 0 | table | GEMM1 | GEMM2 | role 2 exit | role 3 | "
         "CTAs | items | GEMM1 item med/max | GEMM2 item med/max | GEMM2 waits (sum) | busy |",
         "| --- " * 17 + "|"]
  prev = {}
  for b, layer, t in rows:
    gap = "" if b not in prev else f"{(t.start_ns - prev[b]) / 1e3:.1f}"
    prev[b] = t.start_ns + int(t.role3[1] * 1e3)
    f = lambda p: f"{p[0]:.1f}-{p[1]:.1f}"
    out.append(f"| {b} | {layer} | {gap} | {f(t.role1)} | {f(t.role2_entry)} | {t.phase0:.1f} | {t.table:.1f} | "
               f"{f(t.gemm1)} | {f(t.gemm2)} | {t.role2_exit:.1f} | {f(t.role3)} | {t.ctas} | {t.items} | "
               f"{t.gemm1_us[0]:.1f}/{t.gemm1_us[1]:.1f} | {t.gemm2_us[0]:.1f}/{t.gemm2_us[1]:.1f} | "
               f"{t.gemm2_wait_us:.0f} | {100 * t.busy:.0f} % |")
  return "\n".join(out)


def _run(model: str, batches: Sequence[int], chain: int, shared: bool, save: str | None = None
         ) -> tuple[list[tuple[int, int, LayerTimeline]], list[tuple[int, int, list[ItemStats]]],
                    list[tuple[int, list[SmSharing]]]]:
  import jax  # noqa: PLC0415 - the parser above needs no jax

  from gcmoe_jax.bench import sweep  # noqa: PLC0415
  from gcmoe_jax.ffi import _cuda  # noqa: PLC0415

  shape = sweep.model_shape(model, shared=shared)
  p = sweep._Problem(shape, 0)  # noqa: SLF001 - the bench's weights and routes, not a copy of them
  rows, kinds, sharing, raw_slots = [], [], [], {}
  j1, j2 = 2 * shape.intermediate // 128, shape.hidden // 128
  n_cb, n_hb = (shape.shared_intermediate // 32, shape.hidden // 64) if shared else (0, 0)
  for b in batches:
    x, ids, rw, _, _ = p.inputs(b, chain)
    fn, args = sweep._impl_call("gcmoe:cuda", p, x, ids, rw)  # noqa: SLF001
    for _ in range(3):
      jax.block_until_ready(fn(*args))
    # The timeline region only: it follows the workspace's sections (`ffi._cuda.workspace_bytes`).
    raw = np.frombuffer(_cuda.debug_read_workspace(-abi.TIMELINE_BYTES), np.uint64)
    slots = raw.reshape(abi.TL_CALLS, abi.TL_CALL_WORDS)
    order = np.argsort(slots[:, 4].astype(np.int64))[-chain:]  # the last call's layers, in order
    ids_np = np.asarray(ids)
    raw_slots[f"slots_b{b}"], raw_slots[f"ids_b{b}"] = slots[order], ids_np
    capacity = _cuda.capacity_for(min(b, _cuda.CAPACITIES[-1]))
    queue = abi.item_order(capacity, _config.kernel_ablation())
    sharing.append((b, []))
    for layer, si in enumerate(order):
      hit = np.unique(ids_np[layer][ids_np[layer] >= 0]).size
      items = int(records(slots[si])[1][:, 4].sum())
      group = shared_group_tokens(capacity, shape.top_k, shape.experts, _config.kernel_ablation())
      ranges = call_ranges(items, hit, j1, j2, n_cb, n_hb, queue, b, group)
      t = summarize(slots[si], ranges["routed GEMM1"])
      rows.append((b, layer, t))
      kinds.append((b, layer, item_stats(slots[si], ranges)))
      by_sm = sm_sharing(slots[si], ranges["routed GEMM1"])
      if by_sm is not None:
        sharing[-1][1].append(by_sm)
  if save:
    np.savez_compressed(save, **raw_slots)
  return rows, kinds, [(b, x) for b, x in sharing if x]


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m gcmoe_jax.bench.timeline", description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="glm5.2")
  ap.add_argument("--batch", default="1,8,64")
  ap.add_argument("--chain", type=int, default=8)
  ap.add_argument("--shared", action="store_true")
  ap.add_argument("--save", help="also write the raw call slots and routes per batch to this .npz")
  a = ap.parse_args(argv)
  if not 1 <= a.chain <= abi.TL_CALLS:
    ap.error(f"--chain must be in [1, {abi.TL_CALLS}] (the timeline's call slots), got {a.chain}")
  if not _config.timeline_build():
    print("timeline: set GCMOE_ABLATION=timeline or timeline+NAME (the stamping build of the kernels)", file=sys.stderr)
    return 2
  if a.shared:
    print("timeline: note: the first table's GEMM1 columns are the routed GEMM1 items', its GEMM2 columns every other "
          "item's (the second table separates the kinds)", file=sys.stderr)
  rows, kinds, sharing = _run(a.model, [int(v) for v in a.batch.split(",")], a.chain, a.shared, a.save)
  print(to_markdown(rows))
  print()
  print(kinds_markdown(kinds))
  if sharing:
    print()
    print(sharing_markdown(sharing))
  return 0


if __name__ == "__main__":
  sys.exit(main())
