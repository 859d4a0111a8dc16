"""Kernel variants: compile the role kernels to cubins, cache them with a manifest, and find them again.

A variant (`Variant`) is what the role kernels specialise on: H, I, E, k, the token capacity and the shared expert.
`compile_variant` compiles the three roles of the kernel generation in use (`generation`: `roles_v2` by default,
`roles_v1` with ``GCMOE_KERNELS=v1``) for one architecture with CuTe DSL (no GPU needed) and stores, under
``<cache>/<key>/``:

* ``role{1,2,3}.cubin`` and ``role{1,2,3}.ptx``;
* ``meta.json``: the architecture, the ``nvidia-cutlass-dsl*`` versions, the SHA-256 of the kernel sources, the
  variant, the workspace layout, and per role the cubin, the PTX entry symbol, the launch
  configuration (block, grid hint, dynamic SMEM), the static SMEM, registers, local memory, and the parameters as
  the PTX declares them.

The key is ``<variant.key>-<arch>-<generation>-<first 12 hex of the source SHA-256>``; a cached directory is
reused only when its ``meta.json`` names the installed CuTe DSL versions. Builds go to a temporary directory that is
renamed into place, so readers never see half a build. A build fails, naming the role and the variant, when the
PTX entry does not declare exactly the ABI's parameters (`abi.PARAMS`) or the kernel uses local memory (spills;
`_SPILL_BUDGET` for the two-CTA role 2).

`load_or_build` is what the runtime calls: from ``$GCMOE_CUBIN_DIR`` when set (cubins built elsewhere, e.g. by
``python -m gcmoe_jax build-kernels``), else from the local cache, compiling with CuTe DSL when it is installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import struct
import tempfile
import time
from typing import Any

from gcmoe_jax import _config, geometry
from gcmoe_jax.kernels import abi

__all__ = [
  "ARCHS",
  "CUBIN_DIR_ENV",
  "BuildError",
  "BuiltVariant",
  "Variant",
  "cache_key",
  "compile_variant",
  "default_cache_dir",
  "dsl_versions",
  "load_or_build",
  "parse_ptx_entry",
  "source_sha256",
]

ARCHS = ("sm_90a", "sm_120a", "sm_121a")
CUBIN_DIR_ENV = "GCMOE_CUBIN_DIR"
MANIFEST = "meta.json"
MANIFEST_FORMAT = 1
NUM_ROLES = 3
ROLE_TITLES = ("dispatch", "compute", "finalize")
# Grid hints in the runtime's convention (0 = the runtime's choice): role 1 needs one CTA (block 0 works, others
# return); roles 2 and 3 take any grid (role 2 reads %nctaid.x, role 3 strides tokens over blocks).
GRID_HINTS = (1, 0, 0)
# What the cubins are made of (the source hash).
_KERNEL_SOURCES = ("roles_v1.py", "roles_v2.py", "abi.py", "bf16fold.py")
_DSL_PREFIX = "nvidia-cutlass-dsl"
# PTX parameter types of the ABI: 13 pointers, then tokens (int32) and clamp (float32).
_PTX_PARAM_TYPES = (".u64",) * abi.NUM_POINTER_PARAMS + (".u32", ".f32")
_PTX_TYPE_BYTES = {".u64": 8, ".u32": 4, ".f32": 4, ".s32": 4, ".b32": 4, ".b64": 8, ".b8": 1}
_STATIC_SMEM_LIMIT = 48 * 1024  # static __shared__ above this needs dynamic SMEM
# Spilled bytes a role may have (ptxas's spill stores). Role 2 of the two-CTA variants runs at a 128-register cap:
# ptxas spills 16-32 B there in the variants of 16-row passes (up to 40 B with the TMA producer on sm_90a); every
# other kernel must not spill, but for those of 32-row passes (`abi.PASS_TIERS`: the 4-n-tile body's fragments and
# accumulators): 64-144 B (`_WIDE_SPILL_BUDGET`), of which the stage loops reload at most one word per ~2200
# instructions and the shared expert's halves steps four per ~1030 (docs/probes/sass_loops.py, docs/kernels_v2.md
# "Pass width by rows per expert").
_SPILL_BUDGET = {2: 48}
_WIDE_SPILL_BUDGET = {2: 160}
# The fused transport's variants with a shared expert (`--preset fused`: the small shape at R = 2) carry both the
# transport's state and the shared expert's: 52 B at the small shape (since session 45 at least; found in session 48,
# when `--preset fused` stopped at it), none of it reloaded in an innermost loop (docs/probes/sass_loops.py).
_FUSED_SHARED_SPILL_BUDGET = {2: 64}
# One CTA per SM (255 registers) with the BF16 wide passes (`abi.bf16_passes`): the small shape's shared variants at
# capacity 256 spill 12 B (session 60; with one block sum in flight 64-72 B), reloaded in none of the kernel's loops
# (docs/probes/sass_loops.py: no local access in any innermost loop or MMA loop); every other one-CTA build none.
_BF16_ONE_CTA_SPILL_BUDGET = {2: 16}
# A `GCMOE_ABLATION` build (timing or diagnostic, never loaded by a normal run: the ablation is in its key) may spill
# more, at one CTA per SM too: the timeline's stamps cost the shared-expert two-CTA role 2 ~100 B, an ablation's
# changed code a stack slot (`twoplane`'s one-CTA shared variant 8 B since session 23; its meta.json and the build
# report still record the spills), `bf16two`'s two BF16 block sums in flight at two CTAs per SM 236 B at the small
# shape's capacity 64 (the paper shapes' 148-164 B; by default one there, 92-136 B).
_ABLATION_SPILL_BUDGET = {2: 256}
# The stack frame ptxas gives an sm_120a kernel that issues TMA through a by-value TensorMap, without spilling (nvcc's
# own __grid_constant__ CUtensorMap kernels show it too; sm_90a has none).
_TENSORMAP_FRAME = 8


def spill_frame(spills: int) -> int:
  """The most stack frame ``spills`` bytes of ptxas spill stores take: 8-byte aligned, and an 8-byte slot after an
  odd number of 4-byte ones leaves a 4-byte hole (GLM5.2 T8 shared role 2, session 23: 32 B of spills at offsets
  0-0x24 with 0xc unused, a 40 B frame). More than that is a stack object that is not a spill."""
  return -(-(spills + 4) // 8) * 8 if spills else 0


class BuildError(RuntimeError):
  """A variant that cannot be built, or whose cubins cannot be found."""


@dataclasses.dataclass(frozen=True)
class Variant:
  """What the role kernels specialise on (static per cubin); ``tokens`` and ``clamp`` are runtime parameters.

  Attributes:
    hidden, intermediate: H and I of the routed experts (multiples of 128; Table 10 ranges).
    experts: E, the local experts (ids in [0, E)).
    top_k: k.
    capacity: TCAP, the most tokens one call may carry (sizes the workspace).
    shared_intermediate, shared_group: Is and the shared expert's scale group (32 or 128), or None without one.
    ranks: R, the ranks of the fused expert-parallel transport (docs/fused_transport.md): 1 (the default) is the
      local operator; R > 1 builds kernels that pull rows from R - 1 peers and return their outputs (``experts``
      is then the local L, global ids in [0, L R), ``capacity`` the tokens of one rank).
    relay: with R > 1, the relay return path (paper §4.6: GEMM2 rows parked in a local position-major arena,
      copied to their owners by R copier CTAs of role 2) instead of the direct one.
  """

  hidden: int
  intermediate: int
  experts: int
  top_k: int
  capacity: int
  shared_intermediate: int | None = None
  shared_group: int | None = None
  ranks: int = 1
  relay: bool = False

  def __post_init__(self):
    problems = []
    for name, lo, hi in (("hidden", 512, 8192), ("intermediate", 256, 4096)):
      v = getattr(self, name)
      if not _is_int(v) or v % 128 or not lo <= v <= hi:
        problems.append(f"{name} must be a multiple of 128 in [{lo}, {hi}] (Table 10), got {v!r}")
    for name in ("experts", "top_k", "capacity"):
      v = getattr(self, name)
      if not _is_int(v) or v < 1:
        problems.append(f"{name} must be a positive int, got {v!r}")
    if not _is_int(self.ranks) or not 1 <= self.ranks <= abi.MAX_RANKS:
      problems.append(f"ranks must be an int in [1, {abi.MAX_RANKS}], got {self.ranks!r}")
    if self.relay not in (False, True) or (self.relay and self.ranks < 2):
      problems.append(f"relay must be a bool and needs ranks > 1, got relay={self.relay!r} with ranks={self.ranks!r}")
    if (self.shared_intermediate is None) != (self.shared_group is None):
      problems.append(f"shared_intermediate and shared_group must both be set or both be None, got "
                      f"{self.shared_intermediate!r} and {self.shared_group!r}")
    elif self.shared_intermediate is not None:
      s = self.shared_intermediate
      if not _is_int(s) or s % 128 or not 256 <= s <= 4096:
        problems.append(f"shared_intermediate must be a multiple of 128 in [256, 4096] (Table 10), got {s!r}")
      if self.shared_group not in (32, 128):
        problems.append(f"shared_group must be 32 or 128, got {self.shared_group!r}")
    if problems:
      raise ValueError("Variant: " + "; ".join(problems))

  @classmethod
  def parse(cls, text: str) -> Variant:
    """``"H,I,E,k,TCAP[,Is,group][,rR[relay]]"`` (the CLI's ``--variant``; ``rR``: R ranks of the fused transport,
    ``rRrelay``: with the relay return path)."""
    parts = text.split(",")
    ranks, relay = 1, False
    try:
      if parts and parts[-1].startswith("r"):
        tail = parts.pop()[1:]
        relay = tail.endswith("relay")
        ranks = int(tail.removesuffix("relay"))
      values = [int(p) for p in parts]
    except ValueError:
      raise ValueError(f"Variant.parse: expected H,I,E,k,TCAP[,Is,group][,rR] (ints), got {text!r}") from None
    if len(values) not in (5, 7):
      raise ValueError(f"Variant.parse: expected 5 or 7 comma-separated ints H,I,E,k,TCAP[,Is,group], then "
                       f"optionally rR, got {text!r}")
    if len(values) == 5:
      values += [None, None]
    return cls(*values, ranks, relay)

  @property
  def shared(self) -> bool:
    return self.shared_intermediate is not None

  @property
  def key(self) -> str:
    """A file-name-safe name, e.g. ``h512_i256_e8_k4_t16`` or ``h512_i256_e8_k4_t16_s256g128``."""
    k = f"h{self.hidden}_i{self.intermediate}_e{self.experts}_k{self.top_k}_t{self.capacity}"
    k += f"_s{self.shared_intermediate}g{self.shared_group}" if self.shared else ""
    return k + (f"_r{self.ranks}" if self.ranks > 1 else "") + ("relay" if self.relay else "")

  def workspace(self, kernels: str | None = None) -> abi.Workspace:
    """The workspace layout the role kernels of generation ``kernels`` (default: `generation()`) index."""
    v2 = (kernels or generation()) == "v2"
    return abi.workspace_layout(self.experts, self.capacity, self.top_k, self.hidden, self.shared,
                                self.intermediate if v2 else 0, (self.shared_intermediate or 0) if v2 else 0,
                                self.ranks if v2 else 1, self.relay and v2,
                                bf16=v2 and abi.bf16_passes(self.capacity, self.top_k, self.experts, self.ranks,
                                                            _config.kernel_ablation()),
                                shared_bf16=v2 and abi.shared_bf16(self.shared, self.ranks, _config.kernel_ablation()))

  def to_dict(self) -> dict[str, int | None]:
    return dataclasses.asdict(self)


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class BuiltVariant:
  """The cubins of one (arch, variant) on disk: ``directory`` holds them and ``meta`` (its ``meta.json``)."""

  directory: pathlib.Path
  meta: dict[str, Any]

  def role(self, r: int) -> dict[str, Any]:
    """The manifest entry of role r (1, 2 or 3)."""
    return self.meta["roles"][r - 1]

  def tensormap_fields(self) -> tuple[int, ...]:
    """Role 2's TensorMaps as the runtime takes them (`abi.tensormap_fields`, flattened; empty for v1)."""
    return tuple(f for m in self.role(2).get("tensormaps", []) for f in abi.tensormap_fields(m))

  def cubin(self, r: int) -> bytes:
    return (self.directory / self.role(r)["cubin"]).read_bytes()

  def launch(self, r: int, compute_sms: int = 0) -> tuple[int, int, int]:
    """(grid hint, block, dynamic SMEM bytes) of role r, in the runtime's convention (grid 0 = its choice: one CTA
    per compute SM). A role built for several CTAs per SM gets that many per compute SM when ``compute_sms`` is
    given."""
    e = self.role(r)
    ctas = e.get("ctas_per_sm", 1)
    grid = ctas * compute_sms if e["grid"] == 0 and ctas > 1 and compute_sms > 0 else e["grid"]
    return grid, e["block"], e["dynamic_smem"]

  def dispatch_grid(self, dispatch_sms: int) -> int:
    """Role 1's grid on ``dispatch_sms`` SMs where the variant spreads it over the partition (the fused
    transport's pulls): the CTAs per SM it was built for, on each."""
    return self.role(1).get("ctas_per_sm", 1) * dispatch_sms


