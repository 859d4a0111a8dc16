"""The PTX pipeline (kernels/ptx.py) on the real role-kernel PTX: rewrites, validation, assembly."""

import re
import shutil

import pytest

from gcmoe_jax.kernels import build, ptx

cutlass = pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")

SMALL = build.Variant(512, 256, 8, 4, 16)


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
  """PTX of the three v1 roles for sm_90a and sm_120a (compiled once, to a temporary cache)."""
  cache = tmp_path_factory.mktemp("cubins")
  out = {}
  for arch in ("sm_90a", "sm_120a"):
    built = build.load_or_build(arch, SMALL, cache_dir=cache)
    out[arch] = {r: (built.directory / f"role{r}.ptx").read_text() for r in (1, 2, 3)}
    out[arch]["compact"] = built.role(2).get("fp4_weights", "compact") == "compact"
  return out


def _features(modules, arch):
  return ptx.role2_features("v2", arch, compact=modules[arch]["compact"])


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("role", [1, 2, 3])
def test_v1_roles_validate(modules, arch, role):
  e = ptx.validate(modules[arch][role], role=role, arch=arch, param_types=ptx.param_types("v2", role))
  assert e.param_types == ptx.param_types("v2", role)
  assert e.param_types[:15] == ptx.ABI_PARAM_TYPES


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_role2_holds_the_instructions_of_its_seam(modules, arch):
  """§5.1: the v2 role 2 still contains its MMA (int8 on sm_90a, the block-scaled QMMA on sm_120a), the TMA
  pipeline (tensor and bulk copies, mbarrier waits) or, on sm_90a, the cp.async one, and ldmatrix; the QMMA is
  not on sm_90a and the int8 MMA not on sm_120a (one seam per target)."""
  features = _features(modules, arch)
  assert features and ptx.validate(modules[arch][2], role=2, arch=arch, features=features,
                                   param_types=ptx.param_types("v2", 2))
  qmma = "mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col.f32.e2m1.e4m3.f32.ue8m0"
  int8 = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"
  text = modules[arch][2]
  assert (qmma in text, int8 in text) == ((True, False) if arch == "sm_120a" else (False, True))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_a_role2_that_lost_a_feature_fails_naming_it(modules, arch):
  for feature in _features(modules, arch):
    broken = modules[arch][2].replace(feature, "nop")
    with pytest.raises(ptx.PtxError, match=re.escape(f"role 2 for {arch} lost `{feature}`")):
      ptx.validate(broken, role=2, arch=arch, features=_features(modules, arch),
                   param_types=ptx.param_types("v2", 2))


def test_the_fp4_paths_validate_their_own_fragments(modules):
  """SMALL (r = 8 rows per expert: tile_n 16) takes the expanded FP4 path on sm_120a: its role 2 holds ldmatrix's
  4-bit unpack and no compact fragment load, so validating it as compact names the lost ldmatrix.b16; sm_90a only
  has the compact tile, and asking for the expanded one there is an error."""
  assert not modules["sm_120a"]["compact"] and modules["sm_90a"]["compact"]
  text = modules["sm_120a"][2]
  assert ptx.LDSM_EXPANDED in text and ptx.LDSM_COMPACT not in text
  with pytest.raises(ptx.PtxError, match=re.escape(f"lost `{ptx.LDSM_COMPACT}`")):
    ptx.validate(text, role=2, arch="sm_120a", features=ptx.role2_features("v2", "sm_120a", compact=True),
                 param_types=ptx.param_types("v2", 2))
  with pytest.raises(ValueError, match=r"the expanded FP4 path is sm_120a/sm_121a only, got arch 'sm_90a'"):
    ptx.role2_features("v2", "sm_90a", compact=False)


