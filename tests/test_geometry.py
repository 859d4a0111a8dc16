"""Tests for gcmoe_jax.geometry and the `plan` command (no GPU).

Expected values come from the paper ("GC-MoE on SM120", shared/seeds/000): Table 2, eqs. 1, 4, 5, 8-13, §4.4-§5.1,
Table 10. Where the paper gives no number, the value is derived by hand from its equations in the test itself and
the test says so; none is copied from the implementation's output.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcmoe_jax import geometry as g
from gcmoe_jax.commands import plan as plan_cmd

# ----------------------------------------------------------------------------------------------------------------
# Table 2 (paper §4.4): both models at R = 8, routed and fused shared expert.
# ----------------------------------------------------------------------------------------------------------------

# Table 2, B = 256. Columns: rows/expert, tile_n, stages, compact weights, handoff global + shared chunks, batched
# BF16 returns, mirrored metadata, resident relay copiers, pull cache, ℓ. Slashes in the paper separate routed from
# fused; the GLM5.2 row has no slash, so both variants share its values.
TABLE2_B256 = {
  ("glm5.2", False): dict(r=64, tile_n=80, stages=2, compact=True, handoff=True, batched=True, mirrored=False,
                          relay=True, cache=True, ell=4),
  ("glm5.2", True): dict(r=64, tile_n=80, stages=2, compact=True, handoff=True, batched=True, mirrored=False,
                         relay=True, cache=True, ell=4),
  ("dsv4.1-flash", False): dict(r=32, tile_n=48, stages=2, compact=True, handoff=True, batched=True, mirrored=True,
                                relay=False, cache=False, ell=3),
  ("dsv4.1-flash", True): dict(r=32, tile_n=48, stages=2, compact=True, handoff=True, batched=True, mirrored=True,
                               relay=True, cache=False, ell=4),
}


def _plan(model: str, B: int, shared: bool = False, **kw) -> g.Plan:
  return g.plan(g.Problem.for_model(model, R=8, B=B, shared=shared), **kw)


@pytest.mark.parametrize("model,shared", list(TABLE2_B256), ids=lambda v: str(v))
def test_table2_b256(model, shared):
  q = _plan(model, 256, shared)
  want = TABLE2_B256[(model, shared)]
  got = dict(r=q.tile.rows_per_expert, tile_n=q.tile.tile_n, stages=q.tile.stages, compact=q.tile.compact_weights,
             handoff=q.tile.global_handoff and q.tile.shared_chunks, batched=q.returns.batched,
             mirrored=q.returns.mirrored_metadata, relay=q.returns.relay, cache=q.returns.pull_cache,
             ell=q.launch.l2_dedicated)
  assert got == want, f"{model=}, {shared=}"
  # "resident relay copiers": eq. 13 gives G_relay = min(R, c*S_compute - ℓ) = min(8, 2*104 - ℓ) = 8 when relaying
  # (c = 2 is derived in test_role2_smem_model_tile80).
  assert q.launch.relay_grid == (8 if want["relay"] else 0)


@pytest.mark.parametrize("model", ["glm5.2", "dsv4.1-flash"])
@pytest.mark.parametrize("shared", [False, True])
def test_table2_b1(model, shared):
  q = _plan(model, 1, shared)
  # Table 2, B = 1: "1, 16, 4" for both models.
  assert (q.tile.rows_per_expert, q.tile.tile_n, q.tile.stages) == (1, 16, 4)
  # The paper prints nothing else at B = 1; derived from §4.4: tile 16 is not a compact tier and has no global
  # handoff; B*k = 8 or 6 < 32L; mirrored iff k < R; no relay or cache without batched returns; ℓ = 1 (default).
  assert not q.tile.compact_weights and not q.tile.global_handoff and q.tile.handoff_slots == 1
  assert not q.returns.batched and not q.returns.relay and not q.returns.pull_cache
  assert q.returns.mirrored_metadata == (model == "dsv4.1-flash")
  assert q.launch.l2_dedicated == 1
  assert q.returns.direct_scan  # §4.5: B <= 2


def test_table2_dsv_variants_differ_in_one_scheduling_decision():
  # §4.4: fusing the shared expert turns the relay back on for DSV4.1-Flash, "which raises ℓ to 4 and makes the two
  # variants of the second model differ in exactly one scheduling decision".
  routed, fused = _plan("dsv4.1-flash", 256), _plan("dsv4.1-flash", 256, True)
  assert routed.tile == dataclasses.replace(fused.tile, shared_tile_n=None)
  assert (routed.returns.relay, fused.returns.relay) == (False, True)
  assert (routed.launch.l2_dedicated, fused.launch.l2_dedicated) == (3, 4)


# ----------------------------------------------------------------------------------------------------------------
# Eq. 1, eq. 8 and the §4.4 consequences of the tile.
# ----------------------------------------------------------------------------------------------------------------


def test_rows_per_expert_eq1():
  # §2.1: "with L=32, k=8 and B=1, r=1; even at B=256 we have r=64".
  assert g.rows_per_expert(1, 8, 32) == 1
  assert g.rows_per_expert(256, 8, 32) == 64
  assert g.rows_per_expert(256, 6, 48) == 32  # Table 2, DSV4.1-Flash
  assert g.rows_per_expert(5, 8, 32) == 2  # ceil(40/32)


# r -> tile_n from eq. 8 and the §4.4 fallbacks (16 below r = 16, 64 for 48 <= r < 64 and r >= 96), including the
# floor(sqrt(r)) slack of the 80 tier: 72 + 8 = 80 <= 80, 73 + 8 = 81 > 80.
TILE_CASES = [(1, 16), (15, 16), (16, 32), (31, 32), (32, 48), (47, 48), (48, 64), (63, 64), (64, 80), (71, 80),
              (72, 80), (73, 96), (80, 96), (95, 96), (96, 64), (200, 64)]


@pytest.mark.parametrize("r,tile_n", TILE_CASES)
def test_select_tile_n_eq8(r, tile_n):
  assert g.select_tile_n(r)[0] == tile_n
  assert "eq. 8" in g.select_tile_n(r)[1]


@pytest.mark.parametrize("r,tile_n", TILE_CASES)
def test_tile_consequences_through_plan(r, tile_n):
  # E = R gives L = 1, and k = 1 makes r = B.
  q = g.plan(R=8, E=8, k=1, B=r, H=4096, I=2048)
  assert q.tile.rows_per_expert == r and q.tile.tile_n == tile_n
  # §4.4: four stages only at tile 16; compact for {48, 80, 96}; global handoff for tile >= 32, shared 32-row
  # chunks for tile >= 48; s = 2 with a global handoff.
  assert q.tile.stages == (4 if tile_n == 16 else 2)
  assert q.tile.compact_weights == (tile_n in (48, 80, 96))
  assert q.tile.global_handoff == (tile_n >= 32)
  assert q.tile.shared_chunks == (tile_n >= 48)
  assert q.tile.handoff_slots == (2 if tile_n >= 32 else 1)


def test_sqrt_slack_edges():
  assert math.isqrt(72) == 8 and math.isqrt(73) == 8
  assert g.select_tile_n(72)[0] == 80 and g.select_tile_n(73)[0] == 96
  assert "= 80 <= 80" in g.select_tile_n(72)[1]
  assert "= 81 > 80" in g.select_tile_n(73)[1]


# ----------------------------------------------------------------------------------------------------------------
# Eq. 4 (co-residency, register ceiling) and the role-2 SMEM model (eqs. 9-12).
# ----------------------------------------------------------------------------------------------------------------


def test_register_cap_eq4_examples():
  # §5.1: "160 registers per thread at two CTAs per SM, 80 at four, and no ceiling when a single CTA co-resides".
  assert g.register_cap(2) == 160
  assert g.register_cap(4) == 80
  assert g.register_cap(1) is None
  assert g.register_cap(3) == 112  # derived: 16*floor(65536/(3*192*16)) = 16*7


def test_role2_smem_model_tile80():
  # Eqs. 10-11 by hand for tile_n = 80, two stages, compact weights, s = 2, shared 32-row chunks:
  # P_W = 64*128/2 + 512 = 4608, P_X = 80*128 + 512 = 10752, B_bar = 2 barriers * 8 B * 2 stages = 32 (our
  # reading), B_ret = 20*80 + 128*32*2 = 9792, B_util = 32 + 24*2 + 16*2*80 = 2640.
  want = 2 * (4608 + 10752) + 80 * 16 + 16 + 32 + 9792 + 2640 + 512
  assert want == 44992
  q = _plan("glm5.2", 256)
  assert (q.smem.p_w, q.smem.p_x, q.smem.b_ret, q.smem.b_util, q.smem.model) == (4608, 10752, 9792, 2640, want)
  # eq. 9 with the relay term 2*(16 KB + 8) = 32784 < S_model.
  assert q.smem.relay == 32784 and q.smem.role2 == want
  # eq. 4 on 100 KB with the driver's 1 KB per CTA: floor(102400 / 46016) = 2 -> R_cap 160.
  assert q.launch.ctas_per_sm == 2 and q.launch.reg_cap == 160


@pytest.mark.parametrize("tile_n,compact_c,expanded_c", [(80, 2, 1), (96, 2, 1)])
def test_compact_weights_buy_a_cta(tile_n, compact_c, expanded_c):
  # §4.3: "the compact path is selected exactly for the tile widths where the freed 4 KB buys a second co-resident
  # CTA". By hand: tile 96 compact = 2*(4608+12800) + 1552 + 32 + (1920+8192) + (32+48+3072) + 512 = 50176, and
  # 2*(50176 + 1024) = 102400 exactly; expanded weights add 2*4096 and fall to one CTA.
  for compact, want_c in ((True, compact_c), (False, expanded_c)):
    tile = g.Tile(0, tile_n, 2, compact, True, True, 2, None)
    smem = g.role2_smem(tile, shared=False, relay=False)
    assert g.ctas_per_sm(smem.role2, g.ROLE2_THREADS, g.RTX_PRO_5000) == want_c, f"{tile_n=}, {compact=}"
  assert g.role2_smem(g.Tile(0, 96, 2, True, True, True, 2, None), shared=False, relay=False).model == 50176


def test_shared_expert_smem_eq12():
  # eq. 12: 1024*ceil((8192 + 512 + 132*tile_ns)/1024).
  assert g.shared_smem(8) == 10 * 1024  # 9760 -> 10 KB
  assert g.shared_smem(64) == 17 * 1024  # 17152 -> 17 KB
  assert [g.shared_tile_n(b) for b in (1, 8, 9, 16, 17, 33, 64, 256)] == [8, 8, 16, 16, 32, 64, 64, 64]
  # DSV4.1-Flash fused at B = 256: 2*17408 + 16 = 34832 beats S_model (48 tile) and the relay's 32784 (eq. 9).
  q = _plan("dsv4.1-flash", 256, True)
  assert q.smem.role2 == 2 * 17408 + 16


def test_c_never_zero_and_respects_register_file():
  for model in g.MODELS:
    for shared in (False, True):
      for B in g.DECODE_BATCHES:
        q = _plan(model, B, shared)
        c = q.launch.ctas_per_sm
        assert 1 <= c <= 4
        assert c * (q.smem.role2 + 1024) <= 102400
        if q.launch.reg_cap:
          assert c * g.ROLE2_THREADS * q.launch.reg_cap <= 65536


# ----------------------------------------------------------------------------------------------------------------
# Return staging (§4.4) and dispatch (§4.5).
# ----------------------------------------------------------------------------------------------------------------


def test_batched_returns_threshold():
  # B*k >= 32L: GLM5.2 (L=32, k=8) from B = 128; DSV4.1-Flash (L=48, k=6) exactly at B = 256 (1536 = 1536).
  assert not _plan("glm5.2", 127).returns.batched
  assert _plan("glm5.2", 128).returns.batched
  assert not _plan("dsv4.1-flash", 255).returns.batched
  assert _plan("dsv4.1-flash", 256).returns.batched
  # ... and the workspace must carry the batched route array.
  p = dataclasses.replace(g.Problem.for_model("glm5.2", R=8, B=256), batched_routes=False)
  assert not g.plan(p).returns.batched


def test_relay_budget_256mb_boundary():
  # R*Bcap*k*2H with R = 8, k = 8, H = 8192: Bcap = 256 gives exactly 256 MiB (allowed), 257 is over.
  base = dict(R=8, E=64, k=8, B=256, H=8192, I=2048)
  assert 8 * 256 * 8 * 2 * 8192 == 256 * 2**20
  assert g.plan(**base, capacity=256).returns.relay
  over = g.plan(**base, capacity=257)
  assert not over.returns.relay and over.returns.batched
  assert any("> 256 MB" in r for r in over.reasons)
  assert over.launch.l2_dedicated == 3  # batched, no copiers, no shared expert (§4.4)


def test_pull_cache_rules():
  # §4.5: arena fits, k >= R, and tile 80 or tile 48 with batched returns.
  q = _plan("glm5.2", 128)  # r = 32 -> tile 48, B*k = 1024 = 32L -> batched
  assert (q.tile.tile_n, q.returns.batched, q.returns.pull_cache) == (48, True, True)
  assert q.returns.pull_cache_bytes == 8 * 8 * 256  # 8*R*Bcap
  # tile 96 (r = 73 with L = k = 8): batched and k >= R, but return staging consumes the arena -> no cache.
  q = g.plan(R=8, E=64, k=8, B=73, H=4096, I=2048)
  assert (q.tile.tile_n, q.returns.batched, q.returns.pull_cache) == (96, True, False)
  # k < R never caches.
  assert not _plan("dsv4.1-flash", 256).returns.pull_cache


def test_pull_batch_depth():
  # §4.5: 8 rows when L < 48, else 1; 4 with the pull cache; 2 for batched returns without mirrored metadata.
  assert _plan("glm5.2", 1).returns.pull_batch_depth == 8  # L = 32
  assert _plan("dsv4.1-flash", 1).returns.pull_batch_depth == 1  # L = 48
  assert _plan("glm5.2", 256).returns.pull_batch_depth == 4  # cache on
  q = g.plan(R=8, E=64, k=8, B=73, H=4096, I=2048)  # tile 96, batched, k = R (no mirror), no cache
  assert q.returns.pull_batch_depth == 2
  assert _plan("dsv4.1-flash", 256).returns.pull_batch_depth == 1  # batched but mirrored: L = 48 rule


def test_l2_dedicated_rules():
  # §4.4: 1 by default; 4 with tile >= 64 or a global handoff; 6 for the unbatched 80 tier; 3 for batched returns
  # without copiers and without a shared expert.
  assert g.l2_dedicated(16, False, False, False, False)[0] == 1
  assert g.l2_dedicated(32, True, False, False, False)[0] == 4
  assert g.l2_dedicated(80, True, False, False, False)[0] == 6
  assert g.l2_dedicated(80, True, True, True, False)[0] == 4
  assert g.l2_dedicated(48, True, True, False, False)[0] == 3
  assert g.l2_dedicated(48, True, True, False, True)[0] == 4
  # ℓ = 6 through plan: tile 80 with a workspace lacking the batched route array.
  p = dataclasses.replace(g.Problem.for_model("glm5.2", R=8, B=256), batched_routes=False)
  assert g.plan(p).launch.l2_dedicated == 6


def test_grids():
  q = _plan("glm5.2", 1)
  # Unbatched finalize: min(2*S_compute, ceil(B*H/2048)) = min(208, 3), 384 threads.
  assert (q.launch.finalize_grid, q.launch.finalize_threads) == (3, 384)
  # Dispatch: S_role1 = 512 + 16*6144 + 64 = 98880 fits one CTA per SM -> 6 * 1.
  assert q.smem.role1 == 98880 and q.launch.dispatch_grid == 6 and q.returns.bulk_pull_engine
  q = _plan("glm5.2", 256)
  # Batched finalize: min(Bcap, 4*S_compute) = min(256, 416), 256 threads (Table 1).
  assert (q.launch.finalize_grid, q.launch.finalize_threads) == (256, 256)
  assert q.launch.compute_grid == 2 * 104 and q.launch.mma_grid == 208 - 8
  # H = 8192 on SM120: 16H + 576 = 131648 B exceeds the 99 KB block limit -> no bulk-pull engine.
  assert not g.plan(R=8, E=64, k=8, B=8, H=8192, I=2048).returns.bulk_pull_engine


# ----------------------------------------------------------------------------------------------------------------
# Eq. 5: the green-context split.
# ----------------------------------------------------------------------------------------------------------------


def test_split_eq5():
  # SM120: 6 dispatch SMs by default (Table 1, Table 3), S_compute = 8*floor(104/8) = 104.
  part, bad = g.split_sms(g.RTX_PRO_5000)
  assert (part.dispatch_sms, part.compute_sms, bad) == (6, 104, ())
  # An odd request: compute = 8*floor(103/8) = 96; dispatch takes the remaining 14.
  part, _ = g.split_sms(g.RTX_PRO_5000, 7)
  assert (part.dispatch_sms, part.compute_sms) == (14, 96)
  # H100: 132 = 16*8 + 4 -> 120 compute, 12 dispatch by default; 4 requested -> 128 / 4.
  assert (g.split_sms(g.H100)[0].compute_sms, g.split_sms(g.H100)[0].dispatch_sms) == (120, 12)
  assert (g.split_sms(g.H100, 4)[0].compute_sms, g.split_sms(g.H100, 4)[0].dispatch_sms) == (128, 4)


@pytest.mark.parametrize("device, local, fused", [(g.H100, (128, 4), (120, 12)), (g.H200, (128, 4), (120, 12)),
                                                  (g.RTX_PRO_5000, (104, 6), (104, 6))])
def test_dispatch_request_unset_gives_a_local_call_every_aligned_sm(device, local, fused):
  def split(requested, peers):
    part, bad = g.split_sms(device, g.dispatch_request(device, requested, peers=peers))
    assert bad == ()
    return part.compute_sms, part.dispatch_sms
  assert split(None, peers=False) == local
  assert split(None, peers=True) == fused
  # A request (GC_MOE_SM120_DISPATCH_SMS) wins over both defaults.
  assert split(12, peers=False) == split(12, peers=True) == ((device.sm_count - 12) // 8 * 8,
                                                              device.sm_count - (device.sm_count - 12) // 8 * 8)
  with pytest.raises(TypeError, match="dispatch_sms must be an int"):
    g.dispatch_request(device, 4.0, peers=False)


def test_dispatch_sms_variable_rejects_non_positive(monkeypatch):
  from gcmoe_jax import _config
  monkeypatch.delenv("GC_MOE_SM120_DISPATCH_SMS", raising=False)
  assert _config.get("GC_MOE_SM120_DISPATCH_SMS") is None
  monkeypatch.setenv("GC_MOE_SM120_DISPATCH_SMS", "4")
  assert _config.get("GC_MOE_SM120_DISPATCH_SMS") == 4
  for bad in ("0", "-2", "six"):
    monkeypatch.setenv("GC_MOE_SM120_DISPATCH_SMS", bad)
    with pytest.raises(ValueError, match=f"GC_MOE_SM120_DISPATCH_SMS must be a positive int, got '{bad}'"):
      _config.get("GC_MOE_SM120_DISPATCH_SMS")


def _device(**kw) -> g.Device:
  return dataclasses.replace(g.RTX_PRO_5000, name="test", **kw)


def test_split_rejections():
  glm = g.Problem.for_model("glm5.2", R=8, B=1)
  with pytest.raises(g.GeometryError, match=r"S_compute must be >= 32 \(eq. 5, §4.2\), got 8"):
    g.plan(glm, dispatch_sms=100)
  with pytest.raises(g.GeometryError, match=r"S_compute must be even \(§4.2\), got 105"):
    g.plan(glm, device=_device(sm_count=111, gc_alignment=1))
  with pytest.raises(g.GeometryError, match=r"S_dispatch must be > 1 \(§4.2\), got 1"):
    g.plan(glm, device=_device(gc_alignment=1), dispatch_sms=1)
  with pytest.raises(g.GeometryError, match=r"dispatch_sms must be in \[1, 109\].*got 0"):
    g.plan(glm, dispatch_sms=0)
  with pytest.raises(TypeError, match="plan: dispatch_sms must be an int"):
    g.plan(glm, dispatch_sms="6")


def test_residency_rejections():
  # 106 dispatch SMs leave 8*floor(4/8) = 0 compute SMs: the split fails, and so does "l2_dedicated + 1 CTAs".
  glm = g.Problem.for_model("glm5.2", R=8, B=256)
  with pytest.raises(g.GeometryError) as info:
    g.plan(glm, dispatch_sms=106)
  msg = str(info.value)
  assert "S_compute must be >= 32" in msg
  assert "compute partition must host l2_dedicated + 1 = 5 co-resident CTAs (Table 10, §4.4), got" in msg
  assert len(info.value.reasons) >= 2
  # eq. 6 on its own.
  assert g.check_residency("role 2", 208, 2, 104) is None
  assert "grid must be <= c*S = 2*104 = 208 co-resident CTAs (eq. 6), got 209" in g.check_residency("role 2", 209, 2,
                                                                                                     104)
  # A device too small for the role-2 CTA (tile 16 needs 48584 B).
  with pytest.raises(g.GeometryError, match=r"role 2 SMEM must fit one CTA .* got S_role2 = 48584"):
    g.plan(g.Problem.for_model("glm5.2", R=8, B=1), device=_device(smem_per_sm=48 * 1024, smem_per_block=47 * 1024))


# ----------------------------------------------------------------------------------------------------------------
# Table 10 validation and argument errors.
# ----------------------------------------------------------------------------------------------------------------

GOOD = dict(R=8, E=256, k=8, B=16, H=6144, I=2048)


@pytest.mark.parametrize("override,pattern", [
  (dict(R=0), r"R must be in \[1, 32\] \(Table 10\), got 0"),
  (dict(R=33, E=264), r"R must be in \[1, 32\] \(Table 10\), got 33"),
  (dict(E=250), r"E must be a multiple of R \(Table 10: E mod R = 0\), got E=250, R=8"),
  (dict(k=0), r"k must be in \[1, min\(32, E\)\] = \[1, 32\] \(Table 10\), got 0"),
  (dict(k=33), r"k must be in \[1, min\(32, E\)\] = \[1, 32\] \(Table 10\), got 33"),
  (dict(E=16, k=17), r"k must be in \[1, min\(32, E\)\] = \[1, 16\] \(Table 10\), got 17"),
  (dict(H=384), r"H must be a multiple of 128 in \[512, 8192\] \(Table 10\), got 384"),
  (dict(H=8320), r"H must be a multiple of 128 in \[512, 8192\] \(Table 10\), got 8320"),
  (dict(H=1000), r"H must be a multiple of 128 .*got 1000"),
  (dict(I=128), r"I must be a multiple of 128 in \[256, 4096\] \(Table 10\), got 128"),
  (dict(I=4224), r"I must be a multiple of 128 .*got 4224"),
  (dict(I=2000), r"I must be a multiple of 128 .*got 2000"),
  (dict(B=0), r"B must be >= 1, got 0"),
  (dict(capacity=8), r"capacity must be >= B, got capacity=8, B=16"),
  (dict(shared_I=2048), r"shared_I requires shared=True"),
  (dict(shared=True, shared_I=100), r"shared_I must be a multiple of 128 .*got 100"),
])
def test_table10_rejections(override, pattern):
  with pytest.raises(g.GeometryError, match=pattern):
    g.plan(**{**GOOD, **override})


def test_error_lists_every_reason():
  with pytest.raises(g.GeometryError) as info:
    g.plan(R=40, E=100, k=0, B=0, H=100, I=100, dispatch_sms=200)
  reasons = info.value.reasons
  for needle in ("R must be in", "k must be in", "H must be", "I must be", "B must be", "dispatch_sms must be"):
    assert sum(needle in r for r in reasons) == 1, needle
  assert str(info.value).startswith(f"plan: {len(reasons)} constraints reject this shape:")
  assert isinstance(info.value, ValueError)


def test_type_errors():
  with pytest.raises(TypeError, match="plan: R must be an int, got '8'"):
    g.Problem(R="8", E=256, k=8, B=1, H=6144, I=2048)
  with pytest.raises(TypeError, match="plan: k must be an int, got True"):
    g.Problem(R=8, E=256, k=True, B=1, H=6144, I=2048)
  with pytest.raises(TypeError, match="plan: shared must be a bool, got 1"):
    g.Problem(R=8, E=256, k=8, B=1, H=6144, I=2048, shared=1)
  with pytest.raises(TypeError, match="plan: pass either a Problem or its fields"):
    g.plan(g.Problem(**GOOD), R=8)
  with pytest.raises(TypeError, match=r"plan: keywords must be Problem fields .*got \['experts'\]"):
    g.plan(**GOOD, experts=8)
  with pytest.raises(TypeError, match="plan: R, E, k, B, H and I are required, got no H, I"):
    g.plan(R=8, E=256, k=8, B=1)
  with pytest.raises(TypeError, match="plan: device must be a Device, got str"):
    g.plan(g.Problem(**GOOD), device="h100")
  with pytest.raises(ValueError, match="plan: model must be one of"):
    g.Problem.for_model("mixtral", R=8, B=1)


# ----------------------------------------------------------------------------------------------------------------
# Plan as data: determinism, caching, reasons, JSON, text.
# ----------------------------------------------------------------------------------------------------------------


def test_plan_is_cached_and_deterministic():
  a = g.plan(**GOOD)
  assert g.plan(**GOOD) is a  # lru_cache on the frozen inputs
  assert g.plan(g.Problem(**GOOD)) is a
  assert g.plan(g.Problem(**GOOD), device=g.H100) is not a
  assert hash(a) == hash(g.plan(**GOOD))
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.tile = None  # type: ignore[misc]


def test_reasons_cite_the_paper():
  q = _plan("glm5.2", 256, True)
  assert len(q.reasons) >= 15
  for reason in q.reasons:
    assert "eq." in reason or "§" in reason or "Table" in reason, reason
  for eq in ("eq. 1", "eq. 4", "eq. 5", "eq. 8", "eq. 9", "eq. 12", "eq. 13", "eq. 6"):
    assert any(eq in r for r in q.reasons), eq


def test_to_dict_is_json():
  q = _plan("dsv4.1-flash", 256, True)
  d = json.loads(json.dumps(q.to_dict()))
  assert d["tile"]["tile_n"] == 48 and d["returns"]["relay"] is True and d["launch"]["l2_dedicated"] == 4
  assert d["problem"]["L"] == 48 and d["device"]["sm_count"] == 110
  assert d["reasons"] == list(q.reasons)


def test_str_is_a_report():
  text = str(_plan("glm5.2", 256))
  assert text.startswith("GC-MoE plan: GLM5.2 R=8 E=256 (L=32) k=8 B=256")
  assert "tile_n=80" in text and "pull_cache=yes" in text and "l2_dedicated=4" in text and "why:" in text


def test_hopper_same_decisions_different_device_facts():
  for model in g.MODELS:
    for shared in (False, True):
      for B in (1, 64, 128, 256):
        sm120, h100 = _plan(model, B, shared), _plan(model, B, shared, device=g.H100)
        assert sm120.tile == h100.tile and sm120.launch.l2_dedicated == h100.launch.l2_dedicated
        assert dataclasses.replace(sm120.returns, handoff_arena_bytes=0) == dataclasses.replace(
          h100.returns, handoff_arena_bytes=0)
        assert h100.partition.compute_sms == 120 and h100.launch.ctas_per_sm == 2 and h100.launch.reg_cap == 160
  assert g.DEVICES["h200"].sm_count == 132


def test_geometry_is_a_leaf_module():
  tree = ast.parse(pathlib.Path(g.__file__).read_text())
  imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
              for alias in node.names}
  imported |= {node.module.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module}
  assert imported <= {"__future__", "dataclasses", "functools", "math", "collections", "typing"}, imported


@settings(max_examples=300, deadline=None)
@given(R=st.sampled_from([1, 2, 4, 8, 16, 32]), L=st.integers(1, 64), k=st.integers(1, 32), B=st.integers(1, 512),
       H=st.integers(4, 64).map(lambda x: 128 * x), I=st.integers(2, 32).map(lambda x: 128 * x),
       shared=st.booleans(), device=st.sampled_from(list(g.DEVICES.values())))
def test_invariants(R, L, k, B, H, I, shared, device):  # noqa: E741
  p = g.Problem(R=R, E=R * L, k=min(k, R * L), B=B, H=H, I=I, shared=shared)
  q = g.plan(p, device=device)
  t, ret, ln = q.tile, q.returns, q.launch
  assert t.rows_per_expert == math.ceil(p.B * p.k / L)
  assert t.tile_n in (16, 32, 48, 64, 80, 96)
  assert not ret.relay or ret.batched
  assert not ret.pull_cache or (p.k >= p.R and ret.batched)
  assert ret.mirrored_metadata == (p.k < p.R)
  assert ln.relay_grid + ln.l2_dedicated <= ln.compute_grid
  assert ln.compute_grid == ln.ctas_per_sm * q.partition.compute_sms
  assert ln.ctas_per_sm * (q.smem.role2 + device.reserved_smem_per_block) <= device.smem_per_sm
  assert q.partition.compute_sms + q.partition.dispatch_sms == device.sm_count


# ----------------------------------------------------------------------------------------------------------------
# The `plan` command.
# ----------------------------------------------------------------------------------------------------------------


def _parse(*argv: str) -> argparse.Namespace:
  parser = argparse.ArgumentParser()
  plan_cmd.register(parser.add_subparsers(dest="command"))
  return parser.parse_args(["plan", *argv])


def test_cli_text(capsys):
  args = _parse("--model", "glm5.2", "--ranks", "8", "--batch", "256")
  assert args.func is plan_cmd.run
  assert args.func(args) == 0
  out = capsys.readouterr().out
  assert "tile_n=80" in out and "relay=yes" in out and "pull_cache=yes" in out


def test_cli_json(capsys):
  assert plan_cmd.run(_parse("--model", "dsv4.1-flash", "--batch", "256", "--shared", "--json")) == 0
  d = json.loads(capsys.readouterr().out)
  assert d["tile"]["tile_n"] == 48 and d["returns"]["relay"] is True and d["launch"]["l2_dedicated"] == 4
  assert plan_cmd.run(_parse("--model", "glm5.2", "--batch", "1,256", "--json", "--device", "h100")) == 0
  ds = json.loads(capsys.readouterr().out)
  assert [d["tile"]["tile_n"] for d in ds] == [16, 80] and ds[0]["device"]["arch"] == "sm_90a"


def test_cli_markdown(capsys):
  batches = ",".join(map(str, g.DECODE_BATCHES))
  assert plan_cmd.run(_parse("--model", "glm5.2", "--batch", batches, "--markdown")) == 0
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
  assert len(rows) == 1 + len(g.DECODE_BATCHES)  # header + one row per B
  assert rows[-1].startswith("| 256 | 64 | 80 | 2 | yes |")  # Table 2, GLM5.2 at B = 256


def test_cli_custom_and_errors(capsys):
  args = _parse("--model", "custom", "--experts", "64", "--topk", "4", "--hidden", "4096", "--intermediate", "1024",
                "--batch", "32", "--json")
  assert plan_cmd.run(args) == 0
  d = json.loads(capsys.readouterr().out)
  assert d["problem"]["E"] == 64 and d["tile"]["rows_per_expert"] == math.ceil(32 * 4 / 8)
  assert plan_cmd.run(_parse("--model", "custom", "--experts", "64", "--batch", "1")) == 2
  assert "requires --experts, --topk, --hidden and --intermediate, got no --topk" in capsys.readouterr().err
  assert plan_cmd.run(_parse("--model", "glm5.2", "--batch", "1", "--hidden", "4096")) == 2
  assert "--hidden applies only to --model custom" in capsys.readouterr().err
  assert plan_cmd.run(_parse("--model", "glm5.2", "--ranks", "40", "--batch", "1")) == 1
  assert "R must be in [1, 32]" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    _parse("--model", "glm5.2", "--batch", "x")


def test_virtual_rank_splits_on_one_h200():
  # docs/fused_transport.md: R = 2 -> 8 + 56 per rank (4 SMs left), R = 3 -> 8 + 32 (12 left), R = 4 -> 8 + 24,
  # which fails the 32-SM floor unless a test lowers it.
  assert g.split_virtual_ranks(g.H200, 1) == (g.VirtualRanks(1, 12, 120, 0), ())
  assert g.split_virtual_ranks(g.H200, 2) == (g.VirtualRanks(2, 8, 56, 4), ())
  assert g.split_virtual_ranks(g.H200, 3) == (g.VirtualRanks(3, 8, 32, 12), ())
  split, bad = g.split_virtual_ranks(g.H200, 4)
  assert split == g.VirtualRanks(4, 8, 24, 4)
  assert bad == ("S_compute must be >= 32 per rank (eq. 5, §4.2), got 24 (= 8*floor((132 - 4*8)/(4*8)) with 4 ranks)",)
  assert g.split_virtual_ranks(g.H200, 4, min_compute_sms=16) == (g.VirtualRanks(4, 8, 24, 4), ())
  # A dispatch request is rounded up to the alignment: 9 -> 16 per rank.
  assert g.split_virtual_ranks(g.H200, 2, 9)[0] == g.VirtualRanks(2, 16, 48, 4)
  for r in (2, 3, 4):
    s = g.split_virtual_ranks(g.H200, r, min_compute_sms=8)[0]
    assert r * (s.dispatch_sms + s.compute_sms) + s.leftover_sms == 132 and s.compute_sms % 8 == 0


def test_virtual_rank_splits_from_the_drivers_groups():
  # The H200's driver makes 15 groups of 8 from 132 SMs (measured): R = 2 -> 8 + 48, R = 3 -> 8 + 32, R = 4 -> 8 + 16.
  assert g.split_virtual_ranks(g.H200, 2, groups=15) == (g.VirtualRanks(2, 8, 48, 20), ())
  assert g.split_virtual_ranks(g.H200, 3, groups=15) == (g.VirtualRanks(3, 8, 32, 12), ())
  split, bad = g.split_virtual_ranks(g.H200, 4, groups=15)
  assert split == g.VirtualRanks(4, 8, 16, 36)
  assert bad == ("S_compute must be >= 32 per rank (eq. 5, §4.2), got 16 (= 8*floor(15/4) - 8 with 15 driver groups)",)
  assert g.split_virtual_ranks(g.H200, 4, groups=15, min_compute_sms=16)[1] == ()
  assert g.split_virtual_ranks(g.H200, 2, 9, groups=15)[0] == g.VirtualRanks(2, 16, 40, 20)
  with pytest.raises(ValueError, match=r"groups must be in \[0, 16\] \(8-SM groups of 132 SMs\), got 17"):
    g.split_virtual_ranks(g.H200, 2, groups=17)


def test_virtual_rank_split_rejections():
  with pytest.raises(ValueError, match="plan: ranks must be >= 1, got 0"):
    g.split_virtual_ranks(g.H200, 0)
  with pytest.raises(TypeError, match="plan: ranks must be an int"):
    g.split_virtual_ranks(g.H200, 2.0)
  _, bad = g.split_virtual_ranks(g.H200, 8)
  assert bad and "got 8 (= 8*floor((132 - 8*8)/(8*8)) with 8 ranks)" in bad[0]
  _, bad = g.split_virtual_ranks(g.H200, 2, 0)
  assert bad == ("dispatch_sms must be >= 1, got 0",)
  split, bad = g.split_virtual_ranks(g.H200, 16, min_compute_sms=0)  # 16 dispatch groups of 8 leave 4 SMs
  assert split.compute_sms == 0
  assert bad == ("16 ranks need 16 dispatch groups of 8 SMs and at least 8 compute SMs each, the device has 132 SMs",)


@pytest.mark.parametrize("model", ["glm5.2", "dsv4.1-flash"])
@pytest.mark.parametrize("shared", [False, True])
def test_relay_staging_is_the_plans_return_path(model, shared):
  """`relay_staging` (what the fused transport's variant takes, ffi._cuda.prepare) is the plan's decision at every
  decode point: Table 2 at B = 256 (GLM5.2 relay, DSV4.1-Flash direct unless the shared expert is fused), direct
  wherever the returns are not batched (B k < 32 L)."""
  for b in (1, 8, 32, 64, 128, 256):
    q = g.plan(g.Problem.for_model(model, R=8, B=b, shared=shared, capacity=b))
    p = q.problem
    relay, why = g.relay_staging(p.R, p.B, p.B_cap, p.k, p.L, p.H, p.shared)
    assert relay == q.returns.relay and why in "\n".join(q.reasons), (b, why)
    if p.B * p.k < 32 * p.L:
      assert not relay and why == "returns are not batched"
  at_256 = g.relay_staging(8, 256, 256, g.MODELS[model].k, g.MODELS[model].E // 8, g.MODELS[model].H, shared)[0]
  assert at_256 == (model == "glm5.2" or shared)


def test_wait_bounds_are_milliseconds_within_half_an_hour(monkeypatch):
  """GCMOE_WAIT_TIMEOUT_MS and GCMOE_FIRST_WAIT_TIMEOUT_MS: role 2's pipeline waits count the bound in 1024 ns units
  in 32 bits, so a bound past 30 minutes is refused, naming the variable, instead of wrapping."""
  from gcmoe_jax import _config
  for name, default in (("GCMOE_WAIT_TIMEOUT_MS", 2000), ("GCMOE_FIRST_WAIT_TIMEOUT_MS", 120_000)):
    monkeypatch.delenv(name, raising=False)
    assert _config.get(name) == default
    monkeypatch.setenv(name, "1800000")
    assert _config.get(name) == 1_800_000
    for bad in ("1800001", "-1", "ten"):
      monkeypatch.setenv(name, bad)
      with pytest.raises(ValueError, match=f"{name} must be a number of milliseconds, got '{bad}'"):
        _config.get(name)