# ---------------------------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------------------------


def dsl_versions() -> dict[str, str]:
  """Installed ``nvidia-cutlass-dsl*`` distributions and their versions ({} without CuTe DSL)."""
  out = {}
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name.startswith(_DSL_PREFIX):
      out[name] = dist.version
  return dict(sorted(out.items()))


def generation() -> str:
  """The role-kernel generation in use: ``GCMOE_KERNELS`` (v2 by default, v1 the SIMT reference kernels)."""
  return _config.get("GCMOE_KERNELS")


def source_sha256() -> str:
  """SHA-256 over the kernel sources (`_KERNEL_SOURCES`), in that order."""
  h = hashlib.sha256()
  here = pathlib.Path(__file__).resolve().parent
  for name in _KERNEL_SOURCES:
    h.update(name.encode() + b"\0")
    h.update((here / name).read_bytes())
  return h.hexdigest()


def cache_key(arch: str, variant: Variant) -> str:
  """``<variant.key>-<arch>-<generation>-<source SHA-256[:12]>``: the directory of one build."""
  _check_arch(arch)
  ablation = _config.get("GCMOE_ABLATION")
  return f"{variant.key}-{arch}-{generation()}{'+' + ablation if ablation else ''}-{source_sha256()[:12]}"


def default_cache_dir() -> pathlib.Path:
  """``$XDG_CACHE_HOME/gcmoe_jax/cubins`` (``~/.cache/gcmoe_jax/cubins``)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "gcmoe_jax" / "cubins"


def _check_arch(arch: str) -> None:
  if arch not in ARCHS:
    raise ValueError(f"build: arch must be one of {ARCHS}, got {arch!r}")


# ---------------------------------------------------------------------------------------------------------------
# PTX and cubin inspection
# ---------------------------------------------------------------------------------------------------------------

_ENTRY_RE = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\((.*?)\)", re.DOTALL)
_PARAM_RE = re.compile(r"\.param\s+(.*?)\s+([A-Za-z_$][\w$]*)(?:\[(\d+)\])?\s*$")
_REQNTID_RE = re.compile(r"\.reqntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)")


def parse_ptx_entry(ptx: str) -> dict[str, Any]:
  """The single ``.entry`` of a PTX module: {name, params: [{decl, type, bytes}], reqntid}.

  Raises:
    BuildError: if the module does not hold exactly one entry.
  """
  entries = _ENTRY_RE.findall(ptx)
  if len(entries) != 1:
    raise BuildError(f"build: expected exactly one .entry in the PTX, found {len(entries)}: "
                     f"{[name for name, _ in entries]}")
  name, body = entries[0]
  params = []
  for line in body.split(","):
    m = _PARAM_RE.search(line.strip())
    if m is None:
      raise BuildError(f"build: cannot parse the PTX parameter declaration {line.strip()!r} of {name}")
    decl = m.group(1)
    ptx_type = next((t for t in decl.split() if t in _PTX_TYPE_BYTES), None)
    count = int(m.group(3)) if m.group(3) else 1  # a by-value TensorMap: .b8 NAME[128]
    size = _PTX_TYPE_BYTES.get(ptx_type)
    params.append({"decl": f".param {decl}", "type": ptx_type, "bytes": size * count if size else None})
  reqntid = _REQNTID_RE.search(ptx)
  return {"name": name, "params": params, "reqntid": [int(g) for g in reqntid.groups()] if reqntid else None}


def _elf_sections(data: bytes) -> dict[str, tuple[int, int]]:
  """ELF64 section name -> (file offset, size)."""
  shoff, = struct.unpack_from("<Q", data, 0x28)
  shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
  raw = []
  for i in range(shnum):
    name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
    raw.append((name, off, size))
  strtab = raw[shstrndx][1]
  out = {}
  for name, off, size in raw:
    end = data.index(b"\0", strtab + name)
    out[data[strtab + name:end].decode()] = (off, size)
  return out


# EIATTR codes of the cubin's global .nv.info section (attribute format 0x04: 4-byte symbol index, 4-byte value).
_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_FORMAT_SVAL = 0x04


def cubin_resources(cubin: bytes, entry: str) -> dict[str, int]:
  """{registers, local_bytes (stack frame: spills), static_smem} of the kernel ``entry`` in a cubin."""
  secs = _elf_sections(cubin)
  out = {"registers": -1, "local_bytes": -1, "static_smem": 0}
  if ".nv.info" in secs:
    off, size = secs[".nv.info"]
    i = off
    while i + 4 <= off + size:
      fmt, attr, length = cubin[i], cubin[i + 1], struct.unpack_from("<H", cubin, i + 2)[0]
      if fmt == _EIATTR_FORMAT_SVAL:
        if length == 8 and attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE):
          value = struct.unpack_from("<I", cubin, i + 8)[0]
          out["registers" if attr == _EIATTR_REGCOUNT else "local_bytes"] = value
        i += 4 + length
      else:
        i += 4
  smem = secs.get(f".nv.shared.{entry}")
  if smem is not None:
    out["static_smem"] = smem[1]
  return out


def _check_role(role: int, variant: Variant, arch: str, entry: dict[str, Any], res: dict[str, int],
                ctas: int = 1, maps: int = 0, pass_tiles: int = 2, bf16: bool = False) -> None:
  from gcmoe_jax.kernels import roles_v1

  where = f"role {role} ({ROLE_TITLES[role - 1]}) of {variant.key} for {arch}"
  types = tuple(p["type"] for p in entry["params"])
  types = types[:len(types) - maps]  # role 2's TensorMaps follow the ABI's formals (validated by ptx.validate)
  if types != _PTX_PARAM_TYPES:
    raise BuildError(f"build: {where}: the PTX entry {entry['name']} declares {len(types)} parameters "
                     f"{[p['decl'] for p in entry['params']]}, expected the ABI's {len(_PTX_PARAM_TYPES)} "
                     f"{list(abi.PARAMS)} of PTX types {list(_PTX_PARAM_TYPES)} (gcmoe_jax/kernels/abi.py)")
  if entry["reqntid"] != [roles_v1.THREADS, 1, 1]:
    raise BuildError(f"build: {where}: .reqntid {entry['reqntid']}, expected [{roles_v1.THREADS}, 1, 1]")
  if res["local_bytes"] < 0:
    raise BuildError(f"build: {where}: the cubin's .nv.info has no EIATTR_FRAME_SIZE for {entry['name']}; cannot "
                     f"check local memory (cubin format changed?)")
  spills = res.get("spill_bytes", res["local_bytes"])
  ablation = bool(_config.get("GCMOE_ABLATION"))
  budgets = _SPILL_BUDGET if pass_tiles <= 2 else _WIDE_SPILL_BUDGET  # (n-tiles of role 2's widest pass)
  if variant.ranks > 1 and variant.shared_intermediate and pass_tiles <= 2:
    budgets = _FUSED_SHARED_SPILL_BUDGET
  one_cta = _BF16_ONE_CTA_SPILL_BUDGET.get(role, 0) if bf16 else 0
  budget = _ABLATION_SPILL_BUDGET.get(role, 0) if ablation else budgets.get(role, 0) if ctas > 1 else one_cta
  if spills > budget:
    raise BuildError(f"build: {where}: the kernel spills {spills} B of registers to local memory with "
                     f"{res['registers']} registers; the kernels must not spill (role {role} at {ctas} CTA(s) per "
                     f"SM: at most {budget} B{' in an ablation build' if ablation else ''})")
  frame = spill_frame(spills) + (_TENSORMAP_FRAME if maps and arch.startswith("sm_12") else 0)
  if ablation and ctas > 1:
    frame = max(frame + 8, _SPILL_BUDGET.get(role, 0))  # a timing or diagnostic build may take a stack slot
  if res["local_bytes"] > frame:
    raise BuildError(f"build: {where}: the kernel uses {res['local_bytes']} B of local memory (a stack frame) and "
                     f"spills {spills} B; at most {frame} B of frame is expected")
  if res["static_smem"] > _STATIC_SMEM_LIMIT:
    raise BuildError(f"build: {where}: {res['static_smem']} B of static SMEM exceeds {_STATIC_SMEM_LIMIT}")


# ---------------------------------------------------------------------------------------------------------------
# Compile
# ---------------------------------------------------------------------------------------------------------------


def _finalize_ctas(arch: str, variant: Variant) -> int:
  """The finalize's ``.minnctapersm`` on SM120 (§5.1 "finalize occupancy"): the CTAs per SM the geometry's finalize
  grid is planned with (`geometry.plan` on the RTX PRO 5000 at B = the variant's capacity); 1 elsewhere (Hopper
  keeps CuTe's directive, as its verified builds have)."""
  if not arch.startswith("sm_12"):
    return 1
  p = geometry.Problem(R=1, E=variant.experts, k=variant.top_k, B=variant.capacity, H=variant.hidden,
                       I=variant.intermediate, shared=variant.shared, shared_I=variant.shared_intermediate)
  return geometry.plan(p, device=geometry.RTX_PRO_5000).launch.finalize_ctas_per_sm


def _compile_roles(arch: str, variant: Variant, out: pathlib.Path) -> list[dict[str, Any]]:
  """Compiles the three roles into ``out``; returns the manifest's role entries."""
  from cutlass import Float32, Int32, Int64, Uint8, cute
  from cutlass.cute.runtime import make_ptr

  from gcmoe_jax.kernels import roles_v1, roles_v2

  from gcmoe_jax.kernels import ptx as ptx_pipeline

  gen = generation()
  try:
    kernels = roles_v2.RoleKernelsV2(variant, arch) if gen == "v2" else roles_v1.RoleKernelsV1(variant)
  except ValueError as err:  # the variant does not fit the target (SMEM)
    raise BuildError(f"build: {err}") from err
  # Fake arguments: the pointers' values do not matter when compiling, their type (global, 16-byte aligned) does.
  ptrs = [make_ptr(Uint8, 0, cute.AddressSpace.gmem, assumed_align=roles_v1.POINTER_ALIGN)
          for _ in range(abi.NUM_POINTER_PARAMS)]
  entries = []
  for r, launch in enumerate((kernels.launch_role1, kernels.launch_role2, kernels.launch_role3), start=1):
    dump = out / f".dump{r}"
    dump.mkdir()
    t0 = time.perf_counter()
    maps = kernels.tensormaps() if r == 2 and gen == "v2" else []
    cute.compile(launch, *ptrs, Int32(0), Float32(0.0), *[Int64(0) for _ in maps],
                 options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump}")
    seconds = time.perf_counter() - t0
    ptx_files, cubin_files = sorted(dump.glob("*.ptx")), sorted(dump.glob("*.cubin"))
    if len(ptx_files) != 1 or len(cubin_files) != 1:
      raise BuildError(f"build: role {r} of {variant.key} for {arch}: CuTe DSL left {len(ptx_files)} PTX and "
                       f"{len(cubin_files)} cubin files in {dump}, expected one each")
    ptx_name, cubin_name = f"role{r}.ptx", f"role{r}.cubin"
    ptx_files[0].rename(out / ptx_name)
    cubin_files[0].rename(out / cubin_name)
    shutil.rmtree(dump)
    ptx = (out / ptx_name).read_text()
    cubin = (out / cubin_name).read_bytes()
    entry = parse_ptx_entry(ptx)
    ctas = kernels.ctas_per_sm(r)
    bf16 = getattr(kernels, "bf16", False)  # (the BF16 wide passes: a required feature, a spill budget)
    directive = _finalize_ctas(arch, variant) if r == 3 and gen == "v2" else ctas
    ablation = _config.get("GCMOE_ABLATION")  # a timing build leaves instructions out or changes them on purpose
    if maps:
      # §5.1: the TensorMaps by value in the parameter space (CuTe DSL declares them as 64-bit formals). The
      # per-thread cp.async producer (sm_90a) never loads them: the formals stay, by value, so the ABI is one.
      first = len(abi.PARAMS)
      try:
        ptx = ptx_pipeline.rewrite_tensormaps_by_value(ptx, entry["name"], tuple(range(first, first + len(maps))),
                                                       uses=None, unused_ok=not kernels.tma, at_use=True)
      except ptx_pipeline.PtxError as err:
        raise BuildError(f"build: role {r} of {variant.key} for {arch}: {err}") from err
    if ctas > 1 or directive > 1:
      # Several CTAs per SM: the §5.1 rewrites (.minnctapersm, and the eq. 4 register ceiling of the CTAs the
      # kernel is built to co-schedule: none for the finalize, whose directive is the paper's "finalize occupancy")
      # and an assembly with the local ptxas (CuTe DSL queries a GPU for min_blocks_per_mp > 1, and there may be
      # none here).
      ptx = ptx_pipeline.rewrite_min_ctas(ptx, entry["name"], directive)
      ptx = ptx_pipeline.rewrite_max_registers(ptx, entry["name"], ctas, roles_v1.THREADS)
    report: dict[str, int] = {}
    if ctas > 1 or directive > 1 or maps:
      cubin = ptx_pipeline.assemble(ptx, arch, report=report)
      (out / ptx_name).write_text(ptx)
      (out / cubin_name).write_bytes(cubin)
    # §5.1 validation of the PTX that was assembled: one entry, the ABI's formals, the target, and role 2's
    # instructions (a lost feature fails the build naming it).
    try:
      features = ptx_pipeline.role2_features(gen + ("+tma" if ablation == "tma" else ""), arch,
                                             compact=getattr(kernels, "compact", True))
      features += (ptx_pipeline.WGMMA_BF16,) if bf16 else ()
      ptx_pipeline.validate(ptx, role=r, arch=arch, features=features if ablation in ("", "tma") else (),
                            param_types=ptx_pipeline.param_types(gen, r))
    except ptx_pipeline.PtxError as err:
      raise BuildError(f"build: role {r} of {variant.key} for {arch}: {err}") from err
    res = cubin_resources(cubin, entry["name"])
    # Spills as ptxas reported them where we assembled; else the whole stack frame counts as spills.
    res["spill_bytes"] = report.get("spill_stores", res["local_bytes"])
    _check_role(r, variant, arch, entry, res, ctas, len(maps), getattr(kernels, "nt_max", 2), bf16)
    entries.append({
      "role": r,
      "title": ROLE_TITLES[r - 1],
      "cubin": cubin_name,
      "ptx": ptx_name,
      "entry": entry["name"],
      "block": roles_v1.THREADS,
      "grid": GRID_HINTS[r - 1],
      "dynamic_smem": kernels.dynamic_smem(r),
      "ctas_per_sm": kernels.ctas_per_sm(r),
      "minnctapersm": directive,
      "static_smem": res["static_smem"],
      "registers": res["registers"],
      "local_bytes": res["local_bytes"],
      "spill_bytes": res["spill_bytes"],
      "params": [dict(name=n, **p) for n, p in zip(abi.PARAMS + abi.ROLE2_TENSORMAPS[:len(maps)],
                                                    parse_ptx_entry(ptx)["params"])],
      "tensormaps": maps,
      "cubin_bytes": len(cubin),
      "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
      "compile_seconds": round(seconds, 3),
    })
    if r == 2 and hasattr(kernels, "compact"):  # v2: the FP4 operand path of role 2's weight tile (paper §4.3)
      entries[-1]["fp4_weights"] = "compact" if kernels.compact else "expanded"
  return entries


def _read_meta(directory: pathlib.Path) -> dict[str, Any] | None:
  try:
    return json.loads((directory / MANIFEST).read_text())
  except (OSError, ValueError):
    return None


def compile_variant(arch: str, variant: Variant, *, cache_dir: str | os.PathLike | None = None,
                    force: bool = False) -> dict[str, Any]:
  """Compiles roles 1-3 of ``variant`` for ``arch`` into ``<cache>/<key>/`` and returns its manifest.

  Reuses an existing build of the same key made with the installed CuTe DSL versions unless ``force``.

  Args:
    arch: "sm_90a" or "sm_120a".
    variant: the static shape.
    cache_dir: where builds live (default `default_cache_dir`).
    force: rebuild even if a matching build exists.

  Returns:
    The manifest (``meta.json``) plus ``"directory"``, the build's absolute path.

  Raises:
    ImportError: without CuTe DSL (``nvidia-cutlass-dsl``).
    BuildError: when a role fails the PTX or local-memory checks.
  """
  _check_arch(arch)
  cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
  cache.mkdir(parents=True, exist_ok=True)
  key = cache_key(arch, variant)
  final = cache / key
  versions = dsl_versions()
  meta = _read_meta(final)
  if meta is not None and not force and meta.get("cutlass_dsl") == versions:
    return {**meta, "directory": str(final.resolve())}
  import cutlass  # noqa: F401  (ImportError here names the missing package)

  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache))
  try:
    t0 = time.perf_counter()
    roles = _compile_roles(arch, variant, tmp)
    meta = {
      "format": MANIFEST_FORMAT,
      "key": key,
      "arch": arch,
      "cutlass_dsl": versions,
      "source_sha256": source_sha256(),
      "sources": list(_KERNEL_SOURCES),
      "variant": variant.to_dict(),
      "workspace": dataclasses.asdict(variant.workspace()),
      "abi_params": list(abi.PARAMS),
      "roles": roles,
      "build_seconds": round(time.perf_counter() - t0, 3),
      "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / MANIFEST).write_text(json.dumps(meta, indent=1) + "\n")
    tmp.chmod(0o755)  # mkdtemp makes it private; a build is meant to be copied and shared
    if final.exists():  # a stale build (other DSL versions, or force): move it aside, then drop it
      stale = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}.stale.", dir=cache))
      os.rename(final, stale / "old")
      shutil.rmtree(stale, ignore_errors=True)
    try:
      os.rename(tmp, final)
    except OSError:  # another process renamed its build in first: keep that one
      shutil.rmtree(tmp, ignore_errors=True)
      meta = _read_meta(final) or meta
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return {**meta, "directory": str(final.resolve())}


