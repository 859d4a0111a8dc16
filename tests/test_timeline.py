"""The timeline build's reader (`gcmoe_jax.bench.timeline`) on synthetic stamps: the layout of `kernels.abi`'s
``TL_*`` words and the phases computed from them (the stamps themselves come from the GPU)."""

import numpy as np
import pytest

from gcmoe_jax.bench import timeline
from gcmoe_jax.kernels import abi


def _slot(rng):
  w = np.zeros(abi.TL_CALL_WORDS, np.uint64)
  t0 = 10**12 + int(rng.integers(0, 10**6))
  w[:5] = [t0, t0 + 3000, t0 + 90_000, t0 + 95_000, 7]  # role 1 entry/exit, role 3 entry/exit, cur
  items = {0: [(0, 10_000, 10_000, 40_000), (3, 40_500, 41_000, 60_000)],  # GEMM1 item 0, GEMM2 item 3
           1: [(1, 11_000, 11_000, 42_000), (2, 42_100, 42_100, 70_000), (4, 70_200, 75_000, 85_000)]}
  for b, rec in items.items():
    base = abi.TL_HEAD + b * abi.TL_CTA_WORDS
    w[base:base + 5] = [t0 + 500 + b, t0 + 5000 + b, t0 + 9000 + 100 * b, t0 + 86_000 + b, len(rec)]
    for i, (item, start, mma, end) in enumerate(rec):
      w[base + 8 + 4 * i:base + 12 + 4 * i] = [item, t0 + start, t0 + mma, t0 + end]
  return w, t0


def test_summarize_reads_the_phases_and_items():
  w, t0 = _slot(np.random.default_rng(0))
  t = timeline.summarize(w, gemm1_items=3)  # items 0-2 GEMM1, 3-4 GEMM2
  assert t.cur == 7 and t.ctas == 2 and t.items == 5 and t.start_ns == t0
  assert t.role1 == (0.0, 3.0) and t.role3 == (90.0, 95.0)
  assert t.role2_entry == (0.5, 0.501) and t.phase0 == pytest.approx(5.001) and t.table == pytest.approx(9.1)
  assert t.gemm1 == (10.0, 70.0) and t.gemm2 == (41.0, 85.0)
  assert t.gemm1_us == pytest.approx((30.0, 31.0))  # GEMM1 items of 30, 31 and 27.9 us
  assert t.gemm2_us == pytest.approx((14.5, 19.0))  # GEMM2 MMAs of 19 and 10 us, after waits of 0.5 and 4.8
  assert t.gemm2_wait_us == pytest.approx(0.5 + 4.8)
  busy = (30.0 + 19.5 + 31.0 + 27.9 + 14.8) / (2 * (86.001 - 9.1))
  assert t.busy == pytest.approx(busy, rel=1e-6)
  assert "| 1 | 0 |" in timeline.to_markdown([(1, 0, t)])
  assert timeline.summarize(w, (0, 3)) == t  # the routed GEMM1 items as a range of the queue
  assert timeline.summarize(w, (3, 5)).gemm1 == (40.5, 85.0)  # e.g. after the shared expert's GEMM1 items


def test_summarize_rejects_an_empty_slot_and_a_bad_shape():
  with pytest.raises(ValueError, match="no stamps"):
    timeline.summarize(np.zeros(abi.TL_CALL_WORDS, np.uint64), 1)
  with pytest.raises(ValueError, match="words"):
    timeline.parse_slot(np.zeros(3, np.uint64))


def test_the_timeline_follows_the_workspace_in_the_runtime_allocation(monkeypatch):
  from gcmoe_jax.ffi import _cuda
  from gcmoe_jax.kernels.build import Variant

  ws = Variant(512, 256, 8, 4, 8).workspace()
  monkeypatch.setenv("GCMOE_ABLATION", "")
  assert _cuda.workspace_bytes(ws) == ws.total
  monkeypatch.setenv("GCMOE_ABLATION", "timeline")
  assert _cuda.workspace_bytes(ws) == ws.total + abi.TIMELINE_BYTES
  monkeypatch.setenv("GCMOE_ABLATION", "timeline+kbany")  # the stamps in another ablation's build
  assert _cuda.workspace_bytes(ws) == ws.total + abi.TIMELINE_BYTES
  monkeypatch.setenv("GCMOE_ABLATION", "kbany")
  assert _cuda.workspace_bytes(ws) == ws.total


