"""The contract between the role kernels and the C++ runtime: kernel parameters and the workspace layout.

One source of truth: the kernels (CuTe DSL, `gcmoe_jax/kernels/`) index the workspace with these offsets, and the
runtime (`csrc/`) receives them as FFI attributes computed here, so the two cannot drift.

**Kernel parameters** (every role kernel takes the same list, in this order; `PARAMS`):
13 device pointers (8 bytes each) then ``T`` (int32, tokens this call, <= the variant's token capacity) and
``clamp`` (float32; ``+inf`` means no clamp, which is exactly the unclamped math: ``min(g, inf) = g``).

**Epoch protocol.** ``header.epoch`` counts completed calls. Every role reads it at start and works on
``cur = epoch + 1``; role 1 publishes expert e by storing ``ready[e] = cur`` (release) after writing ``count[e]``
and ``rows[e]``, and in the v2 kernels appends an expert with rows to the call's active queue (`active_queue`);
role 2 waits for ``ready[e] == cur`` (v1) or for the queue's final size (v2, which then reads the closed queue;
acquire, bounded by ``header.timeout_ns``); role 3 runs after both (graph edges) and stores ``epoch = cur`` last.
(Where the graph holds role 2 alone, `TOKENS_SOLO`, its item CTAs list the routes themselves and its combining CTAs
do role 3's part.) Nothing is reset between calls, and a replay under an XLA command buffer (where the host handler
is not called) stays correct because the epoch lives on the device.

**Faults.** A wait that expires writes the error record (role, block, epoch, counter = the awaited expert,
observed value) once (CAS on ``error.flag``), and the role returns without trapping, so the context stays usable;
role 3 (or role 2's combining CTAs) then writes NaN into every output row and copies the record into the runtime's
pinned host mirror (``host_mirror``, mapped memory: no copy node in the graph, nothing written on the common path).
The runtime reads the mirror without synchronising and reports the record as an FFI error.
"""

from __future__ import annotations

import dataclasses

from gcmoe_jax import geometry

__all__ = ["HEADER", "PARAMS", "Workspace", "active_queue", "arrivals", "bf16_passes", "counter_words",
           "fused_counters", "item_order", "pull_cache", "queue_counter", "relay_counters", "role2_done", "scan_tokens",
           "solo_ctas", "combine_blocks", "workspace_layout", "SILU_TABLE_ENTRIES"]

# Kernel parameter names, in order: 13 pointers, then T (int32) and clamp (float32).
PARAMS = ("x", "ids", "route_weights", "w13", "w13_scale", "w2", "w2_scale", "s13", "s13_scale", "s2", "s2_scale",
          "y", "workspace", "tokens", "clamp")
NUM_POINTER_PARAMS = 13
# Role 2 (v2) takes two more formals after these: the TensorMaps of its weight tiles, 128 bytes each, by value
# (`roles_v2.RoleKernelsV2.tensormaps` describes them; the runtime encodes them from the w13 and w2 pointers).
ROLE2_TENSORMAPS = ("w13_map", "w2_map")
# A TensorMap as the runtime receives it (int64 fields, `tensormap_fields`): the ABI pointer it maps, its element
# type (CUtensorMapDataType), the two dimensions (elements), the row stride (bytes), the box, and the swizzle
# (CUtensorMapSwizzle).
# "u4x16_align16" is CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B: 4-bit elements, each 16 (8 B) landing in a 16-byte slot of
# SMEM (the expanded FP4 path of the sm_120a seam).
TENSORMAP_DTYPES = {"uint8": 0, "u4x16_align16": 14}
TENSORMAP_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
TENSORMAP_FIELDS = 8


def tensormap_fields(m: dict) -> tuple[int, ...]:
  """The `TENSORMAP_FIELDS` int64 values of one map description (`roles_v2.RoleKernelsV2.tensormaps`)."""
  return (PARAMS.index(m["param"]), TENSORMAP_DTYPES[m["dtype"]], m["dims"][0], m["dims"][1], m["row_stride"],
          m["box"][0], m["box"][1], TENSORMAP_SWIZZLES[m["swizzle"]])

