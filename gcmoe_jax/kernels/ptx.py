"""The PTX pipeline of paper §5.1: rewrites between CuTe DSL's PTX and ``ptxas``, and validation before assembly.

CuTe DSL emits PTX for the ISA of its bundled NVVM; the ``ptxas`` that assembles it may be older (the GPU machine's
CUDA 13.0 ``ptxas`` rejects ``.version 9.4``: DESIGN §5). Each rewrite here changes one directive and asserts that it
matched exactly once, so a compiler change that moves or duplicates a directive fails the build instead of producing
a silently different kernel. Validation checks the entry's formal parameters (count, order, types) against the
kernel ABI and that the instructions a role is built around are still in the PTX; a lost feature fails the build
with a message naming it.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from gcmoe_jax import geometry
from gcmoe_jax.kernels import abi

__all__ = ["PtxError", "PTX_ISA_OF_RELEASE", "ROLE2_FEATURES", "TMA", "TENSORMAP_BYTES", "WGMMA_BF16", "assemble",
           "ptxas_release", "role2_features", "rewrite_max_registers", "rewrite_min_ctas",
           "rewrite_tensormaps_by_value", "rewrite_version", "validate"]

# The PTX ISA version each CUDA release's ptxas accepts at most (PTX ISA release notes).
PTX_ISA_OF_RELEASE = {
  (12, 8): "8.7", (12, 9): "8.8", (13, 0): "9.0", (13, 1): "9.1", (13, 2): "9.2", (13, 3): "9.3", (13, 4): "9.4",
}
# What role 2 must contain, by (kernel generation, architecture) (§5.1): the instructions each build is made of, so a
# compiler change that drops one fails the build naming it. v2 on sm_120a: the block-scaled QMMA (the MMA seam)
# over the TMA producer's pipeline (the weight tile by TMA through a by-value TensorMap, the B rows by bulk copies,
# mbarrier waits) whose weight tile ldmatrix reads; on sm_90a: the exact int8 MMA over the per-thread cp.async
# pipeline, the producer measured faster there (roles_v2; `GCMOE_ABLATION=tma` builds the TMA one, validated with
# the sm_120a pipeline features).
TMA = "cp.async.bulk.tensor"  # the weight tiles, through the by-value TensorMaps
_TMA_PIPELINE = (TMA, "cp.async.bulk.shared::cluster.global", "mbarrier.try_wait.parity")
# The weight fragments: the compact tile (raw nibbles) by ldmatrix.b16, the expanded one (16U4_ALIGN16B slots) by
# ldmatrix's 4-bit unpack (sm_120a/sm_121a only), the FP4 operand paths of paper §4.3.
LDSM_COMPACT = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
LDSM_EXPANDED = "ldmatrix.sync.aligned.m8n16.x4.shared.b8x16.b4x16_p64"
_CPASYNC_PIPELINE = ("cp.async.cg.shared.global",)
_INT8_MMA = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"
_QMMA = "mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col.f32.e2m1.e4m3.f32.ue8m0"
# The BF16 wide passes' MMA (`abi.bf16_passes`; any n-tile count), a feature of the sm_90a builds that have them.
WGMMA_BF16 = "k16.f32.bf16.bf16"
ROLE2_FEATURES = {
  ("v2", "sm_90a"): (_INT8_MMA, *_CPASYNC_PIPELINE),
  ("v2+tma", "sm_90a"): (_INT8_MMA, *_TMA_PIPELINE),
  **{(gen, arch): (_QMMA, *_TMA_PIPELINE) for arch in ("sm_120a", "sm_121a") for gen in ("v2", "v2+tma")},
}


def role2_features(generation: str, arch: str, compact: bool = True) -> tuple[str, ...]:
  """The instructions role 2 of ``generation`` must contain on ``arch`` (none for the SIMT v1 kernels), with the
  compact FP4 weight tile (``compact``; sm_90a always) or the expanded one (sm_120a/sm_121a, `roles_v2`), whose
  fragments come from ldmatrix's 4-bit unpack."""
  features = ROLE2_FEATURES.get((generation, arch), ())
  if not features:
    return ()
  if not compact and not arch.startswith("sm_12"):
    raise ValueError(f"role2_features: the expanded FP4 path is sm_120a/sm_121a only, got arch {arch!r}")
  return (*features, LDSM_COMPACT if compact else LDSM_EXPANDED)


# The ABI's parameter types in PTX (13 pointers, then tokens and clamp).
ABI_PARAM_TYPES = (".u64",) * abi.NUM_POINTER_PARAMS + (".u32", ".f32")


def param_types(generation: str, role: int) -> tuple[str, ...]:
  """The formals of a role's entry after the §5.1 rewrites: the ABI's, and for role 2 of v2 its TensorMaps, by
  value (``.b8 NAME[128]``)."""
  maps = len(abi.ROLE2_TENSORMAPS) if generation == "v2" and role == 2 else 0
  return ABI_PARAM_TYPES + (".b8",) * maps