def test_timeline_combines_with_one_other_ablation(monkeypatch):
  """``GCMOE_ABLATION=timeline+NAME``: the stamping build of ablation NAME (the kernels build NAME, the runtime and
  `bench.timeline` add the stamps' region); anything else after the plus is refused, naming what is accepted."""
  from gcmoe_jax import _config

  for value, kernels, stamps in (("", "", False), ("timeline", "timeline", True), ("kbany", "kbany", False),
                                 ("timeline+kbany", "kbany", True), ("timeline+routedfirst", "routedfirst", True)):
    monkeypatch.setenv("GCMOE_ABLATION", value)
    assert (_config.kernel_ablation(), _config.timeline_build()) == (kernels, stamps), value
  for bad in ("timeline+", "timeline+timeline", "timeline+nosuch", "kbany+timeline", "nosuch"):
    monkeypatch.setenv("GCMOE_ABLATION", bad)
    with pytest.raises(ValueError, match="GCMOE_ABLATION.*timeline\\+ one of the others"):
      _config.get("GCMOE_ABLATION")


def test_item_ranges_follow_role_2s_queue_order():
  small, large = abi.item_order(8), abi.item_order(64)  # shared first up to 32 tokens, routed first above
  for order in (small, large):  # routed only, the orders agree
    r = timeline.item_ranges(256, 384, order=order)
    assert (r["routed GEMM1"], r["routed GEMM2"]) == ((0, 256), (256, 640)) and not any(
      hi - lo for k, (lo, hi) in r.items() if k.startswith("shared"))
  assert timeline.item_ranges(256, 384, 64, 96, small) == {"shared GEMM1": (0, 64), "routed GEMM1": (64, 320),
                                                           "shared GEMM2": (320, 416), "routed GEMM2": (416, 800)}
  assert timeline.item_ranges(256, 384, 64, 96, large) == {"routed GEMM1": (0, 256), "shared GEMM1": (256, 320),
                                                           "routed GEMM2": (320, 704), "shared GEMM2": (704, 800)}
  assert abi.item_order(32) == small and abi.item_order(33) == large
  assert abi.item_order(8, "routedfirst") == large and abi.item_order(256, "sharedfirst") == small
  assert abi.item_order(8, "timeline") == small  # the timeline build keeps the default queue


def test_call_ranges_count_the_shared_items_of_the_token_groups():
  # GLM5.2 B = 1 (8 experts hit, one group of one token: both shared GEMMs in two halves per column block), B = 8
  # (one group), B = 64 with groups of 16 (4 groups), B = 33 (3 groups, the last of one token); routed only
  assert timeline.call_ranges(960, 8, 32, 48, 64, 96, tokens=1) == timeline.item_ranges(256, 384, 128, 192)
  assert timeline.call_ranges(800, 8, 32, 48, 64, 96, tokens=8) == timeline.item_ranges(256, 384, 64, 96)
  assert timeline.call_ranges(32 * 80 + 4 * 160, 32, 32, 48, 64, 96, tokens=64,
                              group=16) == timeline.item_ranges(1024, 1536, 256, 384)
  assert timeline.call_ranges(30 * 80 + 4 * 160, 30, 32, 48, 64, 96, tokens=33,
                              group=16) == timeline.item_ranges(960, 1440, 256, 384)
  # B = 2 (one group of two tokens: halves too), B = 10 (8 + 2: the tail group's halves), B = 11 (8 + 3: none)
  assert timeline.call_ranges(960, 8, 32, 48, 64, 96, tokens=2) == timeline.item_ranges(256, 384, 128, 192)
  assert timeline.call_ranges(1120, 8, 32, 48, 64, 96, tokens=10) == timeline.item_ranges(256, 384, 192, 288)
  assert timeline.call_ranges(960, 8, 32, 48, 64, 96, tokens=11) == timeline.item_ranges(256, 384, 128, 192)
  assert timeline.call_ranges(640, 8, 32, 48) == timeline.item_ranges(256, 384)
  with pytest.raises(ValueError, match="800 items, expected 960 for 8 experts"):
    timeline.call_ranges(800, 8, 32, 48, 64, 96, tokens=1)
  # Groups of 16 in the one-CTA variants: past r = C k / E = 32 rows per expert (`abi.PASS_TIERS`), or past
  # capacity 32 with the rule before session 27.
  caps = (8, 16, 32, 64, 128, 256)
  assert [timeline.shared_group_tokens(c, 8, 32) for c in caps] == [8, 8, 8, 8, 8, 16]  # GLM5.2 per rank
  assert [timeline.shared_group_tokens(c, 6, 48) for c in caps] == [8] * 6  # DSV4.1-Flash per rank
  assert [timeline.shared_group_tokens(c, 8, 32, "onecta") for c in caps] == [8, 8, 8, 16, 16, 16]