# Header fields: byte offsets inside the first 256 bytes of the workspace.
HEADER = {
  "epoch": 0,  # u32: completed calls
  "error_flag": 4,  # u32: 0 = no error; set once by the first wait that expires
  "timeout_ns": 8,  # u64: bound of every spin-wait of this call (globaltimer nanoseconds; see steady_timeout_ns)
  "error_role": 16,  # u32
  "error_block": 20,  # u32
  "error_epoch": 24,  # u32
  "error_counter": 28,  # u32: what was awaited (role 2: the expert id, plus WAIT_GEMM1 / WAIT_XQ in v2; or
  #                      WAIT_SHARED + the first token of a shared-expert GEMM2 item's token group)
  "error_observed": 32,  # u32: the value seen last
  "stall_expert": 36,  # i32: test hook: role 1 never publishes this expert (-1 = off; STALL_CALL: see there)
  "host_mirror": 40,  # u64: device address of the runtime's pinned host copy of this header (0 = none)
  # The fused transport (ranks > 1; docs/fused_transport.md), set once by the runtime before the first replay:
  "x_ready": 48,  # u32: epoch tag of this rank's call whose x, ids, route weights and T are published
  "rank": 52,  # u32: this rank
  # u64: the spin bound of every call after the first. A group across processes starts with a longer ``timeout_ns``
  # (GCMOE_FIRST_WAIT_TIMEOUT_MS: a peer process may still be compiling or loading when this rank's first call waits
  # for it), and role 3 of a fused variant's first call (epoch 0) copies this word into ``timeout_ns``.
  "steady_timeout_ns": 56,
  "peers": 64,  # u64 [MAX_RANKS]: every rank's workspace base address, this one's included (the peer table)
  # u32, set once by the runtime: role 2's grid where role 3 runs beside role 2 (on the dispatch partition, after
  # role 1) and waits for that many role-2 CTAs to count themselves done (`role2_done`); 0: role 3 runs after role 2
  # (a graph edge) and does not wait. See `FINALIZE_EARLY_TOKENS`.
  "role2_grid": 192,
  # u32, set once by the runtime: role 2's combining CTAs where the graph holds role 2 alone (`TOKENS_SOLO`), 0 where
  # roles 1 and 3 run too (the kernels do not read it: a record for tests and debugging).
  "solo": 196,
}
MAX_RANKS = 16
# Words of the header that role 3 copies to ``host_mirror`` when ``error_flag`` is set: error_flag .. error_observed.
# error_flag while the first fault's thread writes the record (then 1), and how long role 3 waits for it to finish
# before it mirrors the record anyway.
FAULT_WRITING = 2
FAULT_WRITE_NS = 1_000_000
MIRROR_WORDS = ("error_flag", "error_role", "error_block", "error_epoch", "error_counter", "error_observed")
HEADER_BYTES = 256
# One GPU, v2 kernels: up to this many tokens the runtime puts role 3 on the dispatch partition after role 1, beside
# role 2, where it waits for role 2's CTAs (`HEADER["role2_grid"]`) instead of being launched after role 2 ends: the
# graph edge role 2 -> role 3 and role 3's launch leave the critical path (docs/kernels_v2.md "Role 3 beside role
# 2"). One CTA per token must fit the dispatch partition (else role 3 stays after role 2).
FINALIZE_EARLY_TOKENS = 8
# One GPU, v2 kernels: up to this many tokens (and 64 assignments: `scan_tokens`) every role-2 CTA lists the routes
# itself (`roles_v2.RoleKernelsV2._scan_routes`) instead of reading role 1's active queue, and the runtime's graph
# holds role 2 alone (`TOKENS_SOLO`): role 1's remaining work (the fault of an id >= E) and role 3's (y) move into
# role 2's kernel, so two nodes, their launches and role 3's wait leave the layer (docs/kernels_v2.md "Role 2 alone
# at B <= 8"; up to session 31 role 2 listed the routes of at most 4 tokens and 32 assignments, a lane each).
SCAN_TOKENS = 8
# Role 2's ``tokens`` parameter carries this bit where the graph holds role 2 alone: its last CTAs, one per token and
# block of `COMBINE_COLS` columns (`solo_ctas`), launched beyond its item grid, do roles 1 and 3's work.
TOKENS_SOLO = 1 << 30
COMBINE_COLS = 2048  # columns of y per combining CTA (8 per thread of 256: `roles_v1.RoleKernelsV1._combine`)
PLANES = 3  # signed 6-bit digit planes of an E4M3 value times 512 (|512 v| <= 229,376 < 2**18)
DIGIT_BITS = 6
NAN_WORD = 0x7FFFFFFF  # exponent word of a block that held a NaN/Inf (not a multiple of 2**23)
# Block exponent word of the shared expert's operands (`Workspace.sxe`, ``sae``) for a block that held a NaN/Inf
# (UE8M0 exponents lie in [-127, 127]).
SHARED_NAN_EXP = 1 << 30
SHARED_PLANES = 4  # the shared expert's digit planes H1, H0, L1, L0 (`Workspace.sxp`)
# `Workspace.shx`: one block's exchange, where its BF16 values start, and the bytes of one token's 32 values (a
# group of two tokens exchanges both).
SHX_BYTES, SHX_VALUES, SHX_TOKEN_BYTES = 256, 64, 64
HALVES_TOKENS = 2  # a last token group of at most this many tokens takes its shared items in halves
FAST_EXP = (-63, 35)  # e - 10 of every block of a row in this range (and no NaN): the row may take the fast path
# error_counter of a role-2 wait, by what was awaited (low bits: the expert id where there is one).
WAIT_READY, WAIT_GEMM1, WAIT_XQ, WAIT_SHARED = 0, 0x10000, 0x20000, 0x30000
# Waits of the fused transport: a peer's published call (+ the peer's rank; role 1), a peer row's bulk copy (+ the
# peer's rank; role 1's pull engine), and this rank's returned rows (role 3).
WAIT_PEER, WAIT_RECEIVED, WAIT_RETURNS = 0x40000, 0x50000, 0x60000
WAIT_RELAY = 0x70000  # a relay copier (role 2) waited for experts' GEMM2 items (observed: experts left)
WAIT_PIPE = 0x80000  # role 2's K loop waited for a stage's copies or readers (observed: the K128 block)
WAIT_GATE = 0x90000  # a role-1 CTA of the direct scan (B <= 2) waited for block 0's scan of the peers (role 4)
# Role 2 waited for role 1 to close its active queue (+ the entries appended; observed: the same). Where an expert is
# still unpublished when the bound expires, the record names it instead (WAIT_READY + e, observed ready[e]).
WAIT_QUEUE = 0xA0000
# Role 3 beside role 2 (`FINALIZE_EARLY_TOKENS`), or role 2's combining CTAs where it runs alone (`TOKENS_SOLO`),
# waited for role 2's CTAs to finish (observed: the CTAs done), or role 3's block 0 for every role-3 CTA to have read
# the epoch (observed: the CTAs in).
WAIT_ROLE2, WAIT_ROLE3 = 0xB0000, 0xC0000
ITEM_NONE = 0x7FFFFFFF  # role 2 of the fused transport: a claim that found no item (an expired wait for the queue)
STALL_CALL = -2  # stall_expert of a fused-transport rank that never publishes its call (x_ready) to the peers
ROLE_TRANSPORT = 4  # error_role of an expired fused-transport wait (error_counter: WAIT_PEER..WAIT_RELAY, WAIT_GATE)
SILU_TABLE_ENTRIES = 1 << 16  # float32 silu(g) per BF16 bit pattern (reference.silu_table)
ALIGN = 256
# The timeline of a `GCMOE_ABLATION=timeline` build (docs/kernels_v2.md "Timeline"): %globaltimer stamps (u64 ns)
# after the workspace (``Workspace.total``), one record per call slot ``cur % TL_CALLS``. A slot: TL_HEAD words
# (role 1 block 0 entry and exit, role 3 block 0 entry and exit, cur), then per role-2 CTA b < TL_CTAS its
# TL_CTA_WORDS: entry, phase 0 done, expert table done, exit, items taken, the SM's %smid + 1, 2 spare, then per item
# i < TL_ITEMS (item, start after the claim, start of its MMAs after any wait, end).
TL_CALLS, TL_CTAS, TL_ITEMS, TL_HEAD = 16, 512, 48, 16
TL_CTA_WORDS = 8 + 4 * TL_ITEMS
TL_CALL_WORDS = TL_HEAD + TL_CTAS * TL_CTA_WORDS
TIMELINE_BYTES = 8 * TL_CALLS * TL_CALL_WORDS