_VERSION_RE = re.compile(r"^\.version\s+(\d+\.\d+)\s*$", re.M)
_ENTRY_RE = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM_TYPE_RE = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?(\.[usbf]\d+)")


class PtxError(RuntimeError):
  """A rewrite that did not match exactly once, or a PTX module that lost a required feature."""


def _replace_once(ptx: str, pattern: re.Pattern, repl: str, what: str) -> str:
  out, n = pattern.subn(repl, ptx)
  if n != 1:
    raise PtxError(f"ptx: the {what} rewrite must match exactly once, matched {n} times")
  return out


def rewrite_version(ptx: str, version: str) -> str:
  """Sets ``.version`` to ``version`` (e.g. "9.0"): the ISA the target ptxas accepts (§5.1)."""
  if not re.fullmatch(r"\d+\.\d+", version):
    raise ValueError(f"rewrite_version: version must look like '9.0', got {version!r}")
  return _replace_once(ptx, _VERSION_RE, f".version {version}", ".version")


def _entry_directive(ptx: str, entry: str, directive: str, value: str) -> str:
  """Replaces (or adds after the parameter list) ``directive value`` of ``entry``; exactly one entry must match."""
  m = re.search(rf"(\.entry\s+{re.escape(entry)}\s*\(.*?\))(.*?)(\{{)", ptx, re.S)
  if m is None:
    raise PtxError(f"ptx: entry {entry!r} not found")
  head, directives = m.group(1), m.group(2)
  # [ \t] rather than \s around the directive: a rewrite must not eat the line breaks around it (idempotence).
  existing = re.findall(rf"^[ \t]*{re.escape(directive)}[ \t]+\d+[ \t]*$", directives, re.M)
  if len(existing) > 1:
    raise PtxError(f"ptx: entry {entry!r} declares {directive} {len(existing)} times")
  if existing:
    directives = re.sub(rf"^([ \t]*){re.escape(directive)}[ \t]+\d+[ \t]*$", rf"\g<1>{directive} {value}",
                        directives, flags=re.M)
  else:
    directives = directives.rstrip("\n") + f"\n{directive} {value}\n"
  return ptx[:m.start()] + head + directives + ptx[m.start(3):]


def rewrite_min_ctas(ptx: str, entry: str, ctas: int) -> str:
  """Sets ``.minnctapersm`` of ``entry`` to ``ctas`` (the co-resident CTAs c of eq. 4)."""
  if ctas < 1:
    raise ValueError(f"rewrite_min_ctas: ctas must be >= 1, got {ctas}")
  return _entry_directive(ptx, entry, ".minnctapersm", str(ctas))


def rewrite_max_registers(ptx: str, entry: str, ctas: int, threads: int) -> str:
  """Sets ``.maxnreg`` of ``entry`` to the register ceiling R_cap of eq. 4 (16-aligned; none at one CTA per SM)."""
  cap = geometry.register_cap(ctas, threads)
  if cap is None:
    return ptx
  return _entry_directive(ptx, entry, ".maxnreg", str(cap))


TENSORMAP_BYTES = 128  # a CUtensorMap: 128 bytes, 64-byte aligned (we align the formal to 128 as nvcc does)


def _entry_span(ptx: str, entry: str) -> tuple[int, int, int]:
  """(start of the parameter list, start of the body, end of the body) of ``entry``; exactly one must exist."""
  heads = list(re.finditer(rf"\.entry\s+{re.escape(entry)}\s*\(", ptx))
  if len(heads) != 1:
    raise PtxError(f"ptx: entry {entry!r} must appear exactly once, found {len(heads)}")
  params = heads[0].end()
  body = ptx.index("{", ptx.index(")", params))
  depth, i = 0, body
  while True:  # the body's closing brace: PTX nests { } for scoped declarations
    c = ptx[i]
    depth += (c == "{") - (c == "}")
    if depth == 0:
      return params, body, i
    i += 1


