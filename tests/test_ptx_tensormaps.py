"""§5.1's TensorMaps-by-value rewrite (kernels/ptx.py) on PTX shaped like CuTe DSL's: two descriptors passed as
pointer formals, each loaded once and used twice (a prefetch and a TMA load). No CuTe DSL needed; ptxas assembles
the result where it is installed."""

import shutil

import pytest

from gcmoe_jax.kernels import ptx

_PTXAS = shutil.which("ptxas") or shutil.which("/usr/local/cuda/bin/ptxas")


def _module(loads_of_w: int = 1, uses_of_x: int = 2, w_type: str = ".u64") -> str:
  w_loads = "\n".join(f"\tld.param.u64 \t%rd{1 + 10 * n}, [k_param_0];" for n in range(loads_of_w))
  x_uses = "\n".join(["\tprefetch.tensormap [%rd3];",
                      "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], "
                      "[%rd3, {%r2, %r2}], [%r3];",
                      "\tprefetch.tensormap [%rd3];"][:uses_of_x])
  return f"""//
.version 9.0
.target sm_90a
.address_size 64

.visible .entry k(
\t.param {w_type} k_param_0,
\t.param .u64 k_param_1,
\t.param .u64 k_param_2
)
.maxntid 128, 1, 1
{{
\t.reg .b32 \t%r<8>;
\t.reg .b64 \t%rd<32>;
\t// demoted variable
\t.shared .align 128 .b8 buf[256];
\t.shared .align 8 .b64 bar;

{w_loads}
\tld.param.u64 \t%rd2, [k_param_1];
\tld.param.u64 \t%rd3, [k_param_2];
\tmov.u32 \t%r1, buf;
\tmov.u32 \t%r3, bar;
\tmov.b32 \t%r2, 0;
\tprefetch.tensormap [%rd1];
\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {{%r2, %r2}}], [%r3];
{x_uses}
\tst.global.u32 \t[%rd2], %r2;
\tret;
}}
"""


def test_maps_become_128_byte_params_addressed_in_place():
  out = ptx.rewrite_tensormaps_by_value(_module(), "k", (0, 2))
  assert ".param .align 128 .b8 k_param_0[128]" in out and ".param .align 128 .b8 k_param_2[128]" in out
  assert "cvta.param::entry.u64 %rd1, k_param_0;" in out and "cvta.param::entry.u64 %rd3, k_param_2;" in out
  assert "ld.param.u64 \t%rd2, [k_param_1];" in out  # the plain pointer is left alone
  assert "[k_param_0]" not in out and "[k_param_2]" not in out
  e = ptx.validate(out, role=2, arch="sm_90a", features=(ptx.TMA,), param_types=(".b8", ".u64", ".b8"))
  assert e.param_types == (".b8", ".u64", ".b8")


@pytest.mark.skipif(_PTXAS is None, reason="no ptxas on this machine")
def test_the_rewritten_module_assembles():
  cubin = ptx.assemble(ptx.rewrite_tensormaps_by_value(_module(), "k", (0, 2)), "sm_90a", ptxas=_PTXAS)
  assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("module, index, message", [
  (dict(loads_of_w=2), 0, r"TensorMap formal 0 \(k_param_0\) must be loaded exactly once, loaded 2 times"),
  (dict(loads_of_w=0), 0, r"TensorMap formal 0 \(k_param_0\) must be loaded exactly once, loaded 0 times"),
  (dict(uses_of_x=1), 2, r"TensorMap formal 2 \(k_param_2\) must be used exactly 2 times through %rd3, used 1 times"),
  (dict(uses_of_x=3), 2, r"TensorMap formal 2 \(k_param_2\) must be used exactly 2 times through %rd3, used 3 times"),
  (dict(w_type=".u32"), 0,
   r"formal 0 must be a \.u64 TensorMap pointer to pass it by value, got '\.param \.u32 k_param_0'"),
  ({}, 3, r"entry k has 3 formals, no formal 3 to pass a TensorMap in"),
])
def test_each_assertion_fails_naming_the_formal(module, index, message):
  with pytest.raises(ptx.PtxError, match=message):
    ptx.rewrite_tensormaps_by_value(_module(**module), "k", (index,))


def test_a_second_rewrite_and_a_missing_entry_fail():
  once = ptx.rewrite_tensormaps_by_value(_module(), "k", (0,))
  with pytest.raises(ptx.PtxError,
                     match=r"formal 0 must be a \.u64 TensorMap pointer .* got '\.param \.align 128 \.b8"):
    ptx.rewrite_tensormaps_by_value(once, "k", (0,))
  with pytest.raises(ptx.PtxError, match=r"entry 'other' must appear exactly once, found 0"):
    ptx.rewrite_tensormaps_by_value(_module(), "other", (0,))
  with pytest.raises(ValueError, match=r"indices must be distinct formal indices, got \(0, 0\)"):
    ptx.rewrite_tensormaps_by_value(_module(), "k", (0, 0))


def test_a_role2_without_its_tma_fails_naming_it():
  no_tma = _module().replace("cp.async.bulk.tensor", "cp.async.bulk")
  with pytest.raises(ptx.PtxError, match=r"role 2 for sm_90a lost `cp.async.bulk.tensor`"):
    ptx.validate(no_tma, role=2, arch="sm_90a", features=(ptx.TMA,), param_types=(".u64",) * 3)