def test_a_formal_count_off_by_one_is_named(modules):
  text = modules["sm_120a"][3]
  dropped = re.sub(r",\s*\.param \.f32 \w+_param_14", "", text, count=1)
  assert dropped != text
  with pytest.raises(ptx.PtxError, match=r"has 14 formals, the ABI has 15"):
    ptx.validate(dropped, role=3, arch="sm_120a")
  e = ptx.entries(text)[0]
  extra = text.replace(f"{e.name}(", f"{e.name}(\n\t.param .u64 {e.name}_param_extra,", 1)
  with pytest.raises(ptx.PtxError, match=r"has 16 formals, the ABI has 15"):
    ptx.validate(extra, role=3, arch="sm_120a")


def test_a_directive_rewrite_on_a_duplicated_directive_fails(modules):
  text = modules["sm_120a"][2]
  entry = ptx.entries(text)[0].name
  twice = ptx.rewrite_min_ctas(text, entry, 2).replace(".minnctapersm 2", ".minnctapersm 2\n.minnctapersm 2", 1)
  with pytest.raises(ptx.PtxError, match=r"declares \.minnctapersm 2 times"):
    ptx.rewrite_min_ctas(twice, entry, 2)


def test_a_changed_formal_is_named(modules):
  text = modules["sm_90a"][1]
  bad = re.sub(r"\.param \.u32 (\w+_param_13)", r".param .u64 \1", text)
  with pytest.raises(ptx.PtxError, match=r"formal 13 \(tokens\) is \.u64, the ABI says \.u32"):
    ptx.validate(bad, role=1, arch="sm_90a")
  with pytest.raises(ptx.PtxError, match=r"targets sm_90a, expected sm_120a"):
    ptx.validate(text, role=1, arch="sm_120a")


def test_version_rewrite_matches_exactly_once(modules):
  text = modules["sm_90a"][3]
  out = ptx.rewrite_version(text, "8.0")
  assert re.search(r"^\.version 8\.0$", out, re.M) and out.count(".version") == text.count(".version")
  with pytest.raises(ptx.PtxError, match=r"the \.version rewrite must match exactly once, matched 2 times"):
    ptx.rewrite_version(text + "\n.version 9.9\n", "9.0")
  with pytest.raises(ValueError, match="version must look like '9.0', got 'nine'"):
    ptx.rewrite_version(text, "nine")


def test_occupancy_rewrites_follow_eq4(modules):
  text = modules["sm_90a"][2]
  entry = ptx.entries(text)[0].name
  two = ptx.rewrite_min_ctas(text, entry, 2)
  assert ".minnctapersm 2" in two and ".minnctapersm 1" not in two
  capped = ptx.rewrite_max_registers(two, entry, ctas=2, threads=256)
  assert re.search(r"^\.maxnreg 128$", capped, re.M)  # 65536 / (2 * 256), 16-aligned
  assert ptx.rewrite_max_registers(text, entry, ctas=1, threads=256) == text  # no ceiling at one CTA per SM
  # Idempotent: rewriting a rewritten module changes nothing (no line break lost around the directives).
  assert ptx.rewrite_max_registers(ptx.rewrite_min_ctas(capped, entry, 2), entry, ctas=2, threads=256) == capped
  with pytest.raises(ptx.PtxError, match="entry 'nope' not found"):
    ptx.rewrite_min_ctas(text, "nope", 2)


@pytest.mark.skipif(shutil.which("ptxas") is None and not shutil.which("/usr/local/cuda/bin/ptxas"),
                    reason="no ptxas on this machine")
def test_assemble_rewrites_a_newer_version_down_to_the_local_ptxas(modules):
  """§5.1: PTX of a newer ISA than the toolchain's ptxas assembles once its .version is rewritten."""
  exe = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
  release = ptx.ptxas_release(exe)
  newer = ptx.rewrite_version(modules["sm_90a"][3], "9.4")
  cubin = ptx.assemble(newer, "sm_90a", ptxas=exe)
  assert cubin[:4] == b"\x7fELF", f"ptxas {release} returned no ELF"
