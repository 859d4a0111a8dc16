"""Compile-only tests of the v1 role kernels and their build (no GPU): PTX ABI, bounded waits, manifest, cache.

Compiling needs CuTe DSL (``nvidia-cutlass-dsl``); those tests skip with the import error when it is missing. One
module-scoped cache directory holds every build, so each (arch, variant) compiles once.
"""

import dataclasses
import json
import pathlib
import re
import sys

import pytest

from gcmoe_jax.__main__ import main as cli_main
from gcmoe_jax.kernels import abi, build
from gcmoe_jax.kernels.build import BuildError, Variant

try:
  import cutlass  # noqa: F401

  _NO_DSL = None
except ImportError as e:  # pragma: no cover - depends on the environment
  _NO_DSL = f"CuTe DSL is not importable: {e}"

needs_dsl = pytest.mark.skipif(_NO_DSL is not None, reason=_NO_DSL or "")

SMALL = Variant(hidden=512, intermediate=256, experts=8, top_k=4, capacity=16)
SMALL_SHARED = Variant(512, 256, 8, 4, 16, shared_intermediate=256, shared_group=32)
WIDE_SHARED = Variant(512, 256, 8, 4, 256, shared_intermediate=256, shared_group=32)  # one CTA per SM, 8-tile passes
ROLE_ENTRIES = ("gcmoe_role1_dispatch_v1", f"gcmoe_role2_compute_{build.generation()}", "gcmoe_role3_finalize_v1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("cubins")


@pytest.fixture(scope="module")
def built(cache):
  """arch -> manifest of the small variant (compiled once per module)."""
  if _NO_DSL is not None:
    pytest.skip(_NO_DSL)
  return {arch: build.compile_variant(arch, SMALL, cache_dir=cache) for arch in build.ARCHS}


def _ptx(meta, role):
  return (pathlib.Path(meta["directory"]) / meta["roles"][role - 1]["ptx"]).read_text()


# ---------------------------------------------------------------------------------------------------------------
# Compilation and the PTX ABI
# ---------------------------------------------------------------------------------------------------------------


@needs_dsl
@pytest.mark.parametrize("arch", build.ARCHS)
@pytest.mark.parametrize("role", [1, 2, 3])
def test_role_compiles_to_a_cubin(built, arch, role):
  meta = built[arch]
  entry = meta["roles"][role - 1]
  cubin = (pathlib.Path(meta["directory"]) / entry["cubin"]).read_bytes()
  assert cubin[:4] == b"\x7fELF", f"{arch=}, {role=}: not an ELF cubin"
  assert entry["entry"].startswith(ROLE_ENTRIES[role - 1]), f"{arch=}, {role=}: entry {entry['entry']}"
  assert f".target {arch}" in _ptx(meta, role)
  assert entry["block"] == 256, entry
  # No spills, except role 2 of the two-CTA variants at its 128-register cap (build._SPILL_BUDGET); sm_120a's
  # role 2 has an 8 B frame for its by-value TensorMaps without spilling (build._TENSORMAP_FRAME).
  assert entry["spill_bytes"] <= (build._SPILL_BUDGET[2] if entry["ctas_per_sm"] > 1 else 0), entry
  frame = build._TENSORMAP_FRAME if role == 2 and arch != "sm_90a" and build.generation() == "v2" else 0
  assert entry["local_bytes"] <= build.spill_frame(entry["spill_bytes"]) + frame, entry
  # v2's role 2 runs its TMA pipeline in dynamic SMEM (opt-in above 48 KiB; H100/H200 allow 227 KiB per CTA,
  # SM120 99 KiB, 100 KiB per SM shared by the CTAs of an SM).
  v2_role2 = role == 2 and build.generation() == "v2"
  limit = (227 if arch == "sm_90a" else 99) * 1024
  low = 0 if arch != "sm_90a" and entry["ctas_per_sm"] > 1 else 48 * 1024
  assert (low < entry["dynamic_smem"] <= limit) if v2_role2 else entry["dynamic_smem"] == 0, entry
  assert entry["grid"] == (1 if role == 1 else 0)
  assert 0 < entry["registers"] <= 255 and entry["static_smem"] <= 48 * 1024, entry


@needs_dsl
@pytest.mark.parametrize("arch", build.ARCHS)
@pytest.mark.parametrize("role", [1, 2, 3])
def test_ptx_entry_has_the_abi_params(built, arch, role):
  entry = build.parse_ptx_entry(_ptx(built[arch], role))
  types = [p["type"] for p in entry["params"]]
  sizes = [p["bytes"] for p in entry["params"]]
  maps = len(abi.ROLE2_TENSORMAPS) if role == 2 and build.generation() == "v2" else 0
  assert types == [".u64"] * 13 + [".u32", ".f32"] + [".b8"] * maps, f"{arch=}, {role=}: {entry['params']}"
  assert sizes == [8] * 13 + [4, 4] + [128] * maps, f"{arch=}, {role=}: {sizes}"
  assert all(".ptr .global .align 16" in p["decl"] for p in entry["params"][:13]), entry["params"]
  assert all(p["decl"] == ".param .align 128 .b8" for p in entry["params"][15:]), entry["params"]
  assert entry["reqntid"] == [256, 1, 1]
  names = [p["name"] for p in built[arch]["roles"][role - 1]["params"]]
  assert names == list(abi.PARAMS + abi.ROLE2_TENSORMAPS[:maps])


@needs_dsl
@pytest.mark.parametrize("arch", build.ARCHS)
def test_role1_appends_to_the_active_queue_and_role2_reads_it(built, arch):
  """Role 1 takes each queue position by an atomic add and fills the entry and the final size with release stores
  (after ready[e]); role 2 polls the queue's final size with acquire loads instead of every expert's ready[e]."""
  role1, role2 = _ptx(built[arch], 1), _ptx(built[arch], 2)
  assert role1.count("atom.relaxed.gpu.global.add.u32") >= 2, "append (add 1) and close (read the size)"
  assert role1.count("st.release.gpu") >= 3, "ready[e], the queue entry and the final size"
  assert "ld.acquire.gpu" in role2


@needs_dsl
@pytest.mark.parametrize("arch", build.ARCHS)
def test_role2_waits_are_bounded_acquires(built, arch):
  ptx = _ptx(built[arch], 2)
  assert ptx.count("%globaltimer") >= 2, "role 2 must read %globaltimer before and while spinning"
  assert "ld.acquire.gpu" in ptx, "role 2 must poll ready[e] (v1) or the active queue (v2) with acquire loads"
  assert "fence.acq_rel.gpu" in ptx
  assert "atom.global.cas.b32" in ptx, "a timeout records the fault through a CAS on error_flag"
  assert "trap" not in ptx, "a timeout must not trap (the context stays usable)"
  # Every float op of the exact math is inline PTX with an explicit rounding: no contracted FMA. (v2's one FMA,
  # acc + f32(D) * 2**n with the product exact, is its own fma.rn.ftz.)
  assert re.findall(r"\bfma\.[\w.]+", ptx) in ([], ["fma.rn.ftz.f32"] * ptx.count("fma.")), "a contracted FMA"


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
@pytest.mark.parametrize("arch", build.ARCHS)
def test_v2_role2_is_mma_over_its_targets_pipeline(built, arch):
  ptx = _ptx(built[arch], 2)
  two_ctas = built[arch]["roles"][1]["ctas_per_sm"] == 2
  assert two_ctas == (SMALL.capacity <= 16)
  if arch == "sm_90a":
    # Two GEMMs x {fast, exact slow} stage x 4 K32 blocks x, per n-tile of each body, 3 digit planes: 2 MMAs each
    # in the split-decode bodies of 1 and 2 n-tiles, 1 in the bodies of 3, 4, 6 and 8 (absent in two-CTA variants);
    # the one-row and two-row bodies' single MMA pair each (the planes of their rows in one n-tile) and the four-row
    # body's two (planes 0, 1 and plane 2 of four slots). The narrow bodies (1 and 2 n-tiles, one to four rows)
    # compute two stages per CTA barrier in this routed variant, so their stage code is there twice.
    mmas = re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.s32\.s8\.s8\.s32", ptx)
    assert len(mmas) == 2 * 2 * 4 * (2 * (6 * (1 + 2) + 2 + 2 + 4) + 3 * (0 if two_ctas else 3 + 4 + 6 + 8))
  else:
    # The SM120 seam: one block-scaled QMMA per K32 block, the block picked by the byte-id immediate (0-3) of the
    # packed scale words; no int8 MMA, no slow stage.
    assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" not in ptx
    qmmas = re.findall(r"mma\.sync\.aligned\.kind::mxf8f6f4\.block_scale\.scale_vec::1X\.m16n8k32\.row\.col\."
                       r"f32\.e2m1\.e4m3\.f32\.ue8m0 [^;]*?, (%r\d+), \{(\d), 0\}, (%r\d+), \{(\d), 0\};", ptx)
    # At least one per (GEMM, n-tile of each body, K32 block); LLVM may peel the stage loop, so not exactly.
    assert len(qmmas) >= 2 * (3 if two_ctas else 24) * 4 and len(qmmas) % 4 == 0, len(qmmas)
    assert sorted({int(q[1]) for q in qmmas}) == [0, 1, 2, 3] and all(q[1] == q[3] for q in qmmas)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, "activations are stored as E4M3 codes"
  if two_ctas:
    assert ".minnctapersm 2" in ptx and ".maxnreg 128" in ptx, "the §5.1 rewrites of the two-CTA variant"
  # The weight fragments: sm_90a and the compact FP4 path by ldmatrix.b16 on the raw nibbles; SMALL on sm_120a
  # (tile_n 16: not a compact tier) by the expanded path's 4-bit unpack, one shift per register, no prmt.
  expanded = built[arch]["roles"][1]["fp4_weights"] == "expanded"
  assert expanded == (arch != "sm_90a")
  if expanded:
    assert "ldmatrix.sync.aligned.m8n16.x4.shared.b8x16.b4x16_p64" in ptx and "b16" not in re.findall(
      r"ldmatrix\.[\w.]+", ptx)[0] and "prmt.b32" not in ptx
  else:
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
  # Both targets take the two weight TensorMaps by value after the ABI's formals (§5.1 rewrite).
  assert len(re.findall(r"\.param \.align 128 \.b8 \w+_param_1[56]\[128\]", ptx)) == 2
  tma = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
  if arch == "sm_90a":
    # The per-thread cp.async producer (measured faster on the H200); the maps are not loaded.
    assert not tma and "cp.async.cg.shared.global" in ptx and "cvta.param" not in ptx
  else:
    # The TMA producer (paper §4.4): weight tiles by TMA through the maps, the B rows by bulk copies, full/empty
    # mbarriers instead of a CTA barrier per stage.
    assert tma and "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "mbarrier.try_wait.parity.shared::cta.b64" in ptx and "mbarrier.arrive.expect_tx" in ptx
    # The B rows, written by generic stores and acquired by the item's wait, are read through the async proxy.
    assert "fence.proxy.async.global" in ptx
    # Each copy takes its map's address in its own scope (the rewrite's at_use: no register holds it across the MMAs).
    copies = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln]
    assert all(re.search(r"cvta\.param::entry\.u64 %tmap, \w+_param_1[56]; cp\.async\.bulk\.tensor", ln)
               for ln in copies), copies[:2]
    assert {re.search(r"_param_(1[56]);", ln).group(1) for ln in copies} == {"15", "16"}
    assert "cp.async.cg.shared.global" not in ptx
  assert "red.release.gpu.global.add.u32" in ptx, "tile completion is published with release"
  # Work items come from the call's queue: one atomic claim per item, not a fixed round-robin.
  assert "atom.relaxed.gpu.global.add.u32" in ptx, "role 2 claims its items from the queue"


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
@pytest.mark.parametrize("variant", [SMALL, Variant(6144, 2048, 32, 8, 8), Variant(5120, 2304, 48, 6, 256)],
                         ids=["small", "glm5.2", "dsv4.1-flash"])
