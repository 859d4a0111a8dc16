"""Launch geometry: the GC-MoE SM120 decision chain as a pure, cached function.

The chain is the one of "GC-MoE on SM120" (the paper; `shared/seeds/000`): rows per expert (eq. 1), the
green-context split (eq. 5), the token tile (eq. 8) and what follows from it (§4.4), the return-staging booleans
(§4.4, §4.5), the role-2 SMEM model (eqs. 9-12), co-residency and the register ceiling (eq. 4, §5.1), the reserved
return CTAs and the relay grid (eq. 13), the finalize and dispatch grids, and the residency rule (eq. 6, Table 10).

Decisions are data: `plan()` returns a frozen `Plan` whose `reasons` say, one line per decision, what was chosen and
why, citing the equation. A shape the operator cannot run raises `GeometryError`, whose message lists every failed
constraint; nothing is silently degraded.

Hopper (sm_90a) runs the same chain with its own device facts. The tile tiers, handoffs, return staging and ℓ are
deliberately identical (the Hopper build exists to verify the SM120 design, DESIGN.md §5); what differs comes from
`Device`: a 228 KB SMEM budget (every tile would fit 4 CTAs; we cap c at 2 so R_cap stays 160, see `H100`),
co-scheduling alignment 8 (on H100/H200, 132 = 16·8 + 4 SMs, so eq. 5 gives 120 compute and 12 dispatch SMs for
the paper's request of 6, and 128 / 4 for the runtime's request of 2 for a call without peers, `dispatch_request`),
and a role-1 bulk-pull engine that fits for every H of Table 10.

This module is a leaf: it imports only the standard library (never jax, never another gcmoe_jax module).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

# Role shapes (paper Table 1, §4.8).
ROLE1_THREADS = 256  # dispatch: scan routes, pull peer rows, publish experts
ROLE2_THREADS = 192  # compute: 4 math warps + 1 TMA producer warp + 1 utility warp
ROLE3_THREADS_UNBATCHED = 384  # finalize on the per-slot path
ROLE3_THREADS_BATCHED = 256  # finalize once returns are batched (Table 1)
ROLE3_CTAS_UNBATCHED = 2  # §5.1: the 384-thread finalize's .minnctapersm is rewritten to 2
ROLE3_CTAS_BATCHED = 4  # the batched finalize grid min(B_cap, 4·S_compute) assumes 4 resident CTAs per SM

MAX_CTAS_PER_SM = 4  # eq. 4: c = max(1, min(4, S_sm / S_role2))
REG_GRANULARITY = 16  # eq. 4 / §5.1: the allocator's 16-register per-thread rounding
MIN_COMPUTE_SMS = 32  # §4.2 and Table 10: the compute partition holds at least 32 SMs
DEFAULT_DISPATCH_SMS = 6  # §4.2 eq. 5 and Table 3 (GC_MOE_SM120_DISPATCH_SMS)
LOCAL_DISPATCH_SMS = 2  # a call without peers: role 1 is one CTA; the smallest request §4.2 allows (S_dispatch > 1)
DEFAULT_CAPACITY = 256  # Table 3: 256 tokens per rank, the largest B of §6

WEIGHT_TILE_BYTES = 64 * 128  # eq. 11: one M=64 x K=128 weight tile, one byte per element once expanded
SCALE_BLOCK_BYTES = 512  # eqs. 10-12: the per-stage scale block
MBARRIER_BYTES = 8
RELAY_SLOT_BYTES = 16 * 1024  # §4.6: the copier's two 16 KB slots
RELAY_BUDGET_BYTES = 256 * 1024 * 1024  # §4.4: relay arena R·Bcap·k·2H <= 256 MB (read as MiB)
PULL_CACHE_ENTRY_BYTES = 8  # §4.5: one 64-bit word per (source rank, source token)
SHARED_TILES = (8, 16, 32, 64)  # eq. 12: tile_ns
SHARED_ROW_BYTES = 132  # eq. 12: one padded FP8 token row (128 bytes + 4 bytes of padding)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the 9 decode points per model of §6 (Tables 5-7)

_ARCHS = ("sm_120a", "sm_90a")


class GeometryError(ValueError):
  """A shape or partition the operator cannot run; `reasons` holds every failed constraint."""

  def __init__(self, reasons: Sequence[str]):
    self.reasons = tuple(reasons)
    if len(self.reasons) == 1:
      message = f"plan: {self.reasons[0]}"
    else:
      lines = "\n".join(f"  - {r}" for r in self.reasons)
      message = f"plan: {len(self.reasons)} constraints reject this shape:\n{lines}"
    super().__init__(message)


def _check_int(name: str, value: Any) -> None:
  # bool is an int subclass; True as a rank count is a bug, not a 1.
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"plan: {name} must be an int, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"plan: {name} must be a bool, got {value!r}")


# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////
# Inputs: device facts, model presets, the problem.
# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////


@dataclasses.dataclass(frozen=True)
class Device:
  """Facts about one GPU model that the geometry depends on.

  Attributes:
    name: marketing name, for reports.
    arch: kernel target, "sm_120a" or "sm_90a".
    sm_count: SMs of the whole device.
    smem_per_sm: largest shared-memory carveout of one SM in bytes (S_sm of eq. 4).
    smem_per_block: opt-in maximum dynamic SMEM of one CTA in bytes.
    reserved_smem_per_block: SMEM the driver charges every resident CTA for system use (1 KB since SM80); the
      occupancy the runtime checks (eq. 6) includes it, so c does too.
    regs_per_sm: 32-bit registers per SM (the 65536 of eq. 4).
    max_threads_per_sm: resident threads per SM.
    gc_alignment: green-context co-scheduling alignment a (`smCoscheduledAlignment`, eq. 5).
    min_partition_sms: `minSmPartitionSize`: the smallest structured green-context group.
    default_dispatch_sms: dispatch SMs requested when the caller names none (eq. 5).
    max_role2_ctas: the cap on c in eq. 4 (the paper's 4 on SM120; 2 on Hopper, see `H100`).
  """

  name: str
  arch: str
  sm_count: int
  smem_per_sm: int
  smem_per_block: int
  reserved_smem_per_block: int
  regs_per_sm: int
  max_threads_per_sm: int
  gc_alignment: int
  min_partition_sms: int
  default_dispatch_sms: int = DEFAULT_DISPATCH_SMS
  max_role2_ctas: int = MAX_CTAS_PER_SM

  def __post_init__(self):
    if self.arch not in _ARCHS:
      raise ValueError(f"plan: Device.arch must be one of {_ARCHS}, got {self.arch!r}")
    for f in dataclasses.fields(self):
      if f.name in ("name", "arch"):
        continue
      value = getattr(self, f.name)
      _check_int(f"Device.{f.name}", value)
      if value < (0 if f.name == "reserved_smem_per_block" else 1):
        raise ValueError(f"plan: Device.{f.name} must be positive, got {value}")
    if self.smem_per_block > self.smem_per_sm:
      raise ValueError(
        f"plan: Device.smem_per_block must be <= smem_per_sm, got {self.smem_per_block} > {self.smem_per_sm}")


# RTX PRO 5000 Blackwell (GB202, compute capability 12.0): 110 SMs (14080 CUDA cores / 128). SM120 has a 128 KB
# unified L1/SMEM per SM of which at most 100 KB can be carved out as shared memory, 99 KB (101376 B) per block
# (CUDA Programming Guide, compute capability table; the same numbers as CC 8.6/8.9). 100 KB, not 128 KB, is also
# the only budget under which the paper's claim "compact weights buy a second co-resident CTA" (§4.3) holds at the
# 80 and 96 tiles of our model. The co-scheduling alignment and minimum group are CUDA's documented rule for
# compute capability 9.0+ (8 and 8); with eq. 5 that still yields the paper's 6 dispatch / 104 compute SMs,
# because 110 - 6 = 104 is a multiple of 8. The SM120 values of `smCoscheduledAlignment` are not measured here.
RTX_PRO_5000 = Device(
  name="RTX PRO 5000 Blackwell",
  arch="sm_120a",
  sm_count=110,
  smem_per_sm=100 * 1024,
  smem_per_block=99 * 1024,
  reserved_smem_per_block=1024,
  regs_per_sm=65536,
  max_threads_per_sm=1536,
  gc_alignment=8,
  min_partition_sms=8,
)

# H100 SXM (compute capability 9.0): 132 SMs, 228 KB SMEM per SM, 227 KB (232448 B) per block. Alignment 8 and
# minSmPartitionSize 8 were measured on our H100 (DESIGN.md §5). Our decision: cap c at 2 on Hopper. With 228 KB
# eq. 4 would give c = 4 for every tile and pin R_cap = 80, while the role-2 kernel (same warp roles as on SM120)
# compiles to "just under two hundred registers" (§5.1): 80 would spill, and the build's local-memory check would
# reject it. c = 2 (R_cap = 160) is also what SM120 runs at all 18 decode points, so Hopper runs stay
# representative of the SM120 launch.
H100 = Device(
  name="H100 SXM",
  arch="sm_90a",
  sm_count=132,
  smem_per_sm=228 * 1024,
  smem_per_block=227 * 1024,
  reserved_smem_per_block=1024,
  regs_per_sm=65536,
  max_threads_per_sm=2048,
  gc_alignment=8,
  min_partition_sms=8,
  max_role2_ctas=2,
)

# H200 SXM: the same GH100 SM array as the H100 SXM (132 SMs); only HBM differs, which the geometry ignores.
H200 = dataclasses.replace(H100, name="H200 SXM")

DEVICES: dict[str, Device] = {"rtx-pro-5000": RTX_PRO_5000, "h100": H100, "h200": H200}


@dataclasses.dataclass(frozen=True)
class Model:
  """A model's MoE layer shape (paper Table 4); per-rank quantities follow from R."""

  name: str
  E: int
  k: int
  H: int
  I: int  # noqa: E741 (the paper's name)
  shared_I: int
  shared_group: int  # K-group of the shared expert's MXFP8 scales (Table 4 caption)


# Table 4. The paper does not give the shared expert's intermediate size: GLM5.2's 2048 comes from the issue text;
# for DSV4.1-Flash we take the routed I (2304), the DeepSeek convention of a shared expert as wide as a routed one.
# Neither enters the geometry (the shared tile depends on B only, eq. 12).
MODELS: dict[str, Model] = {
  "glm5.2": Model("GLM5.2", E=256, k=8, H=6144, I=2048, shared_I=2048, shared_group=128),
  "dsv4.1-flash": Model("DSV4.1-Flash", E=384, k=6, H=5120, I=2304, shared_I=2304, shared_group=32),
}


@dataclasses.dataclass(frozen=True)
class Problem:
  """The launch shape of one MoE layer on one rank (paper Table 10 names).

  Attributes:
    R: ranks (expert-parallel group size).
    E: routed experts in total; a rank owns L = E / R.
    k: routing fan-out (top-k).
    B: tokens per rank in this step.
    H: hidden size.
    I: routed expert intermediate size.
    shared: whether one shared expert is fused into role 2 (§4.7).
    shared_I: the shared expert's intermediate size (defaults to I when shared).
    capacity: B_cap, the per-rank token capacity the workspace is sized for (defaults to max(B, 256), Table 3).
    batched_routes: whether the workspace carries the batched route arrays (§4.4, §5.3). The runtime allocates the
      workspace from the plan, so this is True unless a caller builds a workspace without them.
    model: a label for reports ("custom" unless made by `Problem.for_model`).
  """

  R: int
  E: int
  k: int
  B: int
  H: int
  I: int  # noqa: E741 (the paper's name)
  shared: bool = False
  shared_I: int | None = None
  capacity: int | None = None
  batched_routes: bool = True
  model: str = "custom"

  def __post_init__(self):
    for name in ("R", "E", "k", "B", "H", "I"):
      _check_int(name, getattr(self, name))
    for name in ("shared_I", "capacity"):
      if getattr(self, name) is not None:
        _check_int(name, getattr(self, name))
    _check_bool("shared", self.shared)
    _check_bool("batched_routes", self.batched_routes)
    if not isinstance(self.model, str):
      raise TypeError(f"plan: model must be a str, got {self.model!r}")

  @classmethod
  def for_model(cls, name: str, *, R: int, B: int, shared: bool = False, capacity: int | None = None) -> Problem:
    """The problem of a preset model (`MODELS`) at R ranks and B tokens per rank."""
    if name not in MODELS:
      raise ValueError(f"plan: model must be one of {sorted(MODELS)}, got {name!r}")
    m = MODELS[name]
    return cls(R=R, E=m.E, k=m.k, B=B, H=m.H, I=m.I, shared=shared, shared_I=m.shared_I if shared else None,
               capacity=capacity, model=m.name)

  @property
  def L(self) -> int:
    """Local experts per rank, E / R (§2.1)."""
    return self.E // self.R

  @property
  def B_cap(self) -> int:
    """Per-rank token capacity."""
    return self.capacity if self.capacity is not None else max(self.B, DEFAULT_CAPACITY)

  def describe(self) -> str:
    """One line naming the shape."""
    kind = f"fused shared expert (I_s={self.shared_I or self.I})" if self.shared else "routed"
    return (f"{self.model} R={self.R} E={self.E} (L={self.E / self.R:g}) k={self.k} B={self.B} H={self.H} "
            f"I={self.I} {kind}, capacity {self.B_cap}")


def validate(problem: Problem) -> tuple[str, ...]:
  """Every Table 10 constraint `problem` violates, as reasons; empty when it is supported."""
  p = problem
  bad = []
  if not 1 <= p.R <= 32:
    bad.append(f"R must be in [1, 32] (Table 10), got {p.R}")
  if p.E < 1:
    bad.append(f"E must be >= 1 (Table 10), got {p.E}")
  elif p.R >= 1 and p.E % p.R:
    bad.append(f"E must be a multiple of R (Table 10: E mod R = 0), got E={p.E}, R={p.R}")
  if not 1 <= p.k <= min(32, max(p.E, 1)):
    bad.append(f"k must be in [1, min(32, E)] = [1, {min(32, max(p.E, 1))}] (Table 10), got {p.k}")
  if not (512 <= p.H <= 8192 and p.H % 128 == 0):
    bad.append(f"H must be a multiple of 128 in [512, 8192] (Table 10), got {p.H}")
  if not (256 <= p.I <= 4096 and p.I % 128 == 0):
    bad.append(f"I must be a multiple of 128 in [256, 4096] (Table 10), got {p.I}")
  if p.shared_I is not None:
    if not p.shared:
      bad.append(f"shared_I requires shared=True, got shared_I={p.shared_I} with shared=False")
    elif not (256 <= p.shared_I <= 4096 and p.shared_I % 128 == 0):
      bad.append(f"shared_I must be a multiple of 128 in [256, 4096] (Table 10, as I), got {p.shared_I}")
  if p.B < 1:
    bad.append(f"B must be >= 1, got {p.B}")
  if p.capacity is not None and p.capacity < max(p.B, 1):
    bad.append(f"capacity must be >= B, got capacity={p.capacity}, B={p.B}")
  return tuple(bad)


# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////
# Outputs: the plan, grouped like DeepGEMM's GemmConfig.
# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////


@dataclasses.dataclass(frozen=True)
class Partition:
  """The green-context split (eq. 5)."""

  sm_count: int
  alignment: int
  dispatch_requested: int
  dispatch_sms: int  # S_dispatch: the remainder the aligned compute group leaves
  compute_sms: int  # S_compute = a * floor((S_total - S_dispatch) / a)


@dataclasses.dataclass(frozen=True)
class Tile:
  """Token-tile geometry (eqs. 1, 8 and §4.4)."""

  rows_per_expert: int  # r, eq. 1
  tile_n: int  # eq. 8
  stages: int  # s_st
  compact_weights: bool  # c_w of eq. 11
  global_handoff: bool
  shared_chunks: bool  # L1 handoff in shared 32-row chunks
  handoff_slots: int  # s
  shared_tile_n: int | None  # tile_ns of eq. 12; None without a shared expert


@dataclasses.dataclass(frozen=True)
class Returns:
  """Return staging and dispatch mode (§4.4, §4.5)."""

  batched: bool
  mirrored_metadata: bool
  relay: bool
  relay_arena_bytes: int  # R·Bcap·k·2H
  handoff_arena_bytes: int  # the global handoff region (0 without a global handoff)
  pull_cache: bool
  pull_cache_bytes: int  # 8·R·Bcap
  pull_batch_depth: int
  bulk_pull_engine: bool
  direct_scan: bool  # B <= 2


@dataclasses.dataclass(frozen=True)
class Smem:
  """Dynamic SMEM per CTA in bytes: the role-2 model (eqs. 9-12) and role 1."""

  p_w: int  # eq. 11
  p_x: int  # eq. 11
  b_bar: int
  b_ret: int
  b_util: int
  model: int  # S_model, eq. 10
  shared: int  # S_shared, eq. 12 (0 without a shared expert)
  relay: int  # 2·(16 KB + 8) (0 without relay)
  role2: int  # S_role2, eq. 9
  role1: int  # S_role1


@dataclasses.dataclass(frozen=True)
class Launch:
  """Grids, co-residency and the register ceiling (eqs. 4, 6, 13)."""

  ctas_per_sm: int  # c, eq. 4
  reg_cap: int | None  # R_cap, eq. 4; None: no ceiling (one CTA per SM)
  l2_dedicated: int  # ℓ
  role2_threads: int
  compute_grid: int  # G_compute = c · S_compute
  relay_grid: int  # G_relay, eq. 13 (0 without relay)
  mma_grid: int  # G_compute - G_relay
  finalize_threads: int
  finalize_ctas_per_sm: int
  finalize_grid: int
  dispatch_threads: int
  dispatch_ctas_per_sm: int
  dispatch_grid: int


@dataclasses.dataclass(frozen=True)
class Plan:
  """The launch geometry of one problem on one device; `reasons` has one line per decision."""

  problem: Problem
  device: Device
  partition: Partition
  tile: Tile
  returns: Returns
  smem: Smem
  launch: Launch
  reasons: tuple[str, ...]

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable dict of every field (nested by group)."""
    d = dataclasses.asdict(self)
    d["reasons"] = list(self.reasons)
    d["problem"]["L"] = self.problem.L
    d["problem"]["B_cap"] = self.problem.B_cap
    return d

  def __str__(self) -> str:
    p, d, t, r, s, g = self.problem, self.device, self.tile, self.returns, self.smem, self.launch
    handoff = ("global + shared 32-row chunks" if t.shared_chunks else "global") if t.global_handoff else "smem"
    lines = [
      f"GC-MoE plan: {p.describe()}",
      f"  on {d.name} ({d.arch}, {d.sm_count} SMs)",
      f"  partition  dispatch {self.partition.dispatch_sms} SMs | compute {self.partition.compute_sms} SMs"
      f" (alignment {self.partition.alignment})",
      f"  tile       r={t.rows_per_expert} tile_n={t.tile_n} stages={t.stages} compact={_yn(t.compact_weights)}"
      f" handoff={handoff} slots={t.handoff_slots}"
      + (f" shared_tile_n={t.shared_tile_n}" if t.shared_tile_n else ""),
      f"  returns    batched={_yn(r.batched)} mirrored={_yn(r.mirrored_metadata)} relay={_yn(r.relay)}"
      f" pull_cache={_yn(r.pull_cache)} pull_depth={r.pull_batch_depth} engine={_yn(r.bulk_pull_engine)}"
      f" direct_scan={_yn(r.direct_scan)}",
      f"  smem       role2={s.role2} B (model {s.model}, shared {s.shared or '-'}, relay {s.relay or '-'})"
      f" role1={s.role1} B",
      f"  launch     c={g.ctas_per_sm} R_cap={g.reg_cap or 'none'} l2_dedicated={g.l2_dedicated}"
      f" | role2 {g.compute_grid}x{g.role2_threads} (relay {g.relay_grid}, mma {g.mma_grid})"
      f" | finalize {g.finalize_grid}x{g.finalize_threads} | dispatch {g.dispatch_grid}x{g.dispatch_threads}",
      "  why:",
    ]
    lines += [f"    {reason}" for reason in self.reasons]
    return "\n".join(lines)


def _yn(flag: bool) -> str:
  return "yes" if flag else "no"


# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////
# The chain, one pure function per step.
# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////


def rows_per_expert(B: int, k: int, L: int) -> int:
  """r = ceil(B·k / L) (eq. 1): the routed rows an expert receives on average."""
  # A rank receives, on average, the B·k assignments it sends, spread over its L experts.
  return -(-B * k // L)


def split_sms(device: Device, dispatch_sms: int | None = None) -> tuple[Partition, tuple[str, ...]]:
  """The green-context split of eq. 5 and the §4.2 checks.

  The compute partition is the aligned (structured) group, S_compute = a·floor((S_total - d)/a); the dispatch
  partition is the remainder, so it is d rounded up to whatever the aligned group leaves. This is what lets SM120
  run 6 dispatch SMs with CUDA's alignment of 8 (110 - 6 = 104 = 13·8).

  Returns:
    The partition and the failed checks (empty when usable).
  """
  d = device.default_dispatch_sms if dispatch_sms is None else dispatch_sms
  _check_int("dispatch_sms", d)
  total, a = device.sm_count, device.gc_alignment
  bad = []
  if not 1 <= d < total:
    bad.append(f"dispatch_sms must be in [1, {total - 1}] (the device has {total} SMs), got {d}")
    d = min(max(d, 1), total)
  compute = a * ((total - d) // a)  # eq. 5
  dispatch = total - compute
  if compute < MIN_COMPUTE_SMS:
    bad.append(f"S_compute must be >= {MIN_COMPUTE_SMS} (eq. 5, §4.2), got {compute} "
               f"(= {a}*floor(({total} - {d})/{a}))")
  if compute % 2:
    bad.append(f"S_compute must be even (§4.2), got {compute}")
  if MIN_COMPUTE_SMS <= compute < device.min_partition_sms:
    bad.append(f"S_compute must be >= minSmPartitionSize {device.min_partition_sms}, got {compute}")
  if dispatch <= 1:
    bad.append(f"S_dispatch must be > 1 (§4.2), got {dispatch}")
  if compute + dispatch != total:  # holds by construction; kept because §4.2 checks what the driver returned
    bad.append(f"S_compute + S_dispatch must equal {total} (§4.2), got {compute} + {dispatch}")
  return Partition(total, a, d, dispatch, compute), tuple(bad)


def dispatch_request(device: Device, requested: int | None, *, peers: bool) -> int:
  """The dispatch SMs the runtime requests for a call (GC_MOE_SM120_DISPATCH_SMS when set, ``requested``).

  Unset, a call with peers (the fused transport) requests the device's default (the paper's 6: role 1 pulls peer
  rows on the dispatch partition), and a call without peers requests `LOCAL_DISPATCH_SMS`: its role 1 is one CTA
  that scans the routes, so every SM the aligned compute group can take goes to role 2. On the 132-SM H100/H200
  that is 128 compute / 4 dispatch SMs instead of 120 / 12 (measured 4-7 % faster at B >= 8 on the H200,
  docs/perf.md); on the 110-SM SM120 both requests give the paper's 104 / 6.
  """
  if requested is not None:
    _check_int("dispatch_sms", requested)
    return requested
  return device.default_dispatch_sms if peers else LOCAL_DISPATCH_SMS


@dataclasses.dataclass(frozen=True)
class VirtualRanks:
  """R virtual ranks on one device (issue 9): R disjoint (dispatch, compute) green-context pairs.

  Every rank gets the same split: ``dispatch_sms`` and ``compute_sms`` SMs; ``leftover_sms`` belong to no rank.
  """

  ranks: int
  dispatch_sms: int
  compute_sms: int
  leftover_sms: int


def split_virtual_ranks(device: Device, ranks: int, dispatch_sms: int | None = None, *,
                        min_compute_sms: int = MIN_COMPUTE_SMS,
                        groups: int | None = None) -> tuple[VirtualRanks, tuple[str, ...]]:
  """Eq. 5 for R ranks sharing one device, the fused transport's one-GPU test mode (docs/fused_transport.md).

  With one rank the dispatch partition is the remainder of the aligned compute group (`split_sms`). With R > 1 the
  driver makes every group by a structured split, so each rank's dispatch group is aligned too: D = the requested
  dispatch SMs rounded up to the alignment (and to minSmPartitionSize), and the R compute groups share what the R
  dispatch groups leave, C = a·floor((S_total - R·D) / (R·a)). The §4.2 checks apply per rank; with R > 1,
  ``min_compute_sms`` lowers the S_compute floor (it protects speed, not correctness) for tests of R = 4 on 132
  SMs.

  ``groups``: how many minSmPartitionSize groups the driver's split of the device makes (``gcmoe_sm_groups``;
  the H200 gives 15 from 132 SMs, its clusters being uneven). Given, each rank gets ``groups // R`` of them and the
  split is the one the driver will make; None plans from the SM count (an upper bound).

  Returns:
    The split and the failed checks (empty when usable).
  """
  _check_int("ranks", ranks)
  _check_int("min_compute_sms", min_compute_sms)
  if ranks < 1:
    raise ValueError(f"plan: ranks must be >= 1, got {ranks}")
  if ranks == 1:
    part, bad = split_sms(device, dispatch_sms)
    return VirtualRanks(1, part.dispatch_sms, part.compute_sms, 0), bad
  d = device.default_dispatch_sms if dispatch_sms is None else dispatch_sms
  _check_int("dispatch_sms", d)
  total, a = device.sm_count, device.gc_alignment
  bad = []
  if d < 1:
    bad.append(f"dispatch_sms must be >= 1, got {d}")
    d = 1
  if groups is None:
    dispatch = max(a * -(-d // a), device.min_partition_sms)
    compute = a * ((total - ranks * dispatch) // (ranks * a)) if total > ranks * dispatch else 0
  else:
    _check_int("groups", groups)
    g = device.min_partition_sms
    if not 0 <= groups * g <= total:
      raise ValueError(f"split_virtual_ranks: groups must be in [0, {total // g}] ({g}-SM groups of {total} SMs), "
                       f"got {groups}")
    dispatch = g * -(-d // g)
    compute = max(0, (groups // ranks) * g - dispatch)
  if compute == 0:
    bad.append(f"{ranks} ranks need {ranks} dispatch groups of {dispatch} SMs and at least {a} compute SMs each, "
               f"the device has {total} SMs")
  if compute < min_compute_sms:
    how = (f"{device.min_partition_sms}*floor({groups}/{ranks}) - {dispatch} with {groups} driver groups"
           if groups is not None else f"{a}*floor(({total} - {ranks}*{dispatch})/({ranks}*{a})) with {ranks} ranks")
    bad.append(f"S_compute must be >= {min_compute_sms} per rank (eq. 5, §4.2), got {compute} (= {how})")
  if compute % 2:
    bad.append(f"S_compute must be even (§4.2), got {compute}")
  if 0 < compute < device.min_partition_sms:
    bad.append(f"S_compute must be >= minSmPartitionSize {device.min_partition_sms}, got {compute}")
  leftover = total - ranks * (dispatch + compute)
  return VirtualRanks(ranks, dispatch, compute, leftover), tuple(bad)


def select_tile_n(r: int) -> tuple[int, str]:
  """Token tile width from the four tiers of eq. 8 and the §4.4 fallbacks.

  Returns:
    (tile_n, why).
  """
  slack = r + math.isqrt(r)
  if 16 <= r < 32:
    return 32, f"16 <= r={r} < 32: tier 32 (eq. 8)"
  if 32 <= r < 48:
    return 48, f"32 <= r={r} < 48: tier 48 (eq. 8)"
  if 64 <= r < 96 and slack <= 80:
    return 80, f"64 <= r={r} < 96 and r + floor(sqrt(r)) = {slack} <= 80: tier 80 (eq. 8)"
  if 64 <= r < 96:
    # The floor(sqrt(r)) slack guards against uneven routing pushing an expert past its mean row count (§4.4):
    # 80 is kept only while r plus that slack still fits one tile.
    return 96, f"64 <= r={r} < 96 and r + floor(sqrt(r)) = {slack} > 80: tier 96 (eq. 8)"
  if r < 16:
    return 16, f"r={r} < 16: below every tier of eq. 8, fallback 16 (§4.4)"
  where = "48 <= r < 64" if r < 64 else "r >= 96"
  return 64, f"r={r}, {where}: outside every tier of eq. 8, fallback 64 (§4.4)"


COMPACT_TILES = (48, 80, 96)  # §4.3/§4.4: the tile widths where compact FP4 weights buy a co-resident CTA


def compact_weights(tile_n: int) -> bool:
  """c_w of eq. 11: whether a tile of width ``tile_n`` stages the compact FP4 weights (raw nibbles, expanded in
  registers) rather than the expanded ones (8-bit containers from the TMA): exactly the `COMPACT_TILES` tiers."""
  return tile_n in COMPACT_TILES


def relay_staging(R: int, B: int, B_cap: int, k: int, L: int, H: int, shared: bool,
                  batched_routes: bool = True) -> tuple[bool, str]:
  """Whether role 2 returns rows by the relay path (parked position-major, drained by copier CTAs) rather than the
  direct one (§4.4): batched returns (B k >= 32 L), an arena R Bcap k 2H within 256 MB, and not the case of mirrored
  metadata (k < R) without a shared expert, where the direct path has everything locally.

  Returns:
    (relay, why).
  """
  batched = B * k >= 32 * L and batched_routes
  relay_bytes = R * B_cap * k * 2 * H
  mirrored = k < R
  if not batched:
    return False, "returns are not batched"
  if relay_bytes > RELAY_BUDGET_BYTES:
    return False, f"arena R*Bcap*k*2H = {relay_bytes} B > 256 MB"
  if mirrored and not shared:
    return False, "mirrored metadata with no shared expert: the direct path already has everything locally"
  return True, f"batched, arena R*Bcap*k*2H = {relay_bytes} B <= 256 MB" + (
    ", and the fused shared work hides the copy" if mirrored else "")


def shared_tile_n(B: int) -> int:
  """tile_ns of eq. 12: the smallest of {8, 16, 32, 64} that holds B tokens, else 64."""
  # The paper says only "chosen from the token count"; the smallest tile that covers B wastes the fewest padded
  # rows and gives the "one 8-token tile per CTA" of §6.3 at small B.
  return next((t for t in SHARED_TILES if t >= B), SHARED_TILES[-1])


def shared_smem(tile_ns: int) -> int:
  """S_shared of eq. 12: one 8 KB weight tile, one 512 B scale block, tile_ns padded rows, rounded up to 1 KB."""
  raw = WEIGHT_TILE_BYTES + SCALE_BLOCK_BYTES + SHARED_ROW_BYTES * tile_ns
  return -(-raw // 1024) * 1024


def role2_smem(tile: Tile, *, shared: bool, relay: bool) -> Smem:
  """The role-2 SMEM model, eqs. 9-12 (role1 is left 0 here; `plan` fills it)."""
  t, s = tile.tile_n, tile.handoff_slots
  p_w = WEIGHT_TILE_BYTES // (2 if tile.compact_weights else 1) + SCALE_BLOCK_BYTES  # eq. 11
  p_x = t * 128 + SCALE_BLOCK_BYTES  # eq. 11
  # B_bar: the paper names the stage-arrival barriers fullW[s] and fullX[s] (§4.3) without a byte count; two
  # 8-byte mbarriers per stage. With it the 96 tile lands at exactly 2 CTAs per SM on SM120 (2·(50176 + 1 KB)).
  b_bar = 2 * MBARRIER_BYTES * tile.stages
  if tile.shared_chunks:
    b_ret = 20 * t + 128 * 32 * s  # shared 32-row chunks replace the global source tiles
  elif tile.global_handoff:
    b_ret = 20 * t + 16
  else:
    b_ret = t * (20 + 128 * s)
  b_util = 32 + 24 * s + 16 * s * t
  model = tile.stages * (p_w + p_x) + t * 16 + 16 + b_bar + b_ret + b_util + SCALE_BLOCK_BYTES  # eq. 10
  s_shared = shared_smem(tile.shared_tile_n) if shared and tile.shared_tile_n else 0
  s_relay = 2 * (RELAY_SLOT_BYTES + MBARRIER_BYTES) if relay else 0
  # eq. 9: maxima, not sums: the shared GEMM, the mainloop and the copier never overlap inside a CTA. A term whose
  # feature is off contributes nothing.
  role2 = max(model, 2 * s_shared + 16 if s_shared else 0, s_relay)
  return Smem(p_w, p_x, b_bar, b_ret, b_util, model, s_shared, s_relay, role2, 0)


def ctas_per_sm(smem_bytes: int, threads: int, device: Device, cap: int = MAX_CTAS_PER_SM) -> int:
  """Co-resident CTAs per SM: eq. 4's c = min(4, S_sm / S_role), as the driver counts it; 0 if none fits."""
  if smem_bytes > device.smem_per_block:
    return 0
  # The driver charges each resident CTA `reserved_smem_per_block` on top of its dynamic SMEM; eq. 6 checks the
  # driver's count, so c must use it too or the plan could promise a CTA the runtime then rejects.
  by_smem = device.smem_per_sm // (smem_bytes + device.reserved_smem_per_block)
  by_threads = device.max_threads_per_sm // threads
  return min(cap, by_smem, by_threads)