def rewrite_tensormaps_by_value(ptx: str, entry: str, indices: tuple[int, ...], *, uses: int | None = 2,
                                unused_ok: bool = False, at_use: bool = False) -> str:
  """Passes the TensorMaps of formals ``indices`` by value in the parameter space (§5.1).

  CuTe DSL passes a TensorMap as a pointer formal (``.param .u64 NAME``) that the kernel loads once
  (``ld.param.u64``/``.b64 %rdN, [NAME];``), so the first TMA through it misses the tensormap cache inside a
  replayed graph.
  The host instead puts the 128-byte descriptor in the argument vector: the formal becomes
  ``.param .align 128 .b8 NAME[128]`` and its load ``cvta.param::entry.u64 %rdN, NAME;`` (the generic address of
  the parameter), so every TMA instruction addresses the parameter space directly.

  Asserts, per map, that the formal is a ``.u64``, that it is loaded exactly once (with ``at_use``: at least once,
  every load's register checked the same way) and that the loaded register is
  used exactly ``uses`` times (the paper's "loaded once, used twice": a stronger check than counting formals, which
  fails if the compiler ever reuses a descriptor for a second purpose). ``uses=None``: any number of uses, each of
  them the TensorMap operand of a TMA instruction (role 2 issues its tile copies from one site per pass width).
  ``unused_ok``: a formal the kernel never loads (a timing build without the TMA path) only changes its declaration.
  ``at_use``: each use takes the map's address itself (a scoped register and a ``cvta.param::entry`` just before
  the instruction) instead of one register live from the entry on: role 2 issues its copies from inside a loop
  whose MMAs need every register (the sm_120a shared-expert variants spilled 16 B holding the two addresses).

  Raises:
    PtxError: naming the entry, the formal and what did not match.
  """
  if not indices or len(set(indices)) != len(indices):
    raise ValueError(f"rewrite_tensormaps_by_value: indices must be distinct formal indices, got {indices}")
  params_at, body_at, end = _entry_span(ptx, entry)
  head, body = ptx[params_at:body_at], ptx[body_at:end + 1]
  decls = [d.strip() for d in head[:head.rindex(")")].split(",")]
  for i in indices:
    if not 0 <= i < len(decls):
      raise PtxError(f"ptx: entry {entry} has {len(decls)} formals, no formal {i} to pass a TensorMap in")
    m = re.fullmatch(r"\.param\s+\.u64\s+(\w+)", decls[i])
    if m is None:
      raise PtxError(f"ptx: entry {entry} formal {i} must be a .u64 TensorMap pointer to pass it by value, got "
                     f"{decls[i]!r}")
    name = m.group(1)
    loads = list(re.finditer(rf"ld\.param\.[ub]64\s+(%\w+)\s*,\s*\[{re.escape(name)}\]\s*;", body))
    if not loads and unused_ok:
      head = _replace_once(head, re.compile(rf"\.param\s+\.u64\s+{re.escape(name)}(?![\w])"),
                           f".param .align {TENSORMAP_BYTES} .b8 {name}[{TENSORMAP_BYTES}]", f"{name} formal")
      continue
    if at_use and uses is not None:
      raise ValueError("rewrite_tensormaps_by_value: at_use needs uses=None (every use a TMA instruction)")
    # With at_use every use addresses the parameter itself, so the compiler may load the formal more than once
    # (NVVM rematerialises the load next to its uses under register pressure): each load's register is checked.
    if len(loads) != 1 and not (at_use and loads):
      raise PtxError(f"ptx: entry {entry} TensorMap formal {i} ({name}) must be loaded exactly once, loaded "
                     f"{len(loads)} times")
    for load in loads:
      reg = load.group(1)
      used = len(re.findall(rf"{re.escape(reg)}(?![\w])", body)) - 1
      if uses is None:
        lines = [ln.strip() for ln in body.splitlines() if re.search(rf"{re.escape(reg)}(?![\w])", ln)][1:]
        other = [ln for ln in lines if not ln.startswith((TMA, "prefetch.tensormap"))]
        if not lines or other:
          raise PtxError(f"ptx: entry {entry} TensorMap formal {i} ({name}) must be used only as the TensorMap "
                         f"operand of TMA instructions through {reg}, "
                         + (f"also used in {other[0]!r}" if other else "never used"))
      elif used != uses:
        raise PtxError(f"ptx: entry {entry} TensorMap formal {i} ({name}) must be used exactly {uses} times "
                       f"through {reg}, used {used} times")
    if at_use:
      for load in reversed(loads):
        body = body[:load.start()] + body[load.end():]
      regs = "|".join(re.escape(load.group(1)) for load in loads)
      body = re.sub(rf"^([ \t]*)((?:{re.escape(TMA)}|prefetch\.tensormap)[^\n]*?)({regs})(?![\w])([^\n]*)$",
                    lambda m: f"{m.group(1)}{{ .reg .b64 %tmap; cvta.param::entry.u64 %tmap, {name}; "
                              f"{m.group(2)}%tmap{m.group(4)} }}", body, flags=re.M)
    else:
      reg = loads[0].group(1)
      body = body[:loads[0].start()] + f"cvta.param::entry.u64 {reg}, {name};" + body[loads[0].end():]
    head = _replace_once(head, re.compile(rf"\.param\s+\.u64\s+{re.escape(name)}(?![\w])"),
                         f".param .align {TENSORMAP_BYTES} .b8 {name}[{TENSORMAP_BYTES}]", f"{name} formal")
  return ptx[:params_at] + head + body + ptx[end + 1:]