def test_role2_tensormaps_cover_the_weight_tensors(variant):
  """Each map views its weight tensor (formats: [E][K/128][N][64 B]) as 64-byte rows, a box being one K128 tile of
  128 rows swizzled by 64 B: together the rows are exactly the tensor's bytes, and the manifest carries them."""
  from gcmoe_jax.kernels import roles_v2

  w13, w2 = roles_v2.RoleKernelsV2(variant, "sm_90a").tensormaps()
  assert (w13["name"], w2["name"]) == abi.ROLE2_TENSORMAPS and (w13["param"], w2["param"]) == ("w13", "w2")
  e, h, i = variant.experts, variant.hidden, variant.intermediate
  assert w13["dims"][0] * w13["dims"][1] == e * h * 2 * i // 2 and w2["dims"][0] * w2["dims"][1] == e * i * h // 2
  for m in (w13, w2):
    assert m["dims"][0] == m["row_stride"] == 64 and m["box"] == [64, 128] and m["swizzle"] == 64
    assert m["dims"][1] < 2**31  # TMA coordinates are int32
    assert abi.tensormap_fields(m)[0] == abi.PARAMS.index(m["param"])


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
@pytest.mark.parametrize("variant, compact", [
  (SMALL, False),  # r = 8: tile_n 16
  (Variant(512, 256, 8, 1, 256), True),  # r = 32: tile_n 48
  (Variant(6144, 2048, 32, 8, 64), False),  # GLM5.2 B = 64, r = 16: tile_n 32
  (Variant(6144, 2048, 32, 8, 256), True),  # GLM5.2 B = 256, r = 64: tile_n 80
  (Variant(5120, 2304, 48, 6, 256), True),  # DSV4.1-Flash B = 256, r = 32: tile_n 48
  (Variant(5120, 2304, 48, 6, 64), False),  # r = 8: tile_n 16
], ids=["small", "k1-t256", "glm-t64", "glm-t256", "dsv-t256", "dsv-t64"])
def test_sm120_fp4_path_follows_the_geometry_tiers(variant, compact):
  """The sm_120a seam stages compact FP4 weights exactly where `geometry.plan` does (tile_n in {48, 80, 96} at
  B = capacity, paper §4.3-4.4) and expanded ones elsewhere: the expanded maps are 16U4_ALIGN16B views of the same
  rows (128 codes each, box[0] 128, 128-byte swizzle) and a stage holds a 16 KiB tile; sm_90a is always compact."""
  from gcmoe_jax import geometry
  from gcmoe_jax.kernels import roles_v2

  k = roles_v2.RoleKernelsV2(variant, "sm_120a")
  plan = geometry.plan(geometry.Problem(R=1, E=variant.experts, k=variant.top_k, B=variant.capacity,
                                        H=variant.hidden, I=variant.intermediate), device=geometry.RTX_PRO_5000)
  assert k.compact == compact == plan.tile.compact_weights and k.tile_n == plan.tile.tile_n
  assert roles_v2.RoleKernelsV2(variant, "sm_90a").compact
  w13, w2 = k.tensormaps()
  compact_maps = roles_v2.RoleKernelsV2(variant, "sm_90a").tensormaps()
  for m, c in zip((w13, w2), compact_maps):
    if compact:
      assert m == c
    else:
      assert m["dtype"] == "u4x16_align16" and m["dims"] == [128, c["dims"][1]] and m["box"] == [128, 128]
      assert m["swizzle"] == 128 and m["row_stride"] == 64 and abi.tensormap_fields(m)[1] == 14
  assert k.w_bytes == (roles_v2.W_BYTES if compact else 2 * roles_v2.W_BYTES)
  assert k.pipe_bytes >= 2 * roles_v2.stage_bytes(k.nt_max, k.token_stride, k.w_bytes)


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_manifest_carries_role2s_tensormaps(built):
  for meta in built.values():
    r2 = meta["roles"][1]
    assert [m["name"] for m in r2["tensormaps"]] == list(abi.ROLE2_TENSORMAPS)
    assert [p["name"] for p in r2["params"][-2:]] == list(abi.ROLE2_TENSORMAPS)
    assert [p["bytes"] for p in r2["params"][-2:]] == [128, 128]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_tma_ablation_builds_sm120s_producer_for_sm90(cache, monkeypatch):
  """``GCMOE_ABLATION=tma`` (exact results, A/B timing) puts the sm_120a build's TMA producer into the sm_90a role 2,
  validated with the TMA pipeline's features (§5.1), under its own cubin key."""
  monkeypatch.setenv("GCMOE_ABLATION", "tma")
  meta = build.compile_variant("sm_90a", SMALL, cache_dir=cache)
  assert "+tma" in meta["key"]
  ptx = _ptx(meta, 2)
  assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait.parity" in ptx and "fence.proxy.async.global" in ptx
  assert "cp.async.cg.shared.global" not in ptx
  assert meta["roles"][1]["spill_bytes"] <= build._SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.parametrize("arch", build.ARCHS)
def test_role1_publishes_with_release_and_role3_advances_the_epoch(built, arch):
  r1, r3 = _ptx(built[arch], 1), _ptx(built[arch], 3)
  assert "st.release.gpu" in r1 and "atom.global.cas.b32" in r1
  # Role 3 stores header.epoch (workspace offset 0) after a barrier.
  assert "bar.sync" in r3 and re.search(r"st\.global\.b32\s+\[%rd\d+\]", r3), r3[-2000:]
  # It sums 8 columns per thread with 16-byte accesses (one CTA per token took 15.5 us at H = 6144 with 2-byte ones),
  # in v2 through L2 only: role 2 writes the rows while role 3 runs beside it (abi.FINALIZE_EARLY_TOKENS).
  rows = "ld.global.cg.v4.u32" if build.generation() == "v2" else "ld.global.nc.v4.u32"
  assert rows in r3 and "st.global.v4.u32" in r3 and "ld.global.nc.u16" not in r3
  if build.generation() == "v2":
    # Beside role 2 it waits (bounded, through faults) for role 2's CTAs: a polling loop with nanosleep.
    assert "nanosleep.u32" in r3 and "globaltimer" in r3


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
@pytest.mark.parametrize("arch", build.ARCHS)
def test_role2_alone_has_its_combining_ctas_branch_off_at_the_start(built, arch):
  """Up to `abi.scan_tokens` tokens the graph holds role 2 alone (`abi.TOKENS_SOLO` in its ``tokens``): its last
  CTAs do role 3's work. In the PTX: the bit's test, the combining path's bounded waits (nanosleep, globaltimer),
  its 16-byte row loads through L2 and its y stores; and the sizes of that path (`abi.solo_ctas`,
  `abi.scan_tokens`)."""
  r2 = _ptx(built[arch], 2)
  assert re.search(rf"setp\.gt\.s32\s+%p\d+, %r\d+, {abi.TOKENS_SOLO - 1};", r2) or \
    re.search(rf"setp\.ge\.s32\s+%p\d+, %r\d+, {abi.TOKENS_SOLO};", r2), "the TOKENS_SOLO test of T"
  # A combining CTA loads the k rows of its block through L2 (16 B a thread: the item CTAs wrote them during the
  # kernel) and stores y 16 B a thread; the item path has neither.
  assert r2.count("ld.global.cg.v4.u32") == SMALL.top_k and "st.global.v4.u32" in r2
  assert "nanosleep.u32" in r2 and "globaltimer" in r2
  assert abi.solo_ctas(6144, 1) == 3 and abi.solo_ctas(5120, 4) == 12 and abi.solo_ctas(512, 0) == 1
  assert abi.COMBINE_COLS == 8 * 256 and abi.scan_tokens(8, 8) == 8 and abi.scan_tokens(16, 16) == 4
  assert abi.scan_tokens(6, 2) == 2 and abi.scan_tokens(8, 8, ranks=2) == 0


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
@pytest.mark.parametrize("arch", build.ARCHS)
def test_finalize_occupancy_directive_follows_the_geometry(built, arch):
  """§5.1 "finalize occupancy": on SM120 role 3's .minnctapersm is the CTAs per SM the geometry plans its grid with;
  Hopper keeps CuTe's directive."""
  meta = built[arch]
  want = build._finalize_ctas(arch, SMALL)
  assert meta["roles"][2]["minnctapersm"] == want and (want > 1) == arch.startswith("sm_12")
  directives = re.findall(r"^\.minnctapersm (\d+)$", _ptx(meta, 3), re.M)
  assert directives in ([str(want)], [] if want == 1 else [str(want)]), directives


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
@pytest.mark.parametrize("variant", [SMALL, SMALL_SHARED], ids=["routed", "shared"])
def test_sm120_role2_fits_the_rtx_pro_5000_smem(cache, variant):
  """The sm_120a role 2 sizes its pipeline for SM120's 99 KB per CTA / 100 KB per SM at its CTAs per SM."""
  from gcmoe_jax import geometry

  meta = build.compile_variant("sm_120a", variant, cache_dir=cache)
  r2 = meta["roles"][1]
  smem = r2["dynamic_smem"] + r2["static_smem"]
  assert geometry.ctas_per_sm(smem, 256, geometry.RTX_PRO_5000) >= r2["ctas_per_sm"] >= 1, (smem, r2["ctas_per_sm"])
  assert all(r["spill_bytes"] == 0 for r in meta["roles"] if r["ctas_per_sm"] == 1)