# ---------------------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------------------


def _builds_in(directory: pathlib.Path) -> list[str]:
  if not directory.is_dir():
    return []
  return sorted(p.name for p in directory.iterdir() if (p / MANIFEST).is_file())


def load_or_build(arch: str, variant: Variant, *, cache_dir: str | os.PathLike | None = None) -> BuiltVariant:
  """The cubins of (arch, variant): from ``$GCMOE_CUBIN_DIR`` if set, else the local cache (compiling if needed).

  Raises:
    BuildError: ``$GCMOE_CUBIN_DIR`` lacks the key (the message lists what it holds), or nothing can build it.
  """
  _check_arch(arch)
  key = cache_key(arch, variant)
  prebuilt = _config.get(CUBIN_DIR_ENV)
  if prebuilt:
    directory = pathlib.Path(prebuilt)
    meta = _read_meta(directory / key)
    if meta is None:
      present = _builds_in(directory)
      raise BuildError(
        f"load_or_build: {CUBIN_DIR_ENV}={prebuilt} has no build {key!r} (arch {arch}, variant {variant.key}, "
        f"kernel source {source_sha256()[:12]}); it holds {len(present)}: {present or 'nothing'}. Build it with "
        f"`python -m gcmoe_jax build-kernels --arch {arch} --out {prebuilt} --variant {_variant_arg(variant)}` "
        f"from this checkout (a build from other kernel sources has another key)")
    return BuiltVariant(directory / key, meta)
  try:
    import cutlass  # noqa: F401
  except ImportError as e:
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    meta = _read_meta(cache / key)
    if meta is not None:  # built earlier on this machine, possibly by another DSL version: still this source
      return BuiltVariant(cache / key, meta)
    raise BuildError(
      f"load_or_build: no cubins for {key!r} and CuTe DSL is not importable here ({e}). On a machine with "
      f"`pip install nvidia-cutlass-dsl` (no GPU needed) run `python -m gcmoe_jax build-kernels --arch {arch} "
      f"--out DIR --variant {_variant_arg(variant)}`, copy DIR here and set {CUBIN_DIR_ENV}=DIR") from None
  meta = compile_variant(arch, variant, cache_dir=cache_dir)
  directory = pathlib.Path(meta.pop("directory"))
  return BuiltVariant(directory, meta)


def _variant_arg(v: Variant) -> str:
  fields = [v.hidden, v.intermediate, v.experts, v.top_k, v.capacity]
  if v.shared:
    fields += [v.shared_intermediate, v.shared_group]
  return ",".join(str(f) for f in fields) + (f",r{v.ranks}" if v.ranks > 1 else "") + ("relay" if v.relay else "")