@dataclasses.dataclass(frozen=True)
class EntryInfo:
  name: str
  param_types: tuple[str, ...]


def entries(ptx: str) -> list[EntryInfo]:
  out = []
  for name, body in _ENTRY_RE.findall(ptx):
    types = tuple(_PARAM_TYPE_RE.search(p).group(1) if _PARAM_TYPE_RE.search(p) else "?"
                  for p in body.split(",") if p.strip())
    out.append(EntryInfo(name, types))
  return out


def validate(ptx: str, *, role: int, arch: str, features: tuple[str, ...] = (),
             param_types: tuple[str, ...] = ABI_PARAM_TYPES) -> EntryInfo:
  """Checks one role's PTX before assembly.

  Args:
    ptx: the module (exactly one ``.entry``).
    role: 1, 2 or 3.
    arch: "sm_90a", "sm_120a" or "sm_121a"; the ``.target`` must say so.
    features: instructions role 2 must still contain (`role2_features`).
    param_types: the formal parameter types, in order (default: the kernel ABI).

  Raises:
    PtxError: naming the entry count, the first formal that differs, the target, or the lost instruction.
  """
  found = entries(ptx)
  if len(found) != 1:
    raise PtxError(f"ptx: role {role} must hold exactly one .entry, found {len(found)}: {[e.name for e in found]}")
  e = found[0]
  names = abi.PARAMS + abi.ROLE2_TENSORMAPS
  if len(e.param_types) != len(param_types):
    raise PtxError(f"ptx: role {role} entry {e.name} has {len(e.param_types)} formals, the ABI has "
                   f"{len(param_types)} ({', '.join(names[:len(param_types)])})")
  for i, (got, want) in enumerate(zip(e.param_types, param_types)):
    if got != want:
      raise PtxError(f"ptx: role {role} entry {e.name} formal {i} ({names[i]}) is {got}, the ABI says {want}")
  target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
  if target is None or target.group(1).rstrip(",") != arch:
    raise PtxError(f"ptx: role {role} targets {target.group(1) if target else 'nothing'}, expected {arch}")
  if role == 2:
    for feature in features:
      if feature not in ptx:
        raise PtxError(f"ptx: role 2 for {arch} lost `{feature}` (the compiler or a rewrite dropped it)")
  return e


def ptxas_release(ptxas: str) -> tuple[int, int]:
  """The CUDA release of a ``ptxas`` binary, from ``ptxas --version``."""
  out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
  m = re.search(r"release (\d+)\.(\d+)", out)
  if m is None:
    raise PtxError(f"ptx: cannot read the release of {ptxas} from {out!r}")
  return int(m.group(1)), int(m.group(2))


def assemble(ptx: str, arch: str, *, ptxas: str | None = None, report: dict | None = None) -> bytes:
  """Assembles PTX to a cubin with ``ptxas`` (default: the one on PATH, else /usr/local/cuda), after the version
  rewrite it needs. ``report``: filled with ptxas's ``stack_frame``, ``spill_stores`` and ``spill_loads`` (bytes)
  of the module's entry (a stack frame is not always spills: sm_120a reserves 8 B for a by-value TensorMap).

  Raises:
    PtxError: no ptxas, an unknown release, or ptxas failing (its message included).
  """
  ptxas = ptxas or shutil.which("ptxas") or next(
    (p for p in ("/usr/local/cuda/bin/ptxas",) if Path(p).is_file()), None)
  if ptxas is None:
    raise PtxError("ptx: no ptxas on PATH (install a CUDA toolkit or the nvidia-cuda-nvcc wheel, or pass ptxas=)")
  release = ptxas_release(ptxas)
  isa = PTX_ISA_OF_RELEASE.get(release)
  if isa is None:
    raise PtxError(f"ptx: unknown ptxas release {release[0]}.{release[1]} (known: "
                   f"{', '.join(f'{a}.{b}' for a, b in PTX_ISA_OF_RELEASE)})")
  current = _VERSION_RE.search(ptx)
  if current is not None and tuple(map(int, current.group(1).split("."))) > tuple(map(int, isa.split("."))):
    ptx = rewrite_version(ptx, isa)
  with tempfile.TemporaryDirectory() as tmp:
    src, dst = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
    src.write_text(ptx)
    r = subprocess.run([ptxas, f"-arch={arch}", *(["-v"] if report is not None else []), "-o", str(dst), str(src)],
                       capture_output=True, text=True)
    if r.returncode != 0:
      raise PtxError(f"ptx: ptxas {release[0]}.{release[1]} failed for {arch}: {r.stderr.strip()[:2000]}")
    if report is not None:
      m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", r.stdout + r.stderr)
      if m is None:
        raise PtxError(f"ptx: ptxas {release[0]}.{release[1]} -v printed no stack/spill line for {arch}")
      report.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    return dst.read_bytes()