@needs_dsl
def test_shared_expert_variant_compiles(cache):
  meta = build.compile_variant("sm_90a", SMALL_SHARED, cache_dir=cache)
  assert meta["variant"]["shared_group"] == 32
  # Capacity 16: two CTAs per SM, like the routed-only decode variants (role 2 within the two-CTA spill budget).
  roles = {r["role"]: r for r in meta["roles"]}
  assert roles[2]["ctas_per_sm"] == 2 and roles[2]["spill_bytes"] <= build._SPILL_BUDGET[2]
  assert all(roles[r]["local_bytes"] == 0 and roles[r]["spill_bytes"] == 0 for r in (1, 3))
  ptx = _ptx(meta, 2)
  assert "min.NaN.f32" in ptx  # SwiGLU
  # The shared items' digit table (filled by an FMA that keeps subnormals) and their cp.async double buffer.
  assert re.search(r"fma\.rn\.f32\s", ptx) and "cp.async.ca.shared.global" in ptx
  # Since the shared expert left v1's SIMT math these variants take their items from the queue too.
  assert "atom.relaxed.gpu.global.add.u32" in ptx


# ---------------------------------------------------------------------------------------------------------------
# Manifest, cache and loading
# ---------------------------------------------------------------------------------------------------------------


@needs_dsl
def test_manifest_round_trips(built, cache, monkeypatch):
  meta = built["sm_90a"]
  on_disk = json.loads((pathlib.Path(meta["directory"]) / "meta.json").read_text())
  assert {k: v for k, v in meta.items() if k != "directory"} == on_disk
  assert on_disk["key"] == build.cache_key("sm_90a", SMALL) == pathlib.Path(meta["directory"]).name
  assert on_disk["source_sha256"] == build.source_sha256()
  assert on_disk["cutlass_dsl"] == build.dsl_versions() and "nvidia-cutlass-dsl" in on_disk["cutlass_dsl"]
  assert Variant(**on_disk["variant"]) == SMALL
  assert on_disk["workspace"]["total"] == SMALL.workspace().total
  again = build.compile_variant("sm_90a", SMALL, cache_dir=cache)  # a cache hit: nothing recompiled
  assert again == meta
  monkeypatch.setenv(build.CUBIN_DIR_ENV, str(cache))
  loaded = build.load_or_build("sm_90a", SMALL)
  assert loaded.meta == on_disk
  assert loaded.launch(1) == (1, 256, 0) and loaded.launch(2) == (0, 256, on_disk["roles"][1]["dynamic_smem"])
  assert loaded.cubin(2)[:4] == b"\x7fELF"
  assert len([p for p in cache.iterdir() if p.name.startswith(".")]) == 0, "no temporary build left behind"


def test_the_report_names_the_fused_variants_ranks_and_return_path():
  """`--report` rows tell the one-rank, fused direct and fused relay builds of one shape apart."""
  from gcmoe_jax.commands import build_kernels

  def summary(ranks, relay):
    v = dataclasses.asdict(Variant(512, 256, 4, 4, 16, ranks=ranks, relay=relay))
    return {"variant": v, "arch": "sm_90a", "key": f"k{ranks}{relay}", "registers": [64, 128, 40],
            "dynamic_smem": [0, 100352, 0], "static_smem": [0, 1024, 0], "local_bytes": [0, 16, 0],
            "spill_bytes": [0, 12, 0], "ctas_per_sm": [2, 2, 1], "fp4_weights": "compact"}

  rows = build_kernels._report_rows([summary(1, False), summary(2, False), summary(2, True)])
  names = [r.split(" | ")[0] for r in rows[2:]]
  assert names == ["| H512 I256 E4 k4 T16", "| H512 I256 E4 k4 T16, R 2", "| H512 I256 E4 k4 T16, R 2 relay"], names


@needs_dsl
def test_cli_builds_into_out(built, cache, capsys, tmp_path):
  report = tmp_path / "table.md"
  status = cli_main(["build-kernels", "--arch", ",".join(build.ARCHS), "--out", str(cache), "--variant",
                     "512,256,8,4,16", "--report", str(report)])
  out = capsys.readouterr().out
  assert status == 0, out
  assert build.cache_key("sm_120a", SMALL) in out and f"{len(build.ARCHS)} builds" in out
  index = json.loads((cache / "index.json").read_text())
  assert {e["key"] for e in index} >= {build.cache_key(a, SMALL) for a in build.ARCHS}
  rows = report.read_text().splitlines()
  assert len(rows) == 2 + len(build.ARCHS) and rows[0].startswith("| variant | arch | registers")
  sm120 = next(r for r in rows if "| sm_120a |" in r)
  assert "| H512 I256 E8 k4 T16 |" in sm120 and "| 2 | expanded (16) | yes |" in sm120, sm120
  sm90 = next(r for r in rows if "| sm_90a |" in r)
  assert sm120.endswith((" | yes |", " B) |")) and sm90.endswith("| compact | - | - | - |"), (sm120, sm90)


@needs_dsl
def test_cli_builds_in_worker_processes(tmp_path, capsys):
  """--jobs 2: two variants compiled at once in spawned workers, each landing whole under its key."""
  status = cli_main(["build-kernels", "--out", str(tmp_path), "--jobs", "2", "--json", "--variant", "512,256,8,1,8",
                     "--variant", "512,256,8,8,8"])
  report = json.loads(capsys.readouterr().out)
  assert status == 0 and len(report["builds"]) == 2, report
  for b in report["builds"]:
    meta = json.loads((tmp_path / b["key"] / "meta.json").read_text())
    assert meta["key"] == b["key"] and b["ctas_per_sm"][1] == meta["roles"][1]["ctas_per_sm"]
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary build was left behind"
  assert cli_main(["build-kernels", "--out", str(tmp_path), "--jobs", "-1", "--variant", "512,256,8,1,8"]) == 2


def test_cubin_dir_missing_key_names_it_and_lists_what_is_present(tmp_path, monkeypatch):
  (tmp_path / "h512_i256_e8_k4_t16-sm_90a-000000000000").mkdir()
  (tmp_path / "h512_i256_e8_k4_t16-sm_90a-000000000000" / "meta.json").write_text("{}")
  monkeypatch.setenv(build.CUBIN_DIR_ENV, str(tmp_path))
  key = build.cache_key("sm_120a", SMALL)
  with pytest.raises(BuildError, match=re.escape(key)) as info:
    build.load_or_build("sm_120a", SMALL)
  msg = str(info.value)
  assert "h512_i256_e8_k4_t16-sm_90a-000000000000" in msg and "build-kernels" in msg, msg
  assert "--variant 512,256,8,4,16" in msg


def test_without_dsl_the_error_says_how_to_build(tmp_path, monkeypatch):
  monkeypatch.delenv(build.CUBIN_DIR_ENV, raising=False)
  monkeypatch.setitem(sys.modules, "cutlass", None)  # `import cutlass` raises ImportError
  with pytest.raises(BuildError, match="python -m gcmoe_jax build-kernels --arch sm_90a") as info:
    build.load_or_build("sm_90a", SMALL, cache_dir=tmp_path)
  assert build.CUBIN_DIR_ENV in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Variants and PTX parsing (no DSL needed)
# ---------------------------------------------------------------------------------------------------------------


def test_variant_parse_and_key():
  assert Variant.parse("512,256,8,4,16") == SMALL
  v = Variant.parse("6144,2048,32,8,64,2048,128")
  assert v.key == "h6144_i2048_e32_k8_t64_s2048g128" and v.shared
  fused = Variant.parse("512,256,4,4,16,r2")
  assert fused.ranks == 2 and fused.key == "h512_i256_e4_k4_t16_r2" and not fused.shared
  assert Variant.parse("512,256,4,4,16,256,128,r4").key == "h512_i256_e4_k4_t16_s256g128_r4"
  relay = Variant.parse("512,256,4,4,16,r2relay")
  assert relay.relay and relay.ranks == 2 and relay.key == "h512_i256_e4_k4_t16_r2relay"