def register_cap(c: int, threads: int = ROLE2_THREADS, regs_per_sm: int = 65536) -> int | None:
  """R_cap of eq. 4: 16·floor(65536 / (c·threads·16)); None (no ceiling) when one CTA co-resides (§5.1)."""
  if c <= 1:
    return None
  return REG_GRANULARITY * (regs_per_sm // (c * threads * REG_GRANULARITY))


def l2_dedicated(tile_n: int, global_handoff: bool, batched: bool, relay: bool, shared: bool) -> tuple[int, str]:
  """ℓ, the compute CTAs reserved for return traffic (§4.4).

  Returns:
    (ℓ, why).
  """
  # Precedence: the ℓ = 3 and ℓ = 6 cases refine the ℓ = 4 rule (Table 2's DSV4.1-Flash has a global handoff and
  # still gets 3); they are disjoint (3 needs batched returns, 6 needs unbatched ones).
  if batched and not relay and not shared:
    return 3, "l2_dedicated = 3: batched returns without resident copiers and no shared expert (§4.4)"
  if tile_n == 80 and not batched:
    return 6, "l2_dedicated = 6: unbatched tile_n = 80 needs an FC1/FC2 scheduling period of slack (§4.4)"
  if tile_n >= 64 or global_handoff:
    why = "tile_n >= 64" if tile_n >= 64 else "a global handoff is in use"
    return 4, f"l2_dedicated = 4: {why} (§4.4)"
  return 1, "l2_dedicated = 1: default, no global handoff and tile_n < 64 (§4.4)"


def check_residency(role: str, grid: int, ctas: int, sms: int) -> str | None:
  """eq. 6: a role's grid must be co-resident (G_role <= c_role·S_role); the failure reason, or None."""
  if grid > ctas * sms:
    return (f"{role} grid must be <= c*S = {ctas}*{sms} = {ctas * sms} co-resident CTAs (eq. 6), got {grid}")
  return None


# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////
# plan()
# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////


def plan(problem: Problem | None = None, /, *, device: Device = RTX_PRO_5000, dispatch_sms: int | None = None,
         **shape: Any) -> Plan:
  """The launch geometry of one MoE layer: the paper's decision chain (§4.2-§4.5, §5.1).

  Deterministic and cached: equal inputs return the same `Plan` object.

  Args:
    problem: the shape; or pass its fields as keywords (`plan(R=8, E=256, k=8, B=256, H=6144, I=2048)`).
    device: device facts (`DEVICES`), default the RTX PRO 5000.
    dispatch_sms: dispatch SMs requested (GC_MOE_SM120_DISPATCH_SMS; read by the caller, never here); None means
      `device.default_dispatch_sms` (6). Eq. 5 may round it up.
    **shape: `Problem` fields, when `problem` is not given.

  Returns:
    The frozen `Plan`.

  Raises:
    TypeError: wrong argument types.
    GeometryError: the shape violates Table 10, the split violates §4.2, or a role cannot be resident (eq. 6);
      the message lists every failed constraint.
  """
  if problem is None:
    names = [f.name for f in dataclasses.fields(Problem)]
    unknown = sorted(set(shape) - set(names))
    if unknown:
      raise TypeError(f"plan: keywords must be Problem fields {names}, got {unknown}")
    missing = [n for n in ("R", "E", "k", "B", "H", "I") if n not in shape]
    if missing:
      raise TypeError(f"plan: R, E, k, B, H and I are required, got no {', '.join(missing)}")
    problem = Problem(**shape)
  elif shape:
    raise TypeError(f"plan: pass either a Problem or its fields as keywords, got both (keywords {sorted(shape)})")
  if not isinstance(problem, Problem):
    raise TypeError(f"plan: problem must be a Problem, got {type(problem).__name__}")
  if not isinstance(device, Device):
    raise TypeError(f"plan: device must be a Device, got {type(device).__name__}")
  if dispatch_sms is not None:
    _check_int("dispatch_sms", dispatch_sms)
  return _plan(problem, device, dispatch_sms)


@functools.lru_cache(maxsize=4096)
def _plan(p: Problem, dev: Device, dispatch_sms: int | None) -> Plan:
  partition, split_bad = split_sms(dev, dispatch_sms)
  shape_bad = validate(p)
  if shape_bad:
    raise GeometryError(shape_bad + split_bad)
  why: list[str] = []
  S, L = partition.compute_sms, p.L

  why.append(f"split: S_compute = {partition.alignment}*floor(({partition.sm_count} - {partition.dispatch_requested})"
             f"/{partition.alignment}) = {S}, S_dispatch = {partition.dispatch_sms} (eq. 5; the dispatch partition "
             f"is the remainder of the aligned compute group)")

  # ---- token tile (eqs. 1, 8) and what follows from it (§4.4)
  r = rows_per_expert(p.B, p.k, L)
  why.append(f"r = ceil(B*k/L) = ceil({p.B}*{p.k}/{L}) = {r} rows per expert (eq. 1)")
  tile_n, tile_why = select_tile_n(r)
  why.append(f"tile_n = {tile_n}: {tile_why}")
  stages = 4 if tile_n == 16 else 2
  why.append(f"stages = {stages}: " + ("tile_n = 16 is too small to hide latency with two (§4.4)" if stages == 4
                                       else "two stages for every tile_n > 16 (§4.4)"))
  compact = compact_weights(tile_n)
  why.append(f"compact weights = {_yn(compact)}: " + (
    f"tile_n = {tile_n} is a {{48, 80, 96}} tier, where the freed 4 KB per stage decides co-residency (§4.3, §4.4)"
    if compact else f"only the {{48, 80, 96}} tiers stage compact FP4; tile_n = {tile_n} stages expanded weights"))
  # The BF16 handoff path is the only L1 handoff the paper describes for this operator, so eq. 8 always applies.
  global_handoff = tile_n >= 32
  shared_chunks = tile_n >= 48
  slots = 2 if global_handoff else 1
  why.append(
    f"handoff = {'global' if global_handoff else 'smem'}"
    + (" + shared 32-row chunks" if shared_chunks else "")
    + f", slots s = {slots}: global for tile_n >= 32 on the BF16 path, shared 32-row chunks for tile_n >= 48, "
      f"s = 2 with a global handoff (§4.4)")
  tile_ns = shared_tile_n(p.B) if p.shared else None
  if tile_ns:
    why.append(f"shared tile_ns = {tile_ns}: the smallest of {SHARED_TILES} holding B = {p.B} tokens (eq. 12)")

  # ---- return staging (§4.4) and dispatch mode (§4.5)
  batched = p.B * p.k >= 32 * L and p.batched_routes
  why.append(f"batched returns = {_yn(batched)}: B*k = {p.B * p.k} {'>=' if p.B * p.k >= 32 * L else '<'} "
             f"32*L = {32 * L}" + ("" if p.batched_routes else ", and the workspace has no batched route array")
             + " (§4.4)")
  mirrored = p.k < p.R
  why.append(f"mirrored metadata = {_yn(mirrored)}: k = {p.k} {'<' if mirrored else '>='} R = {p.R} (§4.4, §4.5)")
  relay_bytes = p.R * p.B_cap * p.k * 2 * p.H
  relay, relay_why = relay_staging(p.R, p.B, p.B_cap, p.k, L, p.H, p.shared, p.batched_routes)
  why.append(f"relay staging = {_yn(relay)}: {relay_why} (§4.4)")

  cache_bytes = PULL_CACHE_ENTRY_BYTES * p.R * p.B_cap
  tile_frees_arena = tile_n == 80 or (tile_n == 48 and batched)

  # ---- role-2 SMEM (eqs. 9-12), co-residency and register ceiling (eq. 4)
  tile = Tile(r, tile_n, stages, compact, global_handoff, shared_chunks, slots, tile_ns)
  smem = role2_smem(tile, shared=p.shared, relay=relay)
  why.append(f"S_model = {stages}*({smem.p_w} + {smem.p_x}) + {tile_n}*16 + 16 + B_bar {smem.b_bar} + B_ret "
             f"{smem.b_ret} + B_util {smem.b_util} + 512 = {smem.model} B (eq. 10, eq. 11)")
  terms = [f"S_model {smem.model}"]
  if smem.shared:
    terms.append(f"2*S_shared + 16 = {2 * smem.shared + 16} (S_shared {smem.shared}, eq. 12)")
  if smem.relay:
    terms.append(f"2*(16 KB + 8) = {smem.relay}")
  why.append(f"S_role2 = max({', '.join(terms)}) = {smem.role2} B (eq. 9)")
  bad: list[str] = list(split_bad)
  c = ctas_per_sm(smem.role2, ROLE2_THREADS, dev, cap=dev.max_role2_ctas)
  if c == 0:
    bad.append(f"role 2 SMEM must fit one CTA ({dev.smem_per_block} B per block, {dev.smem_per_sm} B per SM with "
               f"{dev.reserved_smem_per_block} B reserved) (eq. 4), got S_role2 = {smem.role2}")
  why.append(f"c = min({dev.max_role2_ctas}, floor({dev.smem_per_sm} / ({smem.role2} + "
             f"{dev.reserved_smem_per_block} reserved))) = {c} co-resident role-2 CTAs per SM (eq. 4)")
  reg_cap = register_cap(max(c, 1), ROLE2_THREADS, dev.regs_per_sm)
  if reg_cap:
    why.append(f"R_cap = 16*floor({dev.regs_per_sm} / ({c}*{ROLE2_THREADS}*16)) = {reg_cap} registers per thread, "
               f".minnctapersm {c} (eq. 4, §5.1)")
  else:
    why.append("R_cap = none: one CTA per SM needs no register ceiling (eq. 4, §5.1)")

  # The paper says only that the handoff arena "must be large enough" for the 8·R·Bcap cache words (§4.5). We size
  # the arena as the global handoff region: one BF16 L1 tile (tile_n rows of I columns) per handoff slot per
  # compute CTA; without a global handoff there is no arena.
  handoff_bytes = c * S * slots * tile_n * 2 * p.I if global_handoff else 0
  pull_cache = p.k >= p.R and tile_frees_arena and cache_bytes <= handoff_bytes
  if p.k < p.R:
    cache_why = f"k = {p.k} < R = {p.R}"
  elif not tile_frees_arena:
    cache_why = (f"tile_n = {tile_n} with batched = {_yn(batched)}: only tile 80, or 48 with batched returns, "
                 "leave the handoff arena free of return staging")
  elif cache_bytes > handoff_bytes:
    cache_why = f"8*R*Bcap = {cache_bytes} B exceeds the handoff arena ({handoff_bytes} B)"
  else:
    cache_why = (f"k = {p.k} >= R = {p.R}, tile_n = {tile_n}, 8*R*Bcap = {cache_bytes} B fits the handoff arena "
                 f"({handoff_bytes} B)")
  why.append(f"pull cache = {_yn(pull_cache)}: {cache_why} (§4.5)")

  # Pull batch depth (§4.5). The cache rule must outrank the batched-without-mirror rule: the cache implies batched
  # returns (tile 80 needs r >= 64, i.e. B*k > 63L) and k >= R (no mirror), so applied in the other order the
  # "raised to 4" clause could never fire.
  if pull_cache:
    depth, depth_why = 4, "raised to 4: the pull cache is active"
  elif batched and not mirrored:
    depth, depth_why = 2, "lowered to 2: batched returns without mirrored metadata"
  elif L < 48:
    depth, depth_why = 8, f"L = {L} < 48 local experts"
  else:
    depth, depth_why = 1, f"L = {L} >= 48 local experts"
  why.append(f"pull batch depth = {depth}: {depth_why} (§4.5)")

  # ---- role 1 (§4.4, §4.5)
  engine_smem = 512 + 16 * p.H + 64
  c1_engine = ctas_per_sm(engine_smem, ROLE1_THREADS, dev)
  engine = c1_engine > 0
  # Without the engine, the fallback batches four 16-byte chunks in registers; it keeps only the 512 + 64 bytes of
  # scan state and barriers in SMEM (our reading: the 16H term is the engine's two H-byte slots per warp).
  role1_smem = engine_smem if engine else 512 + 64
  c1 = c1_engine if engine else ctas_per_sm(role1_smem, ROLE1_THREADS, dev)
  direct_scan = p.B <= 2
  dispatch_grid = partition.dispatch_sms * c1
  why.append(f"role 1: bulk-pull engine = {_yn(engine)} (S_role1 = 512 + 16*{p.H} + 64 = {engine_smem} B "
             f"{'fits' if engine else 'does not fit'} a CTA), grid = S_dispatch*min(4, floor(S_sm/S_role1)) = "
             f"{partition.dispatch_sms}*{c1} = {dispatch_grid} (§4.4)")
  if direct_scan:
    # "the expert grid is clamped to the number of local experts" (§4.5); we read the expert grid as role 1's.
    dispatch_grid = min(dispatch_grid, L)
    why.append(f"direct scan = yes: B = {p.B} <= 2, one block polls all peers; dispatch grid clamped to "
               f"L = {L}: {dispatch_grid} (§4.5)")

  # ---- ℓ, role-2 grid, relay grid (eq. 13), finalize
  ell, ell_why = l2_dedicated(tile_n, global_handoff, batched, relay, p.shared)
  why.append(ell_why)
  compute_grid = c * S
  relay_grid = min(p.R, compute_grid - ell) if relay else 0
  why.append(f"role 2 grid = c*S_compute = {c}*{S} = {compute_grid}; relay grid = "
             + (f"min(R, G_compute - l2_dedicated) = min({p.R}, {compute_grid - ell}) = {relay_grid} (eq. 13)"
                if relay else "0 (no relay)"))
  if batched:
    fin_threads, fin_ctas = ROLE3_THREADS_BATCHED, ROLE3_CTAS_BATCHED
    finalize_grid = min(p.B_cap, 4 * S)
    why.append(f"finalize: batched path, {fin_threads} threads, grid = min(Bcap, 4*S_compute) = "
               f"min({p.B_cap}, {4 * S}) = {finalize_grid} (§4.4, Table 1)")
  else:
    fin_threads, fin_ctas = ROLE3_THREADS_UNBATCHED, ROLE3_CTAS_UNBATCHED
    finalize_grid = min(2 * S, -(-p.B * p.H // 2048))
    why.append(f"finalize: {fin_threads} threads, grid = min(2*S_compute, ceil(B*H/2048)) = "
               f"min({2 * S}, {-(-p.B * p.H // 2048)}) = {finalize_grid} (§4.4, Table 1)")

  # ---- residency (eq. 6, Table 10): rejected, never degraded
  if c * S < ell + 1:
    bad.append(f"compute partition must host l2_dedicated + 1 = {ell + 1} co-resident CTAs (Table 10, §4.4), "
               f"got c*S_compute = {c}*{S} = {c * S}")
  for role, grid, ctas, sms in (("role 1 (dispatch)", dispatch_grid, c1, partition.dispatch_sms),
                                ("role 2 (compute)", compute_grid, c, S),
                                ("role 3 (finalize)", finalize_grid, fin_ctas, S)):
    failure = check_residency(role, grid, ctas, sms)
    if failure:
      bad.append(failure)
  if bad:
    raise GeometryError(bad)
  why.append(f"residency: every role grid <= c_role*S_role and c*S_compute = {c * S} >= l2_dedicated + 1 (eq. 6)")

  returns = Returns(batched, mirrored, relay, relay_bytes, handoff_bytes, pull_cache, cache_bytes, depth, engine,
                    direct_scan)
  smem = dataclasses.replace(smem, role1=role1_smem)
  launch = Launch(c, reg_cap, ell, ROLE2_THREADS, compute_grid, relay_grid, compute_grid - relay_grid, fin_threads,
                  fin_ctas, finalize_grid, ROLE1_THREADS, c1, dispatch_grid)
  return Plan(p, dev, partition, tile, returns, smem, launch, tuple(why))


# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////
# Reports
# ////////////////////////////////////////////////////////////////////////////////////////////////////////////////

_TABLE_COLUMNS = (
  ("B", lambda q: q.problem.B),
  ("r", lambda q: q.tile.rows_per_expert),
  ("tile_n", lambda q: q.tile.tile_n),
  ("stages", lambda q: q.tile.stages),
  ("compact", lambda q: _yn(q.tile.compact_weights)),
  ("handoff", lambda q: ("global+chunks" if q.tile.shared_chunks else "global") if q.tile.global_handoff else "smem"),
  ("s", lambda q: q.tile.handoff_slots),
  ("batched", lambda q: _yn(q.returns.batched)),
  ("mirrored", lambda q: _yn(q.returns.mirrored_metadata)),
  ("relay", lambda q: _yn(q.returns.relay)),
  ("pull cache", lambda q: _yn(q.returns.pull_cache)),
  ("pull depth", lambda q: q.returns.pull_batch_depth),
  ("S_role2", lambda q: q.smem.role2),
  ("c", lambda q: q.launch.ctas_per_sm),
  ("R_cap", lambda q: q.launch.reg_cap or "none"),
  ("ℓ", lambda q: q.launch.l2_dedicated),
  ("G_compute", lambda q: q.launch.compute_grid),
  ("G_relay", lambda q: q.launch.relay_grid),
  ("finalize", lambda q: f"{q.launch.finalize_grid}x{q.launch.finalize_threads}"),
  ("dispatch", lambda q: f"{q.launch.dispatch_grid}x{q.launch.dispatch_threads}"),
)


def markdown_table(plans: Sequence[Plan]) -> str:
  """A Markdown table with one row per plan (the decisions of Table 2 and the launch numbers)."""
  header = "| " + " | ".join(name for name, _ in _TABLE_COLUMNS) + " |"
  rule = "|" + "|".join(" ---: " for _ in _TABLE_COLUMNS) + "|"
  rows = ["| " + " | ".join(str(get(q)) for _, get in _TABLE_COLUMNS) + " |" for q in plans]
  return "\n".join([header, rule, *rows])