def test_item_stats_separate_the_kinds():
  w, t0 = _slot(np.random.default_rng(1))
  # items 0, 1: routed GEMM1; 2: shared GEMM1; 3: routed GEMM2; 4: shared GEMM2 (the routed-first queue)
  stats = timeline.item_stats(w, timeline.item_ranges(2, 1, 1, 1, abi.item_order(64)))
  got = {k.kind: k for k in stats}
  assert [k.items for k in stats] == [2, 1, 1, 1]
  assert got["routed GEMM1"].first_start == 10.0 and got["routed GEMM1"].last_end == 42.0
  assert got["routed GEMM1"].median_us == pytest.approx(30.5) and got["routed GEMM1"].max_us == pytest.approx(31.0)
  assert got["shared GEMM1"].median_us == pytest.approx(27.9)
  assert got["routed GEMM2"].median_us == pytest.approx(19.5)  # claim to end: its wait included
  assert got["shared GEMM2"].first_start == pytest.approx(70.2) and got["shared GEMM2"].last_end == 85.0
  assert "| 1 | 0 | shared GEMM2 | 1 |" in timeline.kinds_markdown([(1, 0, stats)])


def test_sm_sharing_splits_the_first_gemm1_items_by_their_sms_other_ctas():
  """Word 5 of a CTA's record is its SM (``%smid`` + 1): CTAs 0 and 1 on SM 5 begin with GEMM1 items (40 and 44 us),
  CTA 2 on SM 6 with one (25 us) beside CTA 3, which begins with a GEMM2 item and then takes a GEMM1 item (30 us);
  CTAs 4-6 on SM 7 begin with GEMM1 items (50, 52, 54 us: three CTAs per SM)."""
  w = np.zeros(abi.TL_CALL_WORDS, np.uint64)
  t0 = 10**12
  w[:5] = [t0, t0 + 1000, t0 + 200_000, t0 + 201_000, 3]
  ctas = {0: (5, [(0, 1_000, 1_000, 41_000)]), 1: (5, [(1, 1_000, 1_000, 45_000)]),
          2: (6, [(2, 1_000, 1_000, 26_000)]), 3: (6, [(9, 1_000, 30_000, 40_000), (3, 40_000, 40_000, 70_000)]),
          4: (7, [(0, 1_000, 1_000, 51_000)]), 5: (7, [(1, 1_000, 1_000, 53_000)]), 6: (7, [(2, 1_000, 1_000, 55_000)])}
  for b, (sm, rec) in ctas.items():
    base = abi.TL_HEAD + b * abi.TL_CTA_WORDS
    w[base:base + 6] = [t0 + 100, t0 + 500, t0 + 900, t0 + 80_000, len(rec), sm + 1]
    for i, (item, start, mma, end) in enumerate(rec):
      w[base + 8 + 4 * i:base + 12 + 4 * i] = [item, t0 + start, t0 + mma, t0 + end]
  s = timeline.sm_sharing(w, gemm1_items=4)  # items 0-3 GEMM1
  assert s.alone.tolist() == [25.0] and sorted(s.beside.tolist()) == [40.0, 44.0]
  assert sorted(s.crowded.tolist()) == [50.0, 52.0, 54.0]
  assert s.per_sm == {5: 42.0, 6: 27.5, 7: 52.0}
  table = timeline.sharing_markdown([(1, [s, s])])
  assert "| 1 | 2, 25.0 | 4, 42.0 | 6, 52.0 | 27.5-52.0, 3 |" in table
  none = timeline.SmSharing(np.zeros(0), np.zeros(0), {})  # (a call whose CTAs began with no GEMM1 item)
  assert "| 2 | 0, - | 0, - | 0, - | -, 0 |" in timeline.sharing_markdown([(2, [none])])
  for b in ctas:  # a build before the SM word: nothing to split
    w[abi.TL_HEAD + b * abi.TL_CTA_WORDS + 5] = 0
  assert timeline.sm_sharing(w, 4) is None