def test_fused_workspace_holds_every_ranks_rows_and_leaves_the_local_layout_alone():
  """R > 1 sizes the receive side for R C tokens and adds the transport's sections after every local one, so a
  local (R = 1) variant's offsets are unchanged."""
  local = Variant(512, 256, 4, 4, 16).workspace("v2")
  fused = Variant(512, 256, 4, 4, 16, ranks=2).workspace("v2")
  assert Variant(512, 256, 4, 4, 16, ranks=1).workspace("v2") == local
  assert local.pub_ids == local.rxplanes == local.grw == local.g1tags  # empty sections at the end
  # Then each routed GEMM1 item's tag (one GPU: read by GCMOE_ABLATION=kbany), none with the fused transport.
  assert local.total - local.g1tags >= 8 * 4 * (2 * 256 // 128) and fused.g1tags == fused.total
  assert fused.arena - fused.rows == 2 * (local.arena - local.rows)  # rows[e] holds R C k assignments
  assert fused.aexp - fused.aplanes == 2 * (local.aexp - local.aplanes)
  assert fused.rxexp - fused.rxplanes == 2 * 16 * (512 // 32) * abi.PLANES * 32
  assert fused.pub_rw - fused.pub_ids >= 2 * 16 * 4 * 4  # both parities
  # The fused counters (experts published, rows returned), and after the active queue role 1's arrivals and row
  # claims per expert.
  assert abi.counter_words(4, 16, False, 2) == abi.counter_words(4, 16, False) + 2 + 2 * 4
  assert abi.fused_counters(4, 16, False) == (5, 6)
  assert abi.HEADER["peers"] + 8 * abi.MAX_RANKS <= abi.HEADER_BYTES
  # The packed routes: a tag byte per global assignment; the direct scan's gate: the epoch and every rank's T.
  assert fused.rgate - fused.rtags >= 2 * 16 * 4 and fused.relay_arena - fused.rgate >= 4 * (1 + 2)
  assert local.rtags == local.rgate == local.xq == local.g1tags
  assert fused.relay_arena - fused.xq >= 16 * 512  # the pull engine's source: a row of E4M3 codes per token
  # Without the pull cache (k < R) every route gets its own received row; the relay path parks R C k rows.
  no_cache = Variant(512, 256, 4, 1, 16, ranks=2).workspace("v2")
  assert no_cache.rxexp - no_cache.rxplanes == fused.rxexp - fused.rxplanes  # k = 1: one row per route = per token
  k8 = Variant(512, 256, 4, 8, 16, ranks=16).workspace("v2")
  assert not abi.pull_cache(8, 16) and k8.rxexp - k8.rxplanes == 16 * 16 * 8 * (512 // 32) * abi.PLANES * 32
  relay = Variant(512, 256, 4, 4, 16, ranks=2, relay=True).workspace("v2")
  assert relay.total - relay.relay_arena >= 2 * 16 * 2 * 4 * 512 and fused.relay_arena == fused.total
  assert abi.counter_words(4, 16, False, 2, True) == abi.counter_words(4, 16, False, 2) + 4
  # Role 2's item queue, then role 1's active queue of experts (append position, final size, E entries), after
  # every other counter but the arrivals and, last, role 2's CTAs done and role 3's CTAs in (role 3 zeroes all).
  for args in ((4, 16, False), (4, 16, True), (4, 16, False, 2), (4, 16, True, 2, True)):
    assert abi.active_queue(*args) == abi.queue_counter(*args) + 1
    fused = len(args) > 3
    assert abi.role2_done(*args) == abi.active_queue(*args) + 2 + args[0] + (2 * args[0] if fused else 0)
    assert abi.counter_words(*args) == abi.role2_done(*args) + 2
    if fused:
      assert abi.arrivals(*args[:3], *args[4:]) == abi.active_queue(*args) + 2 + args[0]
  assert abi.queue_counter(4, 16, False, 2, True) > abi.relay_counters(4, 16, False) + 4 - 1
  assert abi.queue_counter(4, 16, False, 2) > max(abi.fused_counters(4, 16, False))


@needs_dsl
def test_fused_roles_synchronise_at_system_scope(cache):
  """The fused variant's role 1 waits for the peers' publications and role 2 returns rows and counts them at
  system scope (a peer may be another GPU); the local variant's role 2 has no system-scope access but the fault
  record's copy into the pinned host mirror (its combining CTA 0 where role 2 runs alone, as role 3 does)."""
  meta = build.compile_variant("sm_90a", Variant(512, 256, 4, 4, 16, ranks=2), cache_dir=cache)
  role1, role2, role3 = (_ptx(meta, r) for r in (1, 2, 3))
  assert "gcmoe_role1_dispatch_fused" in role1 and "ld.acquire.sys" in role1 and "ld.global.cg.u32" in role1
  # Expert-granular publish: the arrivals' acq_rel adds (the completing one publishes), no CTA counting itself done
  # for a grid-wide wait.
  assert "atom.acq_rel.gpu.global.add.u32" in role1 and "red.release.gpu.global.add" not in role1
  assert "st.release.sys" in role2 and "red.release.sys" in role2
  assert "ld.acquire.sys" in role3
  local = build.compile_variant("sm_90a", SMALL, cache_dir=cache)
  system = [line.split()[0] for line in _ptx(local, 2).splitlines() if ".sys" in line]
  assert sorted(system) == ["st.relaxed.sys.global.b32"] * (len(abi.MIRROR_WORDS) - 1) + [
    "st.release.sys.global.b32"], system


@needs_dsl
def test_the_fused_shared_expert_variant_builds_within_its_spill_budget(cache):
  """`--preset fused`'s variant with a shared expert (tests/test_fused.py's `test_shared_expert_on_virtual_ranks`)
  builds: its role 2 carries the transport's and the shared expert's state at the two-CTA cap and spills more than
  the local variants may (`build._FUSED_SHARED_SPILL_BUDGET`, where the preset's build stopped before session 48),
  none of it in a stage loop (docs/probes/sass_loops.py)."""
  meta = build.compile_variant("sm_90a", Variant(512, 256, 4, 4, 16, 256, 128, ranks=2), cache_dir=cache)
  role2 = meta["roles"][1]
  assert role2["ctas_per_sm"] == 2
  assert role2["spill_bytes"] <= build._FUSED_SHARED_SPILL_BUDGET[2]


@needs_dsl
def test_fused_role1_pulls_rows_in_batches_over_several_ctas_per_sm(cache):
  """Where the pull engine does not apply (H = 640: its H / 32 scale bytes are no multiple of 16 B), role 1 of the
  fused transport issues a lane's 16-byte peer loads of a row before their stores (the register-batched pull path;
  a row of H = 640 is 4 chunks per lane, all in flight) and is built for `ROLE1_FUSED_CTAS_PER_SM` CTAs per dispatch
  SM; the local variant's role 1 keeps one."""
  from gcmoe_jax.kernels import roles_v2

  meta = build.compile_variant("sm_90a", Variant(640, 256, 4, 4, 16, ranks=2), cache_dir=cache)
  ptx = _ptx(meta, 1)
  run = best = 0
  for line in ptx.splitlines():
    if "ld.global.cg.v4" in line:
      run += 1
      best = max(best, run)
    elif "st.global.v4" in line:
      run = 0
  assert best >= 4, f"at most {best} 16-byte peer loads in flight before a store"
  assert "cp.async.bulk" not in ptx
  assert f".minnctapersm {roles_v2.ROLE1_FUSED_CTAS_PER_SM}" in ptx
  role1 = meta["roles"][0]
  assert role1["ctas_per_sm"] == roles_v2.ROLE1_FUSED_CTAS_PER_SM and role1["spill_bytes"] == 0
  built = build.BuiltVariant(pathlib.Path(meta["directory"]), meta)
  assert built.dispatch_grid(8) == 8 * roles_v2.ROLE1_FUSED_CTAS_PER_SM
  local = build.compile_variant("sm_90a", SMALL, cache_dir=cache)
  assert local["roles"][0]["ctas_per_sm"] == 1


@needs_dsl
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_fused_role1_pull_engine_posts_bulk_copies_into_two_slots_per_warp(cache, arch):
  """The pull engine (paper §4.5): lane 0 posts a row's E4M3 codes and scale bytes as two bulk copies completing on
  its slot's mbarrier, two slots per warp (16 slots of H + H / 32 bytes after the 1 KB decode table); phase 0
  writes the codes (``xq``). The GLM5.2 shape's slots fit two CTAs per SM on Hopper (101 KB each) and one on
  SM120's 100 KB; no spills."""
  from gcmoe_jax.kernels import roles_v2

  meta = build.compile_variant(arch, Variant(512, 256, 4, 4, 16, ranks=2), cache_dir=cache)
  role1 = _ptx(meta, 1)
  assert role1.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == 2
  assert "fence.proxy.async.global" in role1
  # Bounded waits (a first try_wait, then the loop's): the drain inside the pull loop, the one after it, and one
  # per slot at the end for a copy still landing after an expired wait, so no CTA leaves one in flight.
  assert role1.count("mbarrier.try_wait.parity") == 2 * (2 + roles_v2.PULL_SLOTS)
  r1 = meta["roles"][0]
  assert r1["spill_bytes"] == 0 and r1["ctas_per_sm"] == roles_v2.ROLE1_FUSED_CTAS_PER_SM
  kernels = roles_v2.RoleKernelsV2(Variant(512, 256, 4, 4, 16, ranks=2), arch)
  assert kernels.engine and r1["dynamic_smem"] == kernels.slots + 16 * (512 + 16) and kernels.slots % 1024 == 0
  glm = roles_v2.RoleKernelsV2(Variant(6144, 2048, 32, 8, 16, ranks=2), arch)
  dsv = roles_v2.RoleKernelsV2(Variant(5120, 2304, 48, 6, 16, ranks=2), arch)
  if arch == "sm_90a":
    assert glm.engine and glm.role1_smem > 100 * 1024 and glm.ctas_per_sm(1) == 2 and dsv.ctas_per_sm(1) == 2
  else:  # 16 slots of H + H / 32 bytes: DSV4.1-Flash's fit one CTA, GLM5.2's (101 KB) do not fit SM120's 99 KB
    assert dsv.engine and dsv.ctas_per_sm(1) == 1 and not glm.engine and glm.ctas_per_sm(1) == 2
  assert not roles_v2.RoleKernelsV2(Variant(640, 256, 4, 4, 16, ranks=2), arch).engine


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_static_ablation_builds_the_round_robin(cache, monkeypatch):
  """GCMOE_ABLATION=static (A/B timing of the item queue) hands items out round-robin: no claim in role 2."""
  monkeypatch.setenv("GCMOE_ABLATION", "static")
  meta = build.compile_variant("sm_90a", SMALL, cache_dir=cache)
  assert "+static-" in meta["key"]
  assert "atom.relaxed.gpu.global.add.u32" not in _ptx(meta, 2)


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_a_shared_expert_of_an_odd_number_of_k128_tiles_compiles(cache):
  """Is = 384: the shared GEMM2's last K step holds one K128 tile, so half its block slots are skipped (the case
  no paper shape has; it once failed to trace)."""
  meta = build.compile_variant("sm_90a", dataclasses.replace(SMALL_SHARED, shared_intermediate=384), cache_dir=cache)
  assert meta["variant"]["shared_intermediate"] == 384
  assert all(r["spill_bytes"] <= build._SPILL_BUDGET.get(r["role"], 0) for r in meta["roles"])


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_twoplane_ablation_has_four_mmas_per_block_in_wide_passes(cache, monkeypatch):
  """GCMOE_ABLATION=twoplane (timing only: the instruction mix of two FP16 digit planes, docs/kernels_v2.md) gives
  the passes of more than two n-tiles 4 int8 MMAs per block instead of 3 and one FMA instead of the magic-number
  conversions, under its own key; the capacity-256 shared-expert variant has 8-tile passes (at most a stack slot
  spilled in the role 2 of 255 registers: 8 B since session 23, 12 B beside session 60's BF16 wide passes; the
  normal build, whose wide passes run on BF16 wgmma since then with the int8 bodies kept for the fallbacks, at most
  `build._BF16_ONE_CTA_SPILL_BUDGET`, the `int8wide` one none)."""
  normal = build.compile_variant("sm_90a", WIDE_SHARED, cache_dir=cache)
  monkeypatch.setenv("GCMOE_ABLATION", "twoplane")
  meta = build.compile_variant("sm_90a", WIDE_SHARED, cache_dir=cache)
  assert "+twoplane-" in meta["key"]
  mmas = [_ptx(m, 2).count("mma.sync.aligned.m16n8k32") for m in (normal, meta)]
  assert mmas[1] > mmas[0], mmas
  assert normal["roles"][1]["spill_bytes"] <= build._BF16_ONE_CTA_SPILL_BUDGET[2]
  assert normal["roles"][0]["spill_bytes"] == normal["roles"][2]["spill_bytes"] == 0
  assert meta["roles"][1]["spill_bytes"] <= build._BF16_ONE_CTA_SPILL_BUDGET[2]
  assert meta["roles"][0]["spill_bytes"] == meta["roles"][2]["spill_bytes"] == 0


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_wide_passes_build_on_bf16_wgmma_unless_int8wide(cache, monkeypatch):
  """Role 2's passes of more than two n-tiles run on BF16 wgmma by default (`abi.bf16_passes`; the §5.1 validation
  requires it, `ptx.WGMMA_BF16`), their workspace holding the BF16 planes; ``GCMOE_ABLATION=int8wide`` builds the
  int8 bodies alone, without wgmma, spills or planes."""
  from gcmoe_jax.kernels import ptx
  normal = build.compile_variant("sm_90a", WIDE_SHARED, cache_dir=cache)
  monkeypatch.setenv("GCMOE_ABLATION", "int8wide")
  int8 = build.compile_variant("sm_90a", WIDE_SHARED, cache_dir=cache)
  assert "+int8wide-" in int8["key"]
  assert ptx.WGMMA_BF16 in _ptx(normal, 2) and "wgmma" not in _ptx(int8, 2)
  ws, ws_int8 = normal["workspace"], int8["workspace"]
  assert ws["total"] > ws["xbf"] and ws_int8["total"] == ws_int8["xbf"]
  assert all(r["spill_bytes"] == 0 for r in int8["roles"])


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_shared_experts_groups_build_on_bf16_wgmma_under_shbf16(cache, monkeypatch):
  """``GCMOE_ABLATION=shbf16`` (`abi.shared_bf16`): the shared expert's groups of 8 tokens (two CTAs per SM) on
  wgmma m64n8k16 and of 16 (one) on m64n16k16, which no routed pass uses (theirs are wider than 2 n-tiles), the
  workspace holding ``xbf`` (also where no routed pass is wide), ``sabf`` and ``saflag``; none of it by default."""
  narrow = build.compile_variant("sm_90a", SMALL_SHARED, cache_dir=cache)
  wide = build.compile_variant("sm_90a", WIDE_SHARED, cache_dir=cache)
  monkeypatch.setenv("GCMOE_ABLATION", "shbf16")
  narrow_bf, wide_bf = (build.compile_variant("sm_90a", v, cache_dir=cache) for v in (SMALL_SHARED, WIDE_SHARED))
  assert "+shbf16-" in narrow_bf["key"]
  n8, n16 = ("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16",
             "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16")
  assert n8 in _ptx(narrow_bf, 2) and "wgmma" not in _ptx(narrow, 2)
  assert n16 in _ptx(wide_bf, 2) and n16 not in _ptx(wide, 2)
  for meta, v in ((narrow_bf, SMALL_SHARED), (wide_bf, WIDE_SHARED)):
    ws = meta["workspace"]
    assert ws["sabf"] - ws["xbf"] >= 2 * v.capacity * v.hidden, ws
    assert ws["saflag"] - ws["sabf"] >= 2 * v.capacity * v.shared_intermediate, ws
    assert ws["total"] - ws["saflag"] >= 4 * v.capacity, ws
  assert narrow["workspace"]["total"] == narrow["workspace"]["xbf"]
  assert wide["workspace"]["total"] == wide["workspace"]["sabf"]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_narrow_passes_of_routed_variants_meet_at_a_barrier_every_two_stages(built, cache, monkeypatch):
  """The one-rank variants' narrow passes, with or without the shared expert, wait for two K128 stages per CTA
  barrier (`cp.async.wait_group` two stages lower than with a barrier per stage, `GCMOE_ABLATION=stagebar`)."""
  def waits(meta):
    return {int(n) for n in re.findall(r"cp\.async\.wait_group (\d+);", _ptx(meta, 2))} - {0}

  shared = build.compile_variant("sm_90a", SMALL_SHARED, cache_dir=cache)
  monkeypatch.setenv("GCMOE_ABLATION", "stagebar")
  per_stage = build.compile_variant("sm_90a", SMALL, cache_dir=cache)
  shared_per_stage = build.compile_variant("sm_90a", SMALL_SHARED, cache_dir=cache)
  assert "+stagebar-" in per_stage["key"]
  paired, single = waits(built["sm_90a"]), waits(per_stage)
  assert single and paired == {n - 2 for n in single}, (paired, single)  # SMALL has narrow passes only
  # The shared items' own double buffer waits with `wait_group 1` in both builds.
  assert waits(shared) - {1} == {n - 2 for n in waits(shared_per_stage) - {1}} != set()


def _role2_only_ablation(ablation, cache, monkeypatch, variant=SMALL_SHARED):
  """``variant`` built normally and with ``GCMOE_ABLATION=ablation``: its own key, roles 1 and 3 unchanged."""
  normal = build.compile_variant("sm_90a", variant, cache_dir=cache)
  monkeypatch.setenv("GCMOE_ABLATION", ablation)
  ablated = build.compile_variant("sm_90a", variant, cache_dir=cache)
  assert f"+{ablation}-" in ablated["key"] and ablated["key"] != normal["key"]
  for role in (1, 3):
    assert _ptx(ablated, role) == _ptx(normal, role)
  return normal, ablated


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_kpair_build_hands_gemm2_blocks_between_warp_pairs(cache, monkeypatch):
  """GCMOE_ABLATION=kpair (GEMM2 items of 64 rows with K split between warps w and w + 4 at up to two tokens,
  routed variants, docs/kernels_v2.md "Item balance"): its own key, roles 1 and 3 as they are, and in role 2 the
  16-byte SMEM stores of warps 4-7's block contributions and the loads of warps 0-3 that add them, which the normal
  build has none of."""
  normal, kpair = _role2_only_ablation("kpair", cache, monkeypatch, SMALL)
  a, b = _ptx(normal, 2), _ptx(kpair, 2)
  for op in ("st.shared.v4.u32", "ld.shared.v4.u32"):
    assert op not in a and op in b, op
  assert kpair["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_l2ahead_build_prefetches_gemm2_weights_and_streams_weights_evict_first(cache, monkeypatch):
  """GCMOE_ABLATION=l2ahead (GEMM2 weights into L2 ahead of their items at up to two tokens, routed variants of up
  to 8 tokens, docs/kernels_v2.md "GEMM2 weights into L2 ahead"): its own key, roles 1 and 3 as they are; in role 2
  the bulk L2 prefetches (two per K128 tile of W2, its tile and its scale words, for a GEMM1 item's and a GEMM2 item's
  target) and every weight-tile copy marked evict-first, with the MMAs unchanged in number; a variant of 16 tokens
  builds no prefetch at all."""
  small8 = dataclasses.replace(SMALL, capacity=8)
  normal, ahead = _role2_only_ablation("l2ahead", cache, monkeypatch, small8)
  a, b = _ptx(normal, 2), _ptx(ahead, 2)
  per_item = 2 * (small8.intermediate // 128)  # W2 tiles over K = I, then the scale words' run of each (MN-major)
  assert "cp.async.bulk.prefetch.L2" not in a and b.count("cp.async.bulk.prefetch.L2") == 2 * per_item
  assert "L2::cache_hint" not in a
  hinted = b.count("cp.async.cg.shared.global.L2::cache_hint")  # the weight tiles' copies; the B rows' keep theirs
  assert 0 < hinted < a.count("cp.async.cg.shared.global [") == hinted + b.count("cp.async.cg.shared.global [")
  assert a.count("mma.sync.aligned.m16n8k32") == b.count("mma.sync.aligned.m16n8k32") > 0
  assert ahead["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]
  wider = build.compile_variant("sm_90a", SMALL, cache_dir=cache)  # (capacity 16, still under l2ahead)
  assert "+l2ahead-" in wider["key"] and "cp.async.bulk.prefetch.L2" not in _ptx(wider, 2)


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_kbany_build_tags_gemm1_items_and_polls_them_per_block(cache, monkeypatch):
  """GCMOE_ABLATION=kbany (docs/kernels_v2.md "GEMM2 stages out of K order"; timing, results exact): its own key,
  roles 1 and 3 as they are; in role 2 each GEMM1 item's 64-bit tag store and the one- and two-row GEMM2 passes'
  polls of them (the normal build has neither), those passes' own loops (more MMA instructions; kbany1 has the
  one-row pass's only, kbanyeager the same with another poll rule) and a one-row pass's p through SMEM; a variant of
  16 tokens builds none of it, a timeline build of it the stamps too."""
  small8 = dataclasses.replace(SMALL, capacity=8)
  normal, ablated = _role2_only_ablation("kbany", cache, monkeypatch, small8)
  a, b = _ptx(normal, 2), _ptx(ablated, 2)
  for op in ("st.relaxed.gpu.global.b64", "ld.acquire.gpu.global.v2.b64", "st.shared.v4.u32", "ld.shared.v4.u32"):
    assert op not in a and op in b, op
  assert b.count("mma.sync.aligned.m16n8k32") > a.count("mma.sync.aligned.m16n8k32")
  assert ablated["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]
  wider = build.compile_variant("sm_90a", SMALL, cache_dir=cache)  # (capacity 16, still under kbany)
  assert "+kbany-" in wider["key"] and "ld.acquire.gpu.global.v2.b64" not in _ptx(wider, 2)
  monkeypatch.setenv("GCMOE_ABLATION", "kbany1")  # one-row items only: their loop, not the two-row one
  one = _ptx(build.compile_variant("sm_90a", small8, cache_dir=cache), 2)
  assert "ld.acquire.gpu.global.v2.b64" in one
  assert a.count("mma.sync.aligned.m16n8k32") < one.count("mma.sync.aligned.m16n8k32") < b.count("mma.sync.aligned")
  monkeypatch.setenv("GCMOE_ABLATION", "kbanyeager")  # the same passes, polling at more steps
  eager = _ptx(build.compile_variant("sm_90a", small8, cache_dir=cache), 2)
  assert eager != b and eager.count("mma.sync.aligned.m16n8k32") == b.count("mma.sync.aligned.m16n8k32")
  monkeypatch.setenv("GCMOE_ABLATION", "timeline+kbany")  # the timeline's stamps in this build
  stamped = build.compile_variant("sm_90a", small8, cache_dir=cache)
  c = _ptx(stamped, 2)
  assert "+timeline+kbany-" in stamped["key"] and "ld.acquire.gpu.global.v2.b64" in c
  assert c.count("globaltimer") > b.count("globaltimer")
  assert stamped["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_trips_build_polls_the_flag_and_the_counter_at_once(cache, monkeypatch):
  """GCMOE_ABLATION=trips (timing, results exact): its own key, role 1 as it is; in roles 2 and 3 every bounded poll
  loads the error flag before the counter's acquire load instead of after it (whose L1 invalidation waits for the
  value: two round trips a poll), the same loads, sleeps and MMAs in number."""
  small8 = dataclasses.replace(SMALL, capacity=8)
  normal = build.compile_variant("sm_90a", small8, cache_dir=cache)
  monkeypatch.setenv("GCMOE_ABLATION", "trips")
  trips = build.compile_variant("sm_90a", small8, cache_dir=cache)
  assert "+trips-" in trips["key"] and _ptx(trips, 1) == _ptx(normal, 1)
  acquire_first = r"ld\.acquire\.gpu[^\n]*\n\s*ld\.relaxed\.gpu"
  flag_first = r"ld\.relaxed\.gpu[^\n]*\n\s*ld\.acquire\.gpu"
  for role in (2, 3):
    a, b = _ptx(normal, role), _ptx(trips, role)
    polls = len(re.findall(acquire_first, a))
    assert polls > 0 and len(re.findall(flag_first, b)) == polls and not re.findall(acquire_first, b), role
    for op in ("ld.acquire.gpu", "ld.relaxed.gpu", "nanosleep", "mma.sync.aligned.m16n8k32", "ld.global.nc"):
      assert a.count(op) == b.count(op), (role, op)
  assert trips["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_shfree_build_starts_the_shared_f_chains_at_a_constant(cache, monkeypatch):
  """GCMOE_ABLATION=shfree (timing, results exact): its own key, roles 1 and 3 as they are; in role 2 the shared
  expert's F x F chains of a token group start at 3 MAGIC (an immediate MMA accumulator) and Shh's and Sll's ends are
  subtracted after them, with the same MMAs, SMEM loads and float operations in number."""
  from gcmoe_jax.kernels import roles_v2
  normal, free = _role2_only_ablation("shfree", cache, monkeypatch)
  a, b = _ptx(normal, 2), _ptx(free, 2)
  assert a != b
  for op in ("mma.sync.aligned.m16n8k32", "ld.shared", "add.f32", "fma.rn.f32", "mul.f32"):
    assert a.count(op) == b.count(op), op
  # normal: each F chain's accumulator is 3 MAGIC less two ends (a sub.s32 from the immediate per element); shfree:
  # the MMA takes the immediate itself
  from_magic3 = r"mma\.sync[^\n]*\{" + ", ".join([str(roles_v2.MAGIC3)] * 4) + r"\};"
  sub_magic3 = rf"sub\.s32\s+%r\d+, {roles_v2.MAGIC3}, %r\d+;"
  chains = len(re.findall(from_magic3, b))
  assert chains > 0 and not re.findall(from_magic3, a)
  assert len(re.findall(sub_magic3, a)) == 4 * chains and not re.findall(sub_magic3, b)
  assert free["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_wearly_builds_copy_weights_before_their_waits(cache, monkeypatch):
  """GCMOE_ABLATION=wearly / wearly1 / wearlyl2 (docs/kernels_v2.md "The H100 timeline, and three ideas that did not
  pay"): each under its own key with roles 1 and 3 as they are and role 2's MMAs unchanged in number; role 2 holds
  more weight copies (a GEMM2 item's first stages before its wait; with wearly1 also a CTA's first GEMM1 item's
  before the phase-0 wait), and only wearlyl2 the L2 prefetches of a GEMM2 item's other K128 tiles, one each."""
  from gcmoe_jax.kernels import roles_v2
  mid = dataclasses.replace(SMALL, intermediate=1024, capacity=8)  # 8 K128 tiles of GEMM2: some left for L2
  normal = build.compile_variant("sm_90a", mid, cache_dir=cache)
  k = roles_v2.RoleKernelsV2(mid)
  n_st = k._pass_stages(1)
  kb_n = mid.intermediate // 128
  ahead = kb_n - min(n_st - k._per_bar(1, n_st, kb_n), kb_n)
  assert ahead > 0
  copies = {}
  for ablation in ("wearly", "wearly1", "wearlyl2"):
    _, built_ = _role2_only_ablation(ablation, cache, monkeypatch, mid)
    a, b = _ptx(normal, 2), _ptx(built_, 2)
    copies[ablation] = b.count("cp.async.cg.shared.global [")
    assert copies[ablation] > a.count("cp.async.cg.shared.global ["), ablation
    assert a.count("mma.sync.aligned.m16n8k32") == b.count("mma.sync.aligned.m16n8k32") > 0, ablation
    assert b.count("cp.async.bulk.prefetch.L2") == (ahead if ablation == "wearlyl2" else 0), ablation
    assert built_["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2], ablation
  assert copies["wearly1"] > copies["wearly"]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_shallow_and_spin_builds_keep_role_1_and_the_mmas(cache, monkeypatch):
  """GCMOE_ABLATION=shallow (one-tile passes with fewer pipeline stages; roles 1 and 3 as they are) and spin (the
  bounded waits poll with relaxed loads, no nanosleep), both for A/B timing: their own keys, role 2's MMAs unchanged
  in number; under spin roles 2 and 3 (whose waits are `_spin_geq`'s) sleep in fewer places and acquire in fewer
  loads, role 1 as it is."""
  normal, shallow = _role2_only_ablation("shallow", cache, monkeypatch, SMALL)
  a, b = _ptx(normal, 2), _ptx(shallow, 2)
  assert a != b and a.count("mma.sync.aligned.m16n8k32") == b.count("mma.sync.aligned.m16n8k32")
  monkeypatch.setenv("GCMOE_ABLATION", "spin")
  spin = build.compile_variant("sm_90a", SMALL, cache_dir=cache)
  assert "+spin-" in spin["key"]
  c = _ptx(spin, 2)
  assert a.count("mma.sync.aligned.m16n8k32") == c.count("mma.sync.aligned.m16n8k32")
  assert _ptx(spin, 1) == _ptx(normal, 1)
  for role in (2, 3):  # (role 3's waits go through `_spin_geq` too)
    p, q = _ptx(normal, role), _ptx(spin, role)
    assert q.count("nanosleep") < p.count("nanosleep") and q.count("ld.acquire.gpu") < p.count("ld.acquire.gpu"), role


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_bar4_build_meets_every_four_stages_of_its_one_tile_passes(cache, monkeypatch):
  """GCMOE_ABLATION=bar4 (timing): one-tile passes whose K128 stages come in fours (SMALL's GEMM1, K = 512) meet at a
  CTA barrier every four stages, so their loop body holds two pairs of stage bodies where the normal build holds
  one: more MMA instructions in role 2's code for the same work; its own key, roles 1 and 3 as they are."""
  from gcmoe_jax.kernels import roles_v2
  k = roles_v2.RoleKernelsV2(SMALL)
  monkeypatch.setenv("GCMOE_ABLATION", "bar4")
  assert roles_v2.RoleKernelsV2(SMALL)._per_bar(1, 8, 4) == 4 and roles_v2.RoleKernelsV2(SMALL)._per_bar(1, 8, 2) == 2
  monkeypatch.delenv("GCMOE_ABLATION")
  assert k._per_bar(1, 8, 4) == 2
  normal, bar4 = _role2_only_ablation("bar4", cache, monkeypatch, SMALL)
  a, b = _ptx(normal, 2), _ptx(bar4, 2)
  assert b.count("mma.sync.aligned.m16n8k32") > a.count("mma.sync.aligned.m16n8k32")


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_routedfirst_build_changes_only_role_2s_item_order(cache, monkeypatch):
  """GCMOE_ABLATION=routedfirst (the routed items first, the queue before session 18, for A/B timing) builds under
  its own key, with roles 1 and 3 as they are and role 2's MMAs and stores unchanged in number: only the item
  decode differs."""
  normal, first = _role2_only_ablation("routedfirst", cache, monkeypatch)
  a, b = _ptx(normal, 2), _ptx(first, 2)
  assert a != b
  for op in ("mma.sync.aligned.m16n8k32", "cp.async.ca", "cp.async.cg", "st.global", "bar.sync"):
    assert a.count(op) == b.count(op), op
  assert all(r["spill_bytes"] <= 48 for r in first["roles"])


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_small_groups_halves_meet_by_an_acq_rel_exchange(built, cache):
  """A group of one or two tokens takes its shared GEMM1 in halves, which meet in the block's exchange
  (`abi.Workspace.shx`, room for both tokens' values): role 2 of a
  shared-expert variant swaps the epoch tag in with an acq_rel atomic and reads the other half's values through L2;
  a routed variant has neither the exchange nor its section."""
  meta = build.compile_variant("sm_90a", SMALL_SHARED, cache_dir=cache)
  shared, routed = _ptx(meta, 2), _ptx(built["sm_90a"], 2)
  assert "atom.acq_rel.gpu.global.exch.b32" in shared and "ld.global.cg.u32" in shared
  assert "atom.acq_rel.gpu.global.exch.b32" not in routed
  ws = SMALL_SHARED.workspace("v2")
  assert ws.sae < ws.shx and ws.shx + abi.SHX_BYTES * SMALL_SHARED.shared_intermediate // 32 <= ws.pub_ids
  assert abi.SHX_VALUES + abi.HALVES_TOKENS * abi.SHX_TOKEN_BYTES <= abi.SHX_BYTES and abi.SHX_TOKEN_BYTES == 32 * 2
  assert SMALL.workspace("v2").shx == SMALL.workspace("v2").pub_ids  # no shared expert: an empty section


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_timeline_reads_the_kernels_token_groups():
  """`bench.timeline` counts the shared items by the token groups of `roles_v2` (8 or 16 tokens by capacity)."""
  from gcmoe_jax.bench import timeline
  from gcmoe_jax.kernels import roles_v2

  for cap in (8, 16, 32, 64, 128, 256):
    v = dataclasses.replace(SMALL_SHARED, capacity=cap)
    assert roles_v2.RoleKernelsV2(v).sh.tokens == timeline.shared_group_tokens(cap, v.top_k, v.experts), cap


def test_the_spill_frame_allows_one_alignment_hole():
  assert [build.spill_frame(n) for n in (0, 4, 8, 20, 28, 32, 44)] == [0, 8, 16, 24, 32, 40, 48]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_timeline_build_stamps_every_role(built, cache, monkeypatch):
  """GCMOE_ABLATION=timeline (`gcmoe_jax.bench.timeline`) adds %globaltimer reads to roles 1, 2 and 3 (the normal
  build reads the timer only in its bounded waits), under its own key."""
  monkeypatch.setenv("GCMOE_ABLATION", "timeline")
  meta = build.compile_variant("sm_90a", SMALL, cache_dir=cache)
  assert "+timeline-" in meta["key"]
  for role in (1, 2, 3):
    stamps, plain = (_ptx(m, role).count("%globaltimer") for m in (meta, built["sm_90a"]))
    assert stamps > plain, (role, stamps, plain)
  assert "%smid" in _ptx(meta, 2) and "%smid" not in _ptx(built["sm_90a"], 2)  # each CTA's SM, in its record


def test_an_ablation_build_has_its_own_cubin_key(monkeypatch):
  """GCMOE_ABLATION timing builds (wrong results by design) can never be loaded for a normal run: the ablation is in
  the key; a malformed value is rejected naming the variable."""
  monkeypatch.delenv("GCMOE_ABLATION", raising=False)
  plain = build.cache_key("sm_90a", SMALL)
  monkeypatch.setenv("GCMOE_ABLATION", "nomath")
  ablated = build.cache_key("sm_90a", SMALL)
  assert "+nomath-" in ablated and "+" not in plain and ablated != plain
  monkeypatch.setenv("GCMOE_ABLATION", "fast")
  with pytest.raises(ValueError, match=r"GCMOE_ABLATION must be .*got 'fast'"):
    build.cache_key("sm_90a", SMALL)


@pytest.mark.parametrize("text, match", [
  ("512,256,8,4", "expected 5 or 7"),
  ("512,256,8,4,x", "ints"),
  ("500,256,8,4,16", "hidden must be a multiple of 128"),
  ("512,256,0,4,16", "experts must be a positive int"),
  ("512,256,8,4,16,256,64", "shared_group must be 32 or 128"),
  ("512,256,8,4,16,r0", "ranks must be an int in"),
  ("512,256,8,4,16,r17", "ranks must be an int in"),
  ("512,256,8,4,16,rx", "ints"),
  ("512,256,8,4,16,r1relay", "relay must be a bool and needs ranks > 1"),
])
def test_variant_rejects(text, match):
  with pytest.raises(ValueError, match=match):
    Variant.parse(text)


def test_unknown_arch_is_rejected():
  with pytest.raises(ValueError, match="arch must be one of"):
    build.cache_key("sm_80", SMALL)


def test_parse_ptx_entry_rejects_two_entries():
  ptx = ".visible .entry a(\n\t.param .u32 a_p0\n)\n{}\n.visible .entry b(\n\t.param .u32 b_p0\n)\n{}\n"
  with pytest.raises(BuildError, match="exactly one .entry"):
    build.parse_ptx_entry(ptx)


def test_cli_requires_a_variant(capsys):
  assert cli_main(["build-kernels", "--out", "/nonexistent-never-created"]) == 2
  assert "at least one --variant or --preset" in capsys.readouterr().err


def test_every_preset_names_valid_distinct_variants():
  """`build-kernels --preset`: each preset's variants pass `Variant`'s checks and none repeats; `fused-paper` (the
  fused rows of `bench.ep`, issue 11) holds both paper models per rank at R = 2, 4, 8 and every capacity, with the
  return path `ffi._cuda.prepare` picks (the geometry's at B = capacity)."""
  from gcmoe_jax import geometry
  from gcmoe_jax.commands import build_kernels

  for name, preset in build_kernels.PRESETS.items():
    variants = [Variant(*fields) for fields in preset()]
    assert len(set(variants)) == len(variants), name
  paper = {(v.hidden, v.experts, v.ranks, v.capacity): v.relay
           for v in (Variant(*f) for f in build_kernels.PRESETS["fused-paper"]())}
  for m in geometry.MODELS.values():
    for r in (2, 4, 8):
      for cap in (8, 16, 32, 64, 128, 256):
        assert paper[(m.H, m.E // r, r, cap)] == geometry.relay_staging(r, cap, cap, m.k, m.E // r, m.H, False)[0]
  # `paper` builds what the bench runs (its per-rank shapes at R = 8, the shared expert with the model's K-group).
  from gcmoe_jax.bench import sweep
  built = set(build_kernels.PRESETS["paper"]())
  for model in geometry.MODELS:
    for shared in (False, True):
      s = sweep.model_shape(model, shared=shared)
      for cap in (8, 16, 32, 64, 128, 256):
        want = (s.hidden, s.intermediate, s.experts, s.top_k, cap)
        want += (s.shared_intermediate, s.shared_group) if shared else ()
        assert want in built, (model, want)


@needs_dsl
def test_an_ablation_build_may_spill_more_than_a_normal_one(monkeypatch):
  """The spill guard: two-CTA role 2 may spill `_SPILL_BUDGET` (48 B) in a normal build, `_WIDE_SPILL_BUDGET`
  (160 B) where its widest pass has 4 n-tiles, in a frame with at most one 4-byte alignment hole
  (`build.spill_frame`), and `_ABLATION_SPILL_BUDGET` (256 B) plus a stack slot in a GCMOE_ABLATION build (timing
  or diagnostic only, at any CTAs per SM); the message names the bound."""
  entry = {"name": "k", "reqntid": [256, 1, 1],
           "params": [{"type": t, "decl": f"{t} p{i}"} for i, t in enumerate(build._PTX_PARAM_TYPES)]}
  res = lambda spill, local: {"registers": 128, "spill_bytes": spill, "local_bytes": local, "static_smem": 0}
  monkeypatch.delenv("GCMOE_ABLATION", raising=False)
  build._check_role(2, SMALL, "sm_90a", entry, res(48, 48), ctas=2)
  with pytest.raises(BuildError, match=r"spills 96 B .*at most 48 B\)"):
    build._check_role(2, SMALL, "sm_90a", entry, res(96, 96), ctas=2)
  build._check_role(2, SMALL, "sm_90a", entry, res(32, 40), ctas=2)  # 0x0-0x24 with a hole at 0xc
  build._check_role(2, SMALL, "sm_90a", entry, res(144, 152), ctas=2, pass_tiles=4)
  with pytest.raises(BuildError, match=r"spills 168 B .*at most 160 B\)"):
    build._check_role(2, SMALL, "sm_90a", entry, res(168, 168), ctas=2, pass_tiles=4)
  with pytest.raises(BuildError, match="64 B of local memory"):
    build._check_role(2, SMALL, "sm_90a", entry, res(48, 64), ctas=2)
  monkeypatch.setenv("GCMOE_ABLATION", "stagebar")
  build._check_role(2, SMALL, "sm_90a", entry, res(96, 104), ctas=2)
  build._check_role(2, SMALL, "sm_90a", entry, res(224, 224), ctas=2)
  with pytest.raises(BuildError, match="at most 256 B in an ablation build"):
    build._check_role(2, SMALL, "sm_90a", entry, res(264, 264), ctas=2)
  build._check_role(2, SMALL, "sm_90a", entry, res(8, 8), ctas=1)  # a timing build at 255 registers
  monkeypatch.delenv("GCMOE_ABLATION")
  with pytest.raises(BuildError, match="must not spill"):  # one-CTA kernels of a normal build never spill
    build._check_role(2, SMALL, "sm_90a", entry, res(8, 8), ctas=1)


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_row_bodies_start_their_mma_pairs_at_the_epilogue_words(cache, monkeypatch):
  """The one-, two- and four-row bodies' split-decode MMA pairs start at (MAGIC, 0, MAGIC, 0) (`_stage`'s ``c_row``,
  docs/kernels_v2.md "The row bodies' MMA pairs from the epilogue's words"), so their epilogue adds no MAGIC to the
  digit sums: two integer adds a block fewer than `GCMOE_ABLATION=unbiased` (the form before, results exact both
  ways, its own key, roles 1 and 3 as they are), with the same MMAs, SMEM loads, shuffles and float operations in
  number."""
  from gcmoe_jax.kernels import roles_v2
  normal, unbiased = _role2_only_ablation("unbiased", cache, monkeypatch, dataclasses.replace(SMALL, capacity=8))
  a, b = _ptx(normal, 2), _ptx(unbiased, 2)
  for op in ("mma.sync.aligned.m16n8k32", "ld.shared", "shfl.sync", "add.f32", "fma.rn", "mul.f32"):
    assert a.count(op) == b.count(op), op
  from_row_start = r"mma\.sync[^\n]*\{" + ", ".join([str(roles_v2.MAGIC), "0"] * 2) + r"\};"
  pairs = len(re.findall(from_row_start, a))
  assert pairs > 0 and not re.findall(from_row_start, b)
  add_magic = rf"add\.s32\s+%r\d+, %r\d+, {roles_v2.MAGIC};"
  # one MAGIC + T and one MAGIC + S2 per (pass body, block) of every unbiased pair, a pair per block in the one- and
  # two-row bodies and two in the four-row body, whose two epilogues add twice
  assert len(re.findall(add_magic, b)) - len(re.findall(add_magic, a)) == 2 * pairs, (pairs,)
  assert unbiased["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_stage_copies_take_their_sources_once_per_pass(cache, monkeypatch):
  """The per-thread producer's copies take this thread's weight, scale and B-row sources once per pass
  (`RoleKernelsV2._copy_sources`, docs/kernels_v2.md "Where the warps wait, per instruction") instead of reading
  the slot table from SMEM and rebuilding the 64-bit addresses at every stage, as `GCMOE_ABLATION=copyaddr` (the form
  before; its own key, roles 1 and 3 as they are) still does: the same copies, MMAs and float operations, fewer SMEM
  loads (the slot table's, two per copy site before), and no more local memory."""
  # (capacity 16: at 8 the normal build issues a paired step's second weights between its stages, from the sources
  # the copyaddr build does not take, so their copy counts differ by construction)
  normal, before = _role2_only_ablation("copyaddr", cache, monkeypatch, dataclasses.replace(SMALL, capacity=16))
  a, b = _ptx(normal, 2), _ptx(before, 2)
  for op in ("cp.async.cg.shared.global", "cp.async.ca.shared.global", "mma.sync.aligned.m16n8k32", "fma.rn",
             "shfl.sync"):
    assert a.count(op) == b.count(op) > 0, op
  assert a.count("ld.shared") < b.count("ld.shared")
  assert normal["roles"][1]["spill_bytes"] <= before["roles"][1]["spill_bytes"]


def _loads_before_copies(ptx: str) -> list[int]:
  """Per CTA barrier of a PTX text: the SMEM loads between it and the next cp.async (the copies that follow it)."""
  out = []
  for part in re.split(r"\bbar\.sync\b", ptx)[1:]:
    head = part.split("cp.async.", 1)[0] if "cp.async." in part else ""
    out.append(head.count("ld.shared"))
  return out


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_paired_steps_load_their_scale_words_before_their_copies(cache, monkeypatch):
  """A barrier step of the paired stages loads its stages' scale words right after the barrier, before its copies
  (docs/kernels_v2.md "Where the warps wait, per instruction"), where `GCMOE_ABLATION=scalelate` (the form before; its
  own key, roles 1 and 3 as they are) loads them after the copies: the same loads, copies and MMAs, moved."""
  normal, late = _role2_only_ablation("scalelate", cache, monkeypatch, dataclasses.replace(SMALL, capacity=8))
  a, b = _ptx(normal, 2), _ptx(late, 2)
  for op in ("ld.shared", "cp.async.", "mma.sync.aligned.m16n8k32", "bar.sync"):
    assert a.count(op) == b.count(op) > 0, op
  # (four words: rows g and g + 8 of both stages of a step)
  assert sum(n >= 4 for n in _loads_before_copies(a)) > sum(n >= 4 for n in _loads_before_copies(b))


def _copies_between_mmas(ptx: str) -> int:
  """The CTA barrier steps of a PTX text whose weight copies (cp.async.cg) lie between two of their MMAs."""
  out = 0
  for part in re.split(r"\bbar\.sync\b", ptx)[1:]:
    first, last = part.find("mma.sync"), part.rfind("mma.sync")
    out += 0 <= first < last and "cp.async.cg.shared.global" in part[first:last]
  return out


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_a_paired_steps_second_weights_go_between_its_stages(cache, monkeypatch):
  """A paired step of a routed variant of capacity <= 8 issues its second stage's weight copies between its two
  stages, zero-filling without a branch past the K loop (`_issue_mid`, docs/kernels_v2.md "The second stage's weights
  between the stages", session 49), where `GCMOE_ABLATION=copyburst` (the form before; its own key, roles 1 and 3 as
  they are) issues every copy of a step before its MMAs: the same scale-word copies, and no more local memory than
  the budget. At capacity 16, measured only in the form before, the normal build keeps it and `GCMOE_ABLATION=copymid`
  builds the split."""
  normal, burst = _role2_only_ablation("copyburst", cache, monkeypatch, Variant(6144, 2048, 32, 8, 8))
  a, b = _ptx(normal, 2), _ptx(burst, 2)
  assert _copies_between_mmas(b) == 0 < _copies_between_mmas(a)
  assert a.count("cp.async.ca.shared.global") == b.count("cp.async.ca.shared.global") > 0
  assert normal["roles"][1]["spill_bytes"] <= build._SPILL_BUDGET[2]
  monkeypatch.delenv("GCMOE_ABLATION")
  wide, mid = _role2_only_ablation("copymid", cache, monkeypatch, Variant(6144, 2048, 32, 8, 16))
  assert _copies_between_mmas(_ptx(wide, 2)) == 0 < _copies_between_mmas(_ptx(mid, 2))


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_tmaw_build_copies_the_weight_tiles_by_tma(cache, monkeypatch):
  """GCMOE_ABLATION=tmaw (timing, exact by construction, docs/kernels_v2.md "The weight tiles by TMA"): the
  per-thread producer's weight tiles by one TMA copy per stage onto a `full` mbarrier per slot, which every thread
  waits for (bounded), the scale words and B rows per thread as before: its own key, roles 1 and 3 as they are,
  tensor copies and mbarrier waits the normal build has none of, fewer 16-byte cp.async, the same scale-word copies,
  and local memory within the ablation budget."""
  normal, tmaw = _role2_only_ablation("tmaw", cache, monkeypatch, Variant(6144, 2048, 32, 8, 8))
  a, b = _ptx(normal, 2), _ptx(tmaw, 2)
  for op in ("cp.async.bulk.tensor.2d", "mbarrier.try_wait.parity", "mbarrier.arrive.expect_tx"):
    assert op not in a and op in b, op
  assert b.count("cp.async.cg.shared.global") < a.count("cp.async.cg.shared.global")
  assert a.count("cp.async.ca.shared.global") == b.count("cp.async.ca.shared.global") > 0
  assert tmaw["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
@pytest.mark.parametrize("ablation", ["blocklanes", "blocklanes1"])
def test_the_blocklanes_build_gives_each_lane_of_a_quad_a_block(cache, monkeypatch, ablation):
  """GCMOE_ABLATION=blocklanes / blocklanes1 (timing, exact by construction, docs/kernels_v2.md "A K32 block per lane
  of a quad"): its own key, roles 1 and 3 as they are; in role 2 the one-row bodies' extra MMA pair per block (X and
  Y), the zeros of the padded B columns, fewer shuffles in the one-row stages (three a stage instead of four), the
  same copies, and local memory within the ablation budget."""
  normal, lanes = _role2_only_ablation(ablation, cache, monkeypatch, Variant(6144, 2048, 32, 8, 8))
  a, b = _ptx(normal, 2), _ptx(lanes, 2)
  assert b.count("mma.sync.aligned.m16n8k32") > a.count("mma.sync.aligned.m16n8k32")
  assert b.count("st.shared.v4.u32") > a.count("st.shared.v4.u32")
  assert b.count("shfl.sync.bfly") < a.count("shfl.sync.bfly")
  for op in ("cp.async.cg.shared.global", "cp.async.ca.shared.global"):
    assert a.count(op) == b.count(op) > 0, op
  assert lanes["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_threecta_build_fits_three_ctas_with_the_one_and_two_row_bodies(cache, monkeypatch):
  """GCMOE_ABLATION=threecta (timing, docs/kernels_v2.md "Three CTAs per SM for B <= 2"): every pass of one or two
  rows, so role 2 holds only the one- and two-row bodies and fits three CTAs per SM (80 registers, the third pipeline
  area): its own key, roles 1 and 3 as they are, fewer MMAs in role 2 (no 1-tile or four-row body), the same kinds of
  copies, and local memory within the ablation budget."""
  normal, three = _role2_only_ablation("threecta", cache, monkeypatch, Variant(6144, 2048, 32, 8, 8))
  role = three["roles"][1]
  assert role["ctas_per_sm"] == 3 and role["registers"] <= 80, role
  a, b = _ptx(normal, 2), _ptx(three, 2)
  assert 0 < b.count("mma.sync.aligned.m16n8k32") < a.count("mma.sync.aligned.m16n8k32")
  for op in ("cp.async.cg.shared.global", "cp.async.ca.shared.global"):
    assert b.count(op) > 0, op
  assert role["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_shnodecode_build_leaves_out_the_shared_weights_digit_decode(cache, monkeypatch):
  """GCMOE_ABLATION=shnodecode (timing only, results wrong; docs/kernels_v2.md "Session 55"): its own key, roles 1
  and 3 as they are; in role 2 the shared expert's E4M3 digit decode gone (fewer prmt and SMEM word loads: the
  table lookups), the same MMAs (no two A fragments equal, so none merged) and the same copies."""
  normal, raw = _role2_only_ablation("shnodecode", cache, monkeypatch)
  a, b = _ptx(normal, 2), _ptx(raw, 2)
  assert b.count("mma.sync.aligned.m16n8k32") == a.count("mma.sync.aligned.m16n8k32") > 0
  assert b.count("prmt.b32") < a.count("prmt.b32")
  assert b.count("ld.shared.u32") < a.count("ld.shared.u32")
  for op in ("cp.async.cg.shared.global", "cp.async.ca.shared.global"):
    assert a.count(op) == b.count(op) > 0, op
  assert raw["roles"][1]["spill_bytes"] <= build._ABLATION_SPILL_BUDGET[2]


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_lanetab_build_gives_every_lane_its_own_decode_table(cache, monkeypatch):
  """GCMOE_ABLATION=lanetab (exact; slower on the H100, docs/kernels_v2.md "Session 56", "Session 57"): its own
  key, roles 1 and 3 as they are; in role 2 the shared expert's E4M3 decode table with a copy per lane, so a warp's
  lookups hit 32 banks: each thread stores its code's 32 copies (31 more SMEM stores a shared core), the lookups as
  many as before, the same MMAs and copies, the SMEM 32 KB more for the shared items at the CTAs an SM as before, and
  spills within the normal builds' budget (it was meant to become the default)."""
  normal, lanes = _role2_only_ablation("lanetab", cache, monkeypatch)
  a, b = _ptx(normal, 2), _ptx(lanes, 2)
  stores = b.count("st.shared.u32") - a.count("st.shared.u32")
  assert stores > 0 and stores % 31 == 0
  for op in ("ld.shared.u32", "mma.sync.aligned.m16n8k32", "cp.async.cg.shared.global", "cp.async.ca.shared.global"):
    assert a.count(op) == b.count(op) > 0, op
  n, m = normal["roles"][1], lanes["roles"][1]
  assert m["ctas_per_sm"] == n["ctas_per_sm"] and m["dynamic_smem"] > n["dynamic_smem"]
  assert m["spill_bytes"] <= (build._SPILL_BUDGET[2] if m["ctas_per_sm"] > 1 else 0)


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_the_smempad_build_gives_role2_lanetabs_smem_with_the_single_table(cache, monkeypatch):
  """GCMOE_ABLATION=smempad (timing, exact; docs/kernels_v2.md "Session 57"): its own key, roles 1 and 3 as they are;
  role 2 allocates `lanetab`'s SMEM at the CTAs an SM as before, and runs the normal build's code: the same SMEM
  stores, loads, MMAs and copies."""
  normal, pad = _role2_only_ablation("smempad", cache, monkeypatch)
  monkeypatch.setenv("GCMOE_ABLATION", "lanetab")
  lanes = build.compile_variant("sm_90a", SMALL_SHARED, cache_dir=cache)
  n, m = normal["roles"][1], pad["roles"][1]
  assert m["dynamic_smem"] == lanes["roles"][1]["dynamic_smem"] > n["dynamic_smem"]
  assert m["ctas_per_sm"] == n["ctas_per_sm"]
  a, b = _ptx(normal, 2), _ptx(pad, 2)
  for op in ("st.shared.u32", "ld.shared.u32", "mma.sync.aligned.m16n8k32", "cp.async.cg.shared.global",
             "cp.async.ca.shared.global"):
    assert a.count(op) == b.count(op) > 0, op


@needs_dsl
@pytest.mark.skipif(build.generation() != "v2", reason="GCMOE_KERNELS=v1")
def test_a_paired_steps_copies_take_one_range_test(cache, monkeypatch):
  """A paired step of a routed variant whose stages are all in range or all past the K loop issues their copies
  under one test, so that they lie in one basic block (docs/kernels_v2.md "A step's copies in one block",
  session 48), where `GCMOE_ABLATION=copystep` (the form before) tests each stage's range before its copies. Against
  `GCMOE_ABLATION=copyburst` (session 48's form: the block, with every copy of the step before its MMAs): the same
  copies, SMEM loads and MMAs, a step's commits in both arms of its one test."""
  # (GLM5.2's capacity-8 variant: the small shape's pipeline depth is odd, where both forms are the same code)
  built = []
  for ablation in ("copyburst", "copystep"):
    monkeypatch.delenv("GCMOE_ABLATION", raising=False)
    built.append(_role2_only_ablation(ablation, cache, monkeypatch, Variant(6144, 2048, 32, 8, 8))[1])
  burst, step = built
  a, b = _ptx(burst, 2), _ptx(step, 2)
  for op in ("cp.async.cg.shared.global", "cp.async.ca.shared.global", "mma.sync.aligned.m16n8k32", "ld.shared"):
    assert a.count(op) == b.count(op) > 0, op
  assert a.count("cp.async.commit_group") > b.count("cp.async.commit_group")
  assert burst["roles"][1]["spill_bytes"] <= build._SPILL_BUDGET[2]