def test_any_number_of_tma_uses_when_uses_is_none():
  """Role 2 issues its tile copies from one site per pass width: ``uses=None`` takes any count of TMA uses (and
  prefetches) but nothing else."""
  out = ptx.rewrite_tensormaps_by_value(_module(uses_of_x=3), "k", (0, 2), uses=None)
  assert "cvta.param::entry.u64 %rd3, k_param_2;" in out


def test_a_map_used_outside_a_tma_instruction_fails_naming_the_use():
  text = _module().replace("\tst.global.u32 \t[%rd2], %r2;", "\tst.global.u32 \t[%rd3], %r2;")
  with pytest.raises(ptx.PtxError, match=r"TensorMap formal 2 \(k_param_2\) must be used only as the TensorMap "
                                         r"operand of TMA instructions through %rd3, also used in 'st\.global"):
    ptx.rewrite_tensormaps_by_value(text, "k", (2,), uses=None)


def test_a_map_never_used_fails_unless_allowed():
  """A build whose role 2 does not issue TMA (sm_90a's cp.async producer) never loads its map formals: with
  ``unused_ok`` only their declarations change, so the ABI stays one; otherwise the rewrite names the formal."""
  text = _module(loads_of_w=0).replace("\tprefetch.tensormap [%rd1];\n", "").replace(
    "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r2}], "
    "[%r3];\n", "")
  with pytest.raises(ptx.PtxError, match=r"k_param_0\) must be loaded exactly once, loaded 0 times"):
    ptx.rewrite_tensormaps_by_value(text, "k", (0,), uses=None)
  out = ptx.rewrite_tensormaps_by_value(text, "k", (0, 2), uses=None, unused_ok=True)
  assert ".param .align 128 .b8 k_param_0[128]" in out and "cvta.param::entry.u64 %rd3, k_param_2;" in out
  assert ptx.validate(out, role=1, arch="sm_90a", param_types=(".b8", ".u64", ".b8"))


@pytest.mark.skipif(_PTXAS is None, reason="no ptxas on this machine")
def test_assemble_reports_the_stack_frame_and_spills():
  report = {}
  cubin = ptx.assemble(ptx.rewrite_tensormaps_by_value(_module(), "k", (0, 2)), "sm_90a", ptxas=_PTXAS, report=report)
  assert cubin[:4] == b"\x7fELF"
  assert report == {"stack_frame": 0, "spill_stores": 0, "spill_loads": 0}


def test_at_use_gives_each_tma_instruction_its_own_address():
  """``at_use``: no register holds a map's address from the entry on; each TMA instruction takes it in a scope of
  its own (role 2's copies sit in the loop whose MMAs need every register)."""
  out = ptx.rewrite_tensormaps_by_value(_module(uses_of_x=3), "k", (0, 2), uses=None, at_use=True)
  assert "[k_param_0]" not in out and "[k_param_2]" not in out
  scoped = [ln.strip() for ln in out.splitlines() if "%tmap" in ln]
  assert len(scoped) == 5  # map 0: a prefetch and a copy; map 2: two prefetches and a copy
  assert all(ln.startswith("{ .reg .b64 %tmap; cvta.param::entry.u64 %tmap, k_param_") and ln.endswith("}")
             for ln in scoped)
  assert "[%rd1" not in out and "[%rd3" not in out
  with pytest.raises(ValueError, match="at_use needs uses=None"):
    ptx.rewrite_tensormaps_by_value(_module(), "k", (0,), at_use=True)


def test_at_use_takes_a_map_loaded_again_next_to_its_use():
  """NVVM may load a map formal again next to a use (register pressure, the shared-expert sm_120a variants): with
  ``at_use`` each load's register must feed TMA instructions only, and every load goes; without it, two loads fail."""
  copy = "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1,"
  text = _module().replace(copy, "\tld.param.u64 \t%rd11, [k_param_0];\n" + copy.replace("%rd1,", "%rd11,"))
  out = ptx.rewrite_tensormaps_by_value(text, "k", (0, 2), uses=None, at_use=True)
  assert "[k_param_0]" not in out and "%rd11" not in out
  assert len([ln for ln in out.splitlines() if "cvta.param::entry.u64 %tmap, k_param_0" in ln]) == 2
  with pytest.raises(ptx.PtxError, match=r"k_param_0\) must be loaded exactly once, loaded 2 times"):
    ptx.rewrite_tensormaps_by_value(text, "k", (0, 2), uses=None)
  stray = text.replace("\tst.global.u32 \t[%rd2], %r2;", "\tst.global.u32 \t[%rd11], %r2;")
  with pytest.raises(ptx.PtxError, match=r"through %rd11, also used in 'st\.global"):
    ptx.rewrite_tensormaps_by_value(stray, "k", (0, 2), uses=None, at_use=True)


@pytest.mark.skipif(_PTXAS is None, reason="no ptxas on this machine")
def test_the_at_use_module_assembles():
  out = ptx.rewrite_tensormaps_by_value(_module(), "k", (0, 2), uses=None, at_use=True)
  assert ptx.assemble(out, "sm_90a", ptxas=_PTXAS)[:4] == b"\x7fELF"