def scan_tokens(top_k: int, capacity: int, ranks: int = 1) -> int:
  """The tokens up to which role 2 (v2) lists the routes itself and the graph may hold role 2 alone: `SCAN_TOKENS`,
  at most 64 assignments (two per lane) and the token capacity; 0 with the fused transport (R > 1)."""
  return 0 if ranks > 1 else min(SCAN_TOKENS, 64 // top_k, capacity)


def combine_blocks(hidden: int) -> int:
  """Blocks of `COMBINE_COLS` columns one token's y takes in the combine."""
  return -(-hidden // COMBINE_COLS)


def solo_ctas(hidden: int, tokens: int) -> int:
  """Role 2's combining CTAs where the graph holds it alone with ``tokens`` tokens (at least one)."""
  return max(tokens, 1) * combine_blocks(hidden)


def _align(n: int) -> int:
  return (n + ALIGN - 1) // ALIGN * ALIGN


def _align4(n: int) -> int:
  return (n + 3) // 4 * 4


@dataclasses.dataclass(frozen=True)
class Workspace:
  """Byte offsets of the workspace sections for one variant (E local experts, token capacity, k, H)."""

  silu_table: int  # f32 [65536]
  ready: int  # u32 [E]: epoch tag of expert e's publication
  count: int  # i32 [E]: rows routed to expert e this call
  rows: int  # i32 [E, capacity * k]: assignment index t * k + j of each row, in token order
  arena: int  # bf16 [capacity * k, H]: o_j of assignment t * k + j
  shared_out: int  # bf16 [capacity, H]: the shared expert's output (0 bytes without it)
  # Sections of the v2 kernels (`roles_v2`; 0 bytes when ``intermediate`` is 0). An MXFP8 K32 block of one row is
  # stored as three signed digit planes (`PLANES`): int8 [3, 32] with 512 v = d0 + 2**6 d1 + 2**12 d2, so an
  # FP8 x FP4 block dot is three exact int8 MMAs; its exponent word is (e - 10) << 23, or `NAN_WORD` for a block
  # that held a NaN/Inf. A row's flag word equals the call's epoch tag when one of its blocks is NaN or has an
  # exponent outside `FAST_EXP` (then its tiles take the exact slow path; no reset is needed between calls).
  xplanes: int  # int8 [capacity, H / 32, 3, 32]: x, quantized once per call by role 2's first phase
  xexp: int  # i32 [capacity, H / 32]
  xflag: int  # u32 [capacity]
  aplanes: int  # int8 [capacity * k, I / 32, 3, 32]: the requantized SwiGLU output of assignment t * k + j
  aexp: int  # i32 [capacity * k, I / 32]
  aflag: int  # u32 [capacity * k]
  counters: int  # u32 [2, E + 1 (+ capacity)] by call parity: GEMM1 tiles done per expert, then CTAs done
  #               quantizing x, then (with a shared expert) the shared expert's GEMM1 items done per token group
  # UE8M0 scale bytes of those blocks (e + 127; 0xFF for a block that held a NaN/Inf), for the sm_120a seam, whose
  # block-scaled MMA reads four of them (one K128 stage) as one word. There, plane 0 of a block holds its E4M3
  # codes and planes 1-2 are unused.
  xsf: int  # u8 [capacity, H / 32]
  asf: int  # u8 [capacity * k, I / 32]
  # The shared expert's operands (v2 with a shared expert), MXFP8 split as its FP8 x FP8 block dots use them
  # (`reference` module doc): ``8 v`` where |v| >= 1 else 0 (hi), ``512 v`` where |v| < 1 else 0 (lo), as the
  # `SHARED_PLANES` signed 6-bit digit planes H1, H0, L1, L0 of a K32 block (hi = 64 H1 + H0, lo = 64 L1 + L0, 32
  # bytes each), and per K32 block its exponent e, or `SHARED_NAN_EXP` for a block that held a NaN/Inf. x is
  # written by role 2's first phase, the requantized SwiGLU output by the shared GEMM1 items; the GEMM items copy
  # both into SMEM as they are.
  sxp: int  # int8 [capacity, H / 32, 4, 32]
  sxe: int  # i32 [capacity, H / 32]
  sap: int  # int8 [capacity, Is / 32, 4, 32]
  sae: int  # i32 [capacity, Is / 32]
  # The halves' exchange of a token group of one or two tokens (`HALVES_TOKENS`) in the shared GEMM1
  # (`roles_v2.RoleKernelsV2._shared_gemm1`): per K32 block of Is, `SHX_BYTES`: word 0 the epoch tag of the last
  # half that arrived (an exchange, acq_rel: the half that reads this call's tag is the second and requantizes the
  # block), from byte `SHX_VALUES` + `SHX_TOKEN_BYTES` t the block's 32 BF16 SwiGLU outputs of token t, each half
  # writing its 16. Only the last token group of a call can be that small, so one exchange per block suffices; the
  # tags are epoch-tagged, so nothing is reset.
  shx: int  # u8 [Is / 32, SHX_BYTES]
  # The fused transport (ranks R > 1; 0 bytes otherwise). A row of the R C global tokens g = p C + t (rank p's
  # token t) and a global assignment g k + j index the receive side: ``rows``, ``aplanes``..``asf`` then hold
  # R C k rows instead of C k. Each rank publishes its call's ids, route weights and T by parity (peers may still
  # read the previous call's), role 1 copies the rows its experts need from the peers' ``xplanes``..``xsf`` into
  # ``rx*`` and their route weights into ``grw``; peers store the GEMM2 rows of this rank's tokens into its
  # ``arena`` and count them in ``counters`` (`counter_words`).
  pub_ids: int  # i32 [2, capacity * k]
  pub_rw: int  # f32 [2, capacity * k]
  pub_tokens: int  # i32 [2]
  rxplanes: int  # int8 [R capacity (x k without the pull cache), H / 32, 3, 32]
  rxexp: int  # i32 [R capacity, H / 32]
  rxflag: int  # u32 [R capacity]
  rxsf: int  # u8 [R capacity, H / 32]
  grw: int  # f32 [R capacity * k]: route weight of each received assignment
  # The packed routes: role 1's pulling warps store each global assignment's local expert (0xFF: none), so the
  # expert lists are built from local memory (the peers' ids cross the fabric once).
  rtags: int  # u8 [R capacity * k], padded to a word
  # The direct scan (B <= 2): block 0 polls the peers and opens this gate (word 0: the epoch) with their T (words
  # 1..R; -1: that peer's wait failed), so the other role-1 CTAs spin on local memory.
  rgate: int  # i32 [1 + R]
  # x's E4M3 codes, a row of H bytes per token, written by role 2's first phase with ``xsf``: role 1's pull engine
  # copies a row's codes and scale bytes (H + H / 32 bytes, not the 3 H + H / 8 of its digit planes and exponent
  # words) and makes the planes, exponent words and flag on the receiving side.
  xq: int  # u8 [capacity, H]
  # The relay return path: GEMM2 rows parked position-major (global assignment g k + j) for the copier CTAs.
  relay_arena: int  # bf16 [R capacity * k, H]
  # Each routed GEMM1 item's completion (one GPU; read only by a `GCMOE_ABLATION=kbany` build, whose GEMM2 stages
  # wait per K128 block, out of K order: docs/kernels_v2.md "GEMM2 stages out of K order"): one 64-bit word per
  # (expert, item j < 2I/128), stored once by the item after its requantized blocks (fence, then one relaxed 64-bit
  # store): low word the call's epoch tag, high word 1 where one of its blocks sent its row to the slow path.
  # Epoch-tagged, so nothing is reset between calls.
  g1tags: int  # u64 [E, 2I / 128]
  # The BF16 wide passes (`bf16_passes`; docs/kernels_v2.md "Session 59"): x and the requantized SwiGLU output
  # once more, each K32 block as its 32 MXFP8 values with the block scale folded in (``q 2**e``, exact in BF16),
  # stored in the wgmma fragment's K order (`bf16fold.B_PLANE_ORDER`). Written beside the digit planes by the same
  # writers (`roles_v2.RoleKernelsV2._quantize_lane`); 0 bytes otherwise.
  xbf: int  # bf16 [capacity, H / 32, 32]
  abf: int  # bf16 [capacity * k, I / 32, 32]
  # The shared expert's token groups on BF16 wgmma (`shared_bf16`; docs/kernels_v2.md "Session 61"): its GEMM2's
  # operand, the requantized SwiGLU output, as BF16 planes like ``abf`` (its GEMM1 reads ``xbf``), and a flag per
  # token tagged with the call's epoch where one of its blocks is NaN or has an exponent outside `FAST_EXP` (its
  # groups then take the digit MMAs). 0 bytes otherwise.
  sabf: int  # bf16 [capacity, Is / 32, 32]
  saflag: int  # i32 [capacity]
  total: int  # bytes

  def as_attrs(self) -> dict[str, int]:
    return {f"ws_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}


def counter_words(experts: int, capacity: int, shared: bool, ranks: int = 1, relay: bool = False) -> int:
  """Words of one parity of the v2 ``counters`` section: E experts, the x-quantization count, with a shared
  expert one per token (its token groups of 8 or 16 use the first ceil(T / 8) or ceil(T / 16)), with R > 1 ranks
  two more (`fused_counters`), on the relay return path one per expert (its GEMM2 items done, `relay_counters`),
  role 2's item queue (`queue_counter`), role 1's active queue of experts (`active_queue`: 2 + E), with R > 1 ranks
  role 1's arrivals and row claims per expert (`arrivals`: 2 E), and last role 2's CTAs done (`role2_done`)."""
  return role2_done(experts, capacity, shared, ranks, relay) + 2


def role2_done(experts: int, capacity: int, shared: bool, ranks: int = 1, relay: bool = False) -> int:
  """Word index, in one parity of ``counters``, of role 2's CTAs done: each adds 1 (release) after its last item's
  stores, and role 3 beside role 2 waits for ``HEADER["role2_grid"]`` of them (`FINALIZE_EARLY_TOKENS`), or where
  role 2 runs alone (`TOKENS_SOLO`) its combining CTAs for all of its item CTAs; the next word counts role 3's CTAs
  (or the combining ones) in."""
  return active_queue(experts, capacity, shared, ranks, relay) + 2 + experts + (2 * experts if ranks > 1 else 0)


def queue_counter(experts: int, capacity: int, shared: bool, ranks: int = 1, relay: bool = False) -> int:
  """Word index, in one parity of ``counters``, of role 2's item queue: each CTA claims its next work item by an
  atomic add on it (items in the order of `roles_v2.RoleKernelsV2.role2_tc`), role 3 zeroes it for the next call."""
  return experts + 1 + (capacity if shared else 0) + (2 if ranks > 1 else 0) + (experts if relay else 0)


def active_queue(experts: int, capacity: int, shared: bool, ranks: int = 1, relay: bool = False) -> int:
  """Word index, in one parity of ``counters``, of role 1's active queue (paper §4.5, v2 kernels): the append
  position (an atomic add per expert hit), the final size plus one (stored, release, once every expert of the call
  is published; 0 = not yet), then E entries, entry h = (the h-th expert published with rows) + 1 (release; 0 = not
  yet). Role 3 zeroes them with the other counters, so a nonzero word is this call's."""
  return queue_counter(experts, capacity, shared, ranks, relay) + 1


# Role 2's item queue (`roles_v2.RoleKernelsV2.role2_tc`): the item kinds in claim order. Every wait is for an
# earlier item (a routed GEMM2 item for its expert's GEMM1 items, a shared GEMM2 item for its token group's GEMM1
# items), so with the whole grid resident no CTA waits on an item a waiting CTA holds. The shared expert's GEMM1
# needs only phase 0, so in variants of up to `SHARED_FIRST_TOKENS` tokens its items go first, beside the routed
# GEMM1 from the start; above, the routed ones (H200, session 18: shared first was up to 13 % faster at B <= 32 and
# 0.4-1.8 % slower at B >= 128; docs/kernels_v2.md "The shared expert's items first").
# `GCMOE_ABLATION=sharedfirst` / `routedfirst` build one order in every variant, for A/B timing.
ITEM_ORDER_SHARED_FIRST = ("shared GEMM1", "routed GEMM1", "shared GEMM2", "routed GEMM2")
ITEM_ORDER_ROUTED_FIRST = ("routed GEMM1", "shared GEMM1", "routed GEMM2", "shared GEMM2")
SHARED_FIRST_TOKENS = 32


# Role 2's widest pass on sm_90a by the rows an expert receives at the variant's token capacity C, r = ceil(C k / E)
# (the paper's eq. 1, which also picks its tile_n tier): (r up to, n-tiles of 8 rows, CTAs per SM). Passes narrower
# than 64 rows run two CTAs per SM at 128 registers (twice the warps per scheduler) where the experts' rows fit
# them; past the last tier, passes of 64 rows (`ROUTED_NT_MAX` n-tiles) at one CTA, whose decode is shared by more
# tokens. Measured on the H200 (docs/kernels_v2.md "Pass width by rows per expert") for top-k > 1. Not for k = 1,
# the expert-parallel local op, whose rows `ffi._moe.in_chunks` sorts by expert past 256: a chunk's experts then
# receive more rows than C k / E, so those variants keep the rule by capacity.
PASS_TIERS = ((8, 2, 2), (32, 4, 2))
ROUTED_NT_MAX = 8
SMALL_CAPACITY = 32  # the rule before session 27 (and sm_120a's): two CTAs per SM up to this token capacity
# Passes of up to this many n-tiles decode each weight code into two int8 operands (`roles_v2._stage`, the split
# decode); wider ones run on BF16 wgmma on sm_90a (`bf16_passes`).
SPLIT_DECODE_NT = 2


def pass_tier(capacity: int, top_k: int, experts: int, ablation: str = "", *,
              by_rows: bool = True) -> tuple[int, int]:
  """(n-tiles of role 2's widest pass, CTAs per SM) of a variant by `PASS_TIERS`; for k = 1, without ``by_rows``
  (sm_120a, the fused transport: `roles_v2.pass_tier`), or with ``ablation`` ``onecta`` (for A/B timing), the rule
  before session 27: two CTAs and passes of 16 rows up to capacity `SMALL_CAPACITY`, else one and 64 rows."""
  if not by_rows or ablation == "onecta" or top_k == 1:
    return (2, 2) if capacity <= SMALL_CAPACITY else (ROUTED_NT_MAX, 1)
  r = geometry.rows_per_expert(capacity, top_k, experts)
  for rows, nt, ctas in PASS_TIERS:
    if r <= rows:
      return nt, ctas
  return ROUTED_NT_MAX, 1


def bf16_passes(capacity: int, top_k: int, experts: int, ranks: int = 1, ablation: str = "",
                arch: str = "sm_90a") -> bool:
  """Whether role 2 of a variant runs its routed passes wider than `SPLIT_DECODE_NT` n-tiles on BF16 ``wgmma``
  with the block scales folded into the operands (docs/kernels_v2.md "Session 59"; the default since session 60,
  6-34 % less latency at B = 64-256 on the H100): sm_90a, one GPU, the cp.async producer, unless ``ablation`` is
  ``int8wide`` (the int8 bodies, for A/B timing). Its workspace then holds the BF16 planes (`Workspace.xbf`,
  ``abf``; the layout is one per variant, so an sm_120a run allocates them unused)."""
  return (arch.startswith("sm_90") and ranks == 1 and ablation not in ("int8wide", "tma", "threecta")
          and pass_tier(capacity, top_k, experts, ablation)[0] > SPLIT_DECODE_NT)


def shared_bf16(shared: bool, ranks: int = 1, ablation: str = "", arch: str = "sm_90a") -> bool:
  """Whether role 2 of a variant runs the shared expert's token groups of 8 or 16 on BF16 ``wgmma``
  (docs/kernels_v2.md "Session 61"): with a shared expert, sm_90a, one GPU, behind ``GCMOE_ABLATION=shbf16``
  until measured. Its workspace then holds ``xbf`` (GEMM1's B), ``sabf`` and ``saflag``
  (GEMM2's)."""
  return shared and arch.startswith("sm_90") and ranks == 1 and ablation == "shbf16"


def item_order(capacity: int, ablation: str = "") -> tuple[str, ...]:
  """The queue's item kinds in claim order in a variant of token capacity ``capacity``, for a build of
  ``GCMOE_ABLATION=ablation``."""
  if ablation == "routedfirst" or (ablation != "sharedfirst" and capacity > SHARED_FIRST_TOKENS):
    return ITEM_ORDER_ROUTED_FIRST
  return ITEM_ORDER_SHARED_FIRST


# Role 1's expert-granular publish (fused transport, paper §4.5): each dispatch CTA adds `ARRIVAL_CTA` minus the
# rows it claimed for expert e to ``arrive[e]`` once it listed its routes, and each landed row adds 1, so ``arrive[e]``
# reaches grid x `ARRIVAL_CTA` exactly when every CTA listed its routes and every row of e landed; the thread whose
# add gets it there publishes e. A CTA claims fewer than R C k <= 2**16 rows, and grid x 2**20 stays below 2**32.
ARRIVAL_CTA = 1 << 20


def arrivals(experts: int, capacity: int, shared: bool, relay: bool = False) -> int:
  """Word index, in one parity of ``counters`` of a fused variant (R > 1), of ``arrive[0]`` (`ARRIVAL_CTA`); E words
  on, ``claim[0]``: expert e's rows claimed so far (an atomic add takes a row's place in ``rows[e]``)."""
  return active_queue(experts, capacity, shared, 2, relay) + 2 + experts


def relay_counters(experts: int, capacity: int, shared: bool) -> int:
  """Word index, in one parity of ``counters``, of expert 0's count of GEMM2 items done (the relay path)."""
  return fused_counters(experts, capacity, shared)[1] + 1


def pull_cache(top_k: int, ranks: int) -> bool:
  """Whether role 1 pulls a token's row once per (rank, token) (the paper's pull cache: k >= R, where a token
  usually reaches several experts of one rank) or once per route (k < R)."""
  return top_k >= ranks


def fused_counters(experts: int, capacity: int, shared: bool) -> tuple[int, int]:
  """Word indices, in one parity of ``counters``, of the fused transport's counts: experts role 1 published (the
  thread that publishes the last one closes the active queue), and GEMM2 rows returned to this rank by every rank
  (C k valid routes x H / 128 tiles when all landed)."""
  base = experts + 1 + (capacity if shared else 0)
  return base, base + 1


def workspace_layout(experts: int, capacity: int, top_k: int, hidden: int, shared: bool,
                     intermediate: int = 0, shared_intermediate: int = 0, ranks: int = 1,
                     relay: bool = False, bf16: bool = False, shared_bf16: bool = False) -> Workspace:
  """The workspace layout of a variant: sections in a fixed order, each 256-byte aligned.

  ``intermediate`` (I) sizes the v2 sections; 0 leaves them empty (the v1 kernels do not use them).
  ``shared_intermediate`` (Is) sizes the v2 shared-expert sections (0: none). ``ranks`` (R, v2 only) > 1 adds the
  fused transport's sections and sizes the receive side for R C tokens. ``bf16`` (one GPU, v2) adds the BF16
  planes of the BF16 wide passes (``xbf``, ``abf``), last, so that no other section moves; ``shared_bf16`` (one GPU,
  v2, a shared expert: `shared_bf16`) ``xbf`` and the shared expert's ``sabf``, ``saflag`` after them.
  """
  if not 1 <= ranks <= MAX_RANKS:
    raise ValueError(f"workspace_layout: ranks must be in [1, {MAX_RANKS}], got {ranks}")
  off = HEADER_BYTES
  sections = {}
  v2 = intermediate > 0
  fused = v2 and ranks > 1
  relay = relay and fused
  # Received rows: one per (rank, token) with the pull cache, else one per (rank, token, slot).
  rx = capacity * ranks * (1 if pull_cache(top_k, ranks) else top_k) if fused else 0
  rcap = capacity * ranks if fused else capacity  # tokens whose assignments the receive side holds
  block_bytes = PLANES * 32
  for name, size in (("silu_table", 4 * SILU_TABLE_ENTRIES), ("ready", 4 * experts), ("count", 4 * experts),
                     ("rows", 4 * experts * rcap * top_k), ("arena", 2 * capacity * top_k * hidden),
                     ("shared_out", 2 * capacity * hidden if shared else 0),
                     ("xplanes", capacity * (hidden // 32) * block_bytes if v2 else 0),
                     ("xexp", capacity * (hidden // 32) * 4 if v2 else 0),
                     ("xflag", capacity * 4 if v2 else 0),
                     ("aplanes", rcap * top_k * (intermediate // 32) * block_bytes if v2 else 0),
                     ("aexp", rcap * top_k * (intermediate // 32) * 4 if v2 else 0),
                     ("aflag", rcap * top_k * 4 if v2 else 0),
                     ("counters", 2 * 4 * counter_words(experts, capacity, shared, ranks, relay) if v2 else 0),
                     ("xsf", capacity * (hidden // 32) if v2 else 0),
                     ("asf", rcap * top_k * (intermediate // 32) if v2 else 0),
                     ("sxp", SHARED_PLANES * capacity * hidden if v2 and shared else 0),
                     ("sxe", 4 * capacity * (hidden // 32) if v2 and shared else 0),
                     ("sap", SHARED_PLANES * capacity * shared_intermediate if v2 and shared else 0),
                     ("sae", 4 * capacity * (shared_intermediate // 32) if v2 and shared else 0),
                     ("shx", SHX_BYTES * (shared_intermediate // 32) if v2 and shared else 0),
                     ("pub_ids", 2 * 4 * capacity * top_k if fused else 0),
                     ("pub_rw", 2 * 4 * capacity * top_k if fused else 0),
                     ("pub_tokens", 2 * 4 if fused else 0),
                     ("rxplanes", rx * (hidden // 32) * block_bytes),
                     ("rxexp", rx * (hidden // 32) * 4),
                     ("rxflag", rx * 4),
                     ("rxsf", rx * (hidden // 32)),
                     ("grw", 4 * capacity * ranks * top_k if fused else 0),
                     ("rtags", _align4(capacity * ranks * top_k) if fused else 0),
                     ("rgate", 4 * (1 + ranks) if fused else 0),
                     ("xq", capacity * hidden if fused else 0),
                     ("relay_arena", 2 * capacity * ranks * top_k * hidden if relay else 0),
                     ("g1tags", 8 * experts * (2 * intermediate // 128) if v2 and not fused else 0),
                     ("xbf", 2 * capacity * hidden if (bf16 or shared_bf16) and v2 and not fused else 0),
                     ("abf", 2 * capacity * top_k * intermediate if bf16 and v2 and not fused else 0),
                     ("sabf", 2 * capacity * shared_intermediate if shared_bf16 and v2 and not fused else 0),
                     ("saflag", 4 * capacity if shared_bf16 and v2 and not fused else 0)):
    sections[name] = off
    off = _align(off + size)
  return Workspace(total=off, **sections)
