"""Role kernels v2 (issue 6): role 2 on the tensor cores, exact, as int8 MMAs over digit planes.

The math is that of `roles_v1` (docs/semantics.md, bit for bit); what changes is how role 2 computes it.

**The exact Hopper seam.** A K32 block dot of E4M3 activations and E2M1 weights is an integer: ``D = sum 512 x *
2 w`` with ``|512 x| <= 229,376 < 2**18`` and ``2 w`` in [-12, 12]. Each activation ``512 x`` is stored as three
signed 6-bit digits ``d0 + 2**6 d1 + 2**12 d2`` (`abi.PLANES`; every digit carries the sign), so

    D = S0 + 2**6 S1 + 2**12 S2,    S_p = sum d_p * 2 w    (mma.sync m16n8k32 .s32.s8.s8, exact int32)

and the rest is v1's epilogue, ``acc += f32(D) * 2**n`` in increasing K (n = the two block exponents - 10), done
without a conversion instruction on the fast path (`_stage`): the MMA accumulator input adds a float magic number,
so f32(T) and f32(S2) are exact subtractions, f32(D) one FMA, and the scaled add one more FMA. FP8 ``mma.sync`` is
emulated on sm_90 and FP8 ``wgmma`` sums with fewer bits than FP32 (its K32 sums are not exact); int8 MMAs are
exact and native.

**Role 2, CTAs of 256 threads (8 warps)**: one per compute SM with passes of up to 64 rows, or, for variants whose
experts receive at most 32 rows at their token capacity (`abi.PASS_TIERS`; for k = 1 and in the fused transport
variants of capacity <= 32, on sm_120a routed-only ones), two per SM with passes of up to 16 or 32 rows at <= 128
registers (build.py applies the .minnctapersm/.maxnreg rewrites of paper §5.1; twice the warps hide the MMA and SMEM
latencies better where the work per stage is small).

0. Phase 0 (every CTA): MXFP8 of x, one warp per (token, K32 block), a lane per element, into ``xplanes``/``xexp``
   (and ``xflag``); then ``counters[par][E] += 1`` (release). Then every CTA waits for the count to reach the grid
   and for role 1 to close the call's active queue (`abi.active_queue`: the experts with rows, appended as each is
   published, and the final size; one word polled, `_await_queue`), and copies the queue into its SMEM hit list.
1. GEMM1 items (h, j) over the hit list, j < 2I/128, each CTA claiming its next item from the call's queue (an
   atomic add, `_claim`): W13 rows 128 j..128 j + 127
   (gate/up of intermediate columns 64 j..64 j + 63). Swap-AB: weights on M (warp w: rows 16 w..16 w + 15, so a
   thread's C fragment holds gate (row g) and up (row g + 8) of one column), the expert's rows on N (chunks of up
   to 64, n-tiles of 8, bodies for 1, 2, 3, 4, 6 and 8 n-tiles). A multistage pipeline streams per K128:
   the 128 x 64 B weight tile (16 B chunk c of row r at c ^ ((r >> 1) & 3), read with ldmatrix without bank
   conflicts), the 128 scale words, and the 96 B digit planes + exponent words of every row (gathered through
   ``rows[e]``). Two producers share the stage layout: on sm_90a every thread issues cp.async and the CTA meets at a
   barrier per stage, or per two in the narrow passes of one-rank routed variants (`_cpasync_mainloop`, measured
   faster); on sm_120a warp 0 issues the tile by TMA through a by-value TensorMap (its 64-byte swizzle is the
   layout above), the rows by bulk copies, and full/empty mbarriers replace the barrier (`_tma_mainloop`, paper
   §4.4). Epilogue: SwiGLU + clamp + route weight in BF16 (v1's ops), BF16 to SMEM, then a warp per (row, K32
   block) requantizes to ``aplanes``/``aexp``; ``counters[par][e] += 1`` (release).
2. GEMM2 items (h, j), j < H/128, after all GEMM1 items (and the shared expert's GEMM1 items): W2 rows
   128 j.. (output columns), the same mainloop over K = I with the B operand from ``aplanes`` (gathered by
   assignment), after waiting for ``counters[par][e] == 2I/128``; o_j = bf16(acc) to ``arena``.
3. Shared-expert items (`_shared_core`), exact, on the int8 tensor cores, over token groups of `SH_TOKENS` (one
   n-tile; `SH_TOKENS_WIDE`, two, in the one-CTA sm_90a variants):
   GEMM1 items (group, 32 activation columns: 64 W13 rows against the group's x, which phase 0 also stores as
   the digit planes of its hi and lo parts, ``sxp``/``sxe``; SwiGLU; that K32 block of each token requantized
   into ``sap``/``sae``; then the group's counter += 1, release), placed after the routed GEMM1 items; GEMM2 items
   (group, 64 output columns: wait until the group's counter reaches its GEMM1 item count, then 64 W2 rows) last.
   An item streams K in steps of 8 K32 blocks through a cp.async double buffer: a warp per (m16 tile of the rows,
   K128 tile of the step) decodes its E4M3 weight bytes into digit planes by a 256-word SMEM table and prmt
   (`_e4m3_digits`), forms each block's three split dots from twelve int8 MMAs per n-tile of the group's tokens
   (`_sh_tiles`), or from six for a group of one or two tokens, whose digit planes fill the columns of two
   n-tiles (`_sh_two_rows`; such a group takes its items in halves of 32 rows), the blocks' contributions go
   through SMEM, and a thread per (token, row) adds them in K order. Every wait is for earlier items, so with the
   whole grid resident no CTA waits on an item a waiting CTA
   holds.

Every wait is bounded as in v1 (``header.timeout_ns``); a timeout records (role 2, block, epoch, counter =
`abi.WAIT_*` + expert, observed) and the CTA stops taking items. Counters are double-buffered by call parity
(``par = cur & 1``) and role 3 zeroes the next call's (``roles_v1`` role 3), so no reset pass runs and a faulted
call leaves the next one clean.

Roles 1 and 3 are v1's (role 1 also fills the active queue, role 3 also resets the counters). Role 2: block 256,
dynamic SMEM `dynamic_smem`.

**The sm_120a seam** (docs/sm120.md). Built for ``sm_120a``/``sm_121a``, everything above stays (items, pipeline,
swizzled weight tile and ldmatrix fragments, epilogues, waits) and three things change: phase 0 and the requant
store each block's E4M3 codes (plane 0) and its UE8M0 byte (``xsf``/``asf``, NaN block: 0xFF) instead of digit
planes; a stage stages plane 0 and one packed scale word per row (`QMMA_TOKEN_STRIDE`); and `_stage_qmma` issues
one block-scaled QMMA per K32 block, picking the block's scale byte with the byte-id immediate (`_qmma`), on
weights in 8-bit containers from one of the paper's two FP4 operand paths (§4.3), chosen per variant by the
geometry's tile tier at B = capacity (`geometry.compact_weights`): compact (the raw nibble tile above, expanded in
registers by prmt, `_exp4`) for tile_n in {48, 80, 96}, expanded otherwise (TMA's 16U4_ALIGN16B type spreads each
16 codes over a 16-byte slot, 16 KiB per stage, and ``ldmatrix ... b4x16_p64`` unpacks them into bytes:
`_expanded_fragment`). The pipeline depth comes from SM120's SMEM (`geometry.RTX_PRO_5000`). The hardware adds each
block's scaled product to the FP32 accumulator itself, so this build is not bit-identical to the oracle by
construction; it has not run (no SM120 GPU here).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute

from gcmoe_jax import _config, geometry
from gcmoe_jax.kernels import abi, bf16fold
from gcmoe_jax.kernels import roles_v1 as v1
from gcmoe_jax.kernels.build import Variant

__all__ = ["RoleKernelsV2", "any_stage_bytes", "stages"]

THREADS = v1.THREADS  # 8 warps
WARPS = THREADS // 32
TILE_M = 16 * WARPS  # weight rows per item: one m16 tile per warp
NT_MAX = abi.ROUTED_NT_MAX  # n-tiles of 8 rows per pass over the weights (64 rows)
PLANES = abi.PLANES
BLOCK_BYTES = PLANES * 32  # one (row, K32 block) of digit planes
TOKEN_STRIDE = 4 * BLOCK_BYTES + 32  # SMEM bytes per token per K128 stage: padded so n-tile loads miss no bank twice
QMMA_TOKEN_STRIDE = 4 * 32 + 32  # the sm_120a seam stages plane 0 only (E4M3 codes); conflict-free for lds.v2 too
# The expanded FP4 path reads B in the MMA's own K order (two 4-byte loads per K32 block, at 4 t4 and 16 + 4 t4):
# 144 B = 36 words per token puts a warp's 8 x 4 loads in 32 distinct banks.
QMMA_EXPANDED_TOKEN_STRIDE = 4 * 32 + 16
W_BYTES = TILE_M * 64  # weight tile per K128 (E2M1, 64 B per row): the compact tile
# The expanded tile of the sm_120a seam: TMA's 16U4_ALIGN16B type lands each 16 codes (8 B) in a 16-byte slot, so a
# K128 row is 128 B in SMEM, swizzled by 128 B (16 B chunk c of row r at c ^ (r & 7)).
W_BYTES_EXPANDED = TILE_M * 128
SC_BYTES = TILE_M * 4
# [ok, count, claimed item, T] and per-slot token/assignment/route-weight words, then the expert table
CTRL_BYTES = 1024
# The fused transport's role 1 (`RoleKernelsV2.role1_fused`, paper §4.5): CTAs per dispatch SM (more rows in flight;
# the paper's dispatch grid takes up to 4), 16-byte loads per lane issued before their stores when a warp pulls a
# peer row (the paper's register-batched pull path, 4 chunks there), and the batch size up to which only block 0
# polls the peers (the direct scan of B <= 2).
ROLE1_FUSED_CTAS_PER_SM = 2
# The pull engine (paper §4.5, `RoleKernelsV2._post` / `_drain`): two SMEM slots per warp, each one row's E4M3 codes
# and scale bytes (H + H / 32 bytes), so a warp has its next row's bulk copy in flight while it drains the last.
PULL_SLOTS = 2
PULL_DEPTH = 12
DIRECT_SCAN_TOKENS = 2
# One GPU: up to `abi.SCAN_TOKENS` tokens (and 64 assignments: `abi.scan_tokens`) every role-2 CTA lists the routes
# itself (`_scan_routes`, before it waits for the other CTAs' phase 0) and starts its items after phase 0, instead of
# waiting for role 1's closed active queue (at B = 1 the queue reached the CTAs' tables 4.4-7.2 us into the layer,
# phase 0 ended at 0.8-1.8 us: docs/kernels_v2.md "Role 2 lists the routes itself at B <= 4"); there the runtime's
# graph holds role 2 alone (`abi.TOKENS_SOLO`, `_solo_finalize`).
CTL_CLAIM = 8  # the item this CTA claimed from the queue (`RoleKernelsV2._claim`)
# This call's T, which the shared items read from SMEM: derived again per item instead of kept in registers across
# the item loop (with the one-token halves, ptxas spilled 60 B at the two-CTA register cap otherwise; 28-32 B so).
CTL_TOKENS = 12
CTL_SLOT_SRC, CTL_SLOT_ASG, CTL_SLOT_RW = 16, 16 + 32 * NT_MAX, 16 + 64 * NT_MAX
MAX_STAGES = 8
# The pipeline's mbarriers in the control area: full[MAX_STAGES] (the producer's arrivals and the copies' bytes),
# then empty[MAX_STAGES] (every consumer thread's arrival), 8 B each.
CTL_BARS = CTL_SLOT_RW + 4 * 8 * NT_MAX
# The producer's per-pass state (scale, plane and exponent row bases, 8 B each; the tile's first TensorMap row and
# the stage's expected bytes, 4 B each), in SMEM rather than registers live across every thread's MMAs.
CTL_PROD = CTL_BARS + 16 * MAX_STAGES
CTL_FAULT = CTL_PROD + 32  # the K128 block of a pipeline wait that timed out this pass, else -1
CTL_TL = CTL_FAULT + 4  # the timeline build's count of this CTA's recorded items
# The E2M1 decode's prmt tables (`DECODE_TABLES`), read from SMEM once per stage (`_stage`): as
# immediates ptxas rematerialised a table register before every prmt (one IMAD per 4 codes at the 128-register cap).
CTL_TABLES = CTL_TL + 4
# The fused transport's role 2 streams role 1's active queue (`RoleKernelsV2._claim_streaming`): the experts hit
# known when this CTA's claimed item was decoded (the queue's size once closed, else the experts it covers), and 1
# where the claim first saw the closed queue (the CTA then fills the expert table).
CTL_HITS, CTL_FILL = CTL_TABLES + 16, CTL_TABLES + 20
CTL_SCANNED = CTL_FILL + 4  # 1 where this call's routes were listed by the CTA itself (`_scan_routes`)
CTL_KPAIR = CTL_SCANNED + 4  # 1 where this call's GEMM2 items are `kpair` items (read per item, not kept)
assert CTL_KPAIR + 4 <= CTRL_BYTES
# `GCMOE_ABLATION=kbany` (`RoleKernelsV2._any_mainloop`; the cp.async producer, so in the TMA producer's mbarrier and
# state words, which it leaves unused): a one- or two-row GEMM2 pass's state (the K128 stages issued, those whose GEMM1
# items are done, the slow ones among them, 1 where a wait expired), the stage of each of the last 16 copy groups
# (`ANY_SIG_RING`; -1: none), and 1 where a block of the CTA's GEMM1 item sent its row to the slow path.
CTL_ANY = CTL_BARS
ANY_SIG_RING = 16
CTL_ANY_SIG = CTL_ANY + 16
CTL_G1SLOW = CTL_ANY_SIG + 4 * ANY_SIG_RING
assert CTL_G1SLOW + 4 <= CTL_FAULT
# A stage starts 1024-aligned: TMA's 64-byte swizzle is a function of the SMEM address bits 7-8, so the tile lands
# in the layout `_weight_words` reads (16 B chunk c of row r at c ^ ((r >> 1) & 3)) only from a 512-aligned base.
STAGE_ALIGN = 1024
STATIC_SMEM = 1024  # a role kernel's static SMEM as the DSL emits it (the build reports it; `build-kernels --report`)
# The pipeline area by CTAs per SM (1, 2, 3), of which role 2 takes a whole number of its widest pass's stages: 4 of
# 64 rows at one CTA; 6 of 16 rows or 4 of 32 at two (all 96 KB at 32 rows left ptxas a spill reload in the stage
# loops); at three (`GCMOE_ABLATION=threecta` only) 6 of 8 rows, the SM's 228 KB with the control area.
PIPE_AREA = (147456, 98304, 73728)

# The fast path needs n + 127 in [1, 226] for every element: 2**n normal, f32(D) * 2**n exact and finite. It is
# taken when every weight scale byte of the stage is in [64, 191] (bits 7 and 6 differ) and no row of the chunk is
# flagged (every block's e - 10 in abi.FAST_EXP = [-63, 35]).
SCALE_BYTE_BITS = v1._i32(0x80808080)
MAGIC = 0x4B400000  # 1.5 * 2**23 as float32 bits: MAGIC + T (|T| < 2**22) is the float 1.5 * 2**23 + T exactly
MAGIC_NEG = v1._f32_bits(-12582912.0)
F32_4096 = v1._f32_bits(4096.0)
# E2M1 code (low 3 bits) -> 2 w as int8, positive and negative, as prmt byte tables (bytes 0-3 in a, 4-7 in b).
POS_LO, POS_HI = 0x03020100, 0x0C080604
NEG_LO, NEG_HI = v1._i32(0xFDFEFF00), v1._i32(0xF4F8FAFC)
SIGN_SELECT = 0x0000FF00  # prmt table whose byte 1 is 0xFF: a selector nibble of 1 gives an all-ones byte
# The split decode of narrow passes (`_stage`, nt <= SPLIT_DECODE_NT): 2 w = P + N per code, P = 2 |2 w| for a
# positive code and 0 for a negative one (one prmt on the raw nibbles: a set sign bit selects prmt's sign-replicate
# mode, which turns these table bytes, all below 0x80, into 0), N = -|2 w| (one prmt on the magnitudes); P and N
# each take an MMA into the same int32 accumulator, so D is unchanged and exact.
POS2_LO, POS2_HI = 0x06040200, 0x18100C08
SPLIT_DECODE_NT = abi.SPLIT_DECODE_NT
PAIRED_BARRIER_NT = 2  # passes of at most this many n-tiles meet at a CTA barrier every two K128 stages
# Under `GCMOE_ABLATION=kpair` (`RoleKernelsV2.kpair`) calls of up to this many tokens, whose experts all hold at most
# this many rows, take their routed GEMM2 items in 64 rows with K split between warp pairs (docs/kernels_v2.md "Item
# balance").
KPAIR_TOKENS = 2
# Under `GCMOE_ABLATION=l2ahead` (`RoleKernelsV2.l2ahead`), calls of up to this many tokens: each routed GEMM1 item
# prefetches into L2 the weights of one of the last routed GEMM2 items of the queue, as many as `L2_AHEAD_BYTES` hold
# (docs/kernels_v2.md "GEMM2 weights into L2 ahead").
L2_AHEAD_TOKENS = 2
L2_AHEAD_BYTES = 24 << 20
# `GCMOE_ABLATION=shallow`: one-tile passes keep this many pipeline stages (the paired barrier's least), so each CTA
# has 4 K128 stages of copies in flight instead of 6 (timing: 1-5 % slower at B = 2-8 on the H100, as fast at B = 1).
SHALLOW_STAGES = 6
# `GCMOE_ABLATION=kbany`: after a one-row GEMM2 pass's stages (`any_stage_bytes`), each block's p for the ordered
# sum (per K128 stage, warp and lane of t4 < 2: 16 B).
ANY_P_BYTES = WARPS * 16 * 16  # per K128 stage
# A `kbany` pass polls its GEMM1 items' tags (one round trip, warp 0 before a CTA barrier) only where it has no ready
# stage left to issue and at most this many stages in the copy groups in flight (the two it computes next).
ANY_POLL_PENDING = 2
KPAIR_P_BYTES = 32 * 16  # a warp's p of one stage in a `kpair` pass: four blocks' p per lane, one 16 B store
DECODE_TABLES = (POS2_LO, NEG_LO, POS_LO, SIGN_SELECT)  # the table words `_stage` reads from `CTL_TABLES`
# The B columns of the one- and two-row bodies (`_stage`): column n is read by lane group g = n. One row: planes
# 0, 1, 0, 1, 2, 2, 2, 2, so lanes t4 = 0 and 1 hold S0, S1 of rows g and g + 8 and t4 = 2, 3 hold S2. Two rows: slot
# (n >> 1) & 1 with the same planes, so t4 = 0, 1 hold S0, S1 of slots 0, 1 and t4 = 2, 3 their S2.
PLANE_COLUMNS = (0, 1, 0, 1, 2, 2, 2, 2)
PAIR_SLOT_COLUMNS = (0, 0, 1, 1, 0, 0, 1, 1)
assert all(PLANE_COLUMNS[n] == (2 if n >= 4 else n & 1) and PAIR_SLOT_COLUMNS[n] == (n >> 1) & 1 for n in range(8))
# The four-row body (passes of 3 or 4 rows, slots 0-3): two B fragments per block, X with column n = (slot n >> 1,
# plane n & 1) and Y with column n = (slot n >> 1, plane 2), so lane t4 holds S0, S1 (X) and S2 (Y's even columns) of
# slot t4 for rows g and g + 8, all in its own registers.
QUAD_SLOT_COLUMNS = (0, 0, 1, 1, 2, 2, 3, 3)
QUAD_X_PLANES = (0, 1, 0, 1, 0, 1, 0, 1)
assert all(QUAD_SLOT_COLUMNS[n] == n >> 1 and QUAD_X_PLANES[n] == n & 1 for n in range(8))
# `GCMOE_ABLATION=blocklanes` (`RoleKernelsV2.block_lanes`): a one-row pass's B rows in zero-padded columns, X at
# `BL_X` and Y at `BL_Y` of the stage's B area, each [block s][column n][32 B], where block s's MMAs find plane 1 in X's
# column 2 s and planes 0 and 2 in Y's columns 2 s and 2 s + 1, and zeros in every other column (X's odd columns are
# never read): chained over the stage's blocks, the accumulators leave lane t4 block t4's words for rows g and g + 8.
BL_BLOCK = 8 * 32
BL_X = 0
BL_Y = 4 * BL_BLOCK
BL_BYTES = 2 * BL_Y
BL_CHUNKS = BL_BYTES // 16
assert BL_BYTES <= 8 * TOKEN_STRIDE  # (within the 1-tile pass's B area)


def block_lane_dst(qq):
  """Where copy chunk ``qq`` (0-23: block qq // 6, plane (qq % 6) // 2, half qq % 2 of slot 0's four blocks of digit
  planes, 16 B each) goes in the `BL_X` / `BL_Y` layout; plain integer arithmetic, so the kernel takes it of an Int32
  and the tests of an int."""
  s = qq // 6
  p = (qq - 6 * s) // 2
  not_x = p * p - 2 * p + 1  # 1 for planes 0 and 2 (Y), 0 for plane 1 (X)
  return not_x * BL_Y + s * (BL_BLOCK + 64) + p * (p - 1) * 16 + (qq % 2) * 16


def block_lane_kept(c):
  """Whether 16 B chunk ``c`` (0 .. `BL_CHUNKS` - 1) of the layout is a copy's (`block_lane_dst`), not a zero one."""
  r, s, n = c >> 6, (c >> 4) & 3, (c >> 1) & 7
  return ((r == 0) & (n == 2 * s)) | ((r == 1) & ((n >> 1) == s))
# The shared expert (`RoleKernelsV2._shared_core`): items of `SH_ROWS` weight rows x a token group, K streamed in
# steps of `SH_STEP` K32 blocks (two K128 tiles; warp w: the m16 tile w & 3 of the rows and the K128 tile w >> 2 of the
# step; a half of 32 rows takes four tiles per step), double-buffered by cp.async. The FP8 x FP8 block dots
# are exact int8 MMAs over signed 6-bit digits (`SH_PLANES`; `_sh_compute`). A group is one n-tile of the MMA
# (`SH_TOKENS`) or, where the SMEM holds it, two (`SH_TOKENS_WIDE`: the one-CTA sm_90a variants), so that a warp
# decodes each weight block once for twice the tokens.
SH_TOKENS = 8
SH_TOKENS_WIDE = 16
SH_ROWS = 64
SH_STEP = 8
SH_PLANES = abi.SHARED_PLANES  # hi = 64 H1 + H0 and lo = 64 L1 + L0, each digit carrying the value's sign
SH_BLOCK = SH_PLANES * 32  # bytes of one (token, K32 block) of digit planes
SH_TAB = 0  # [256] u32: E4M3 byte -> its four digits (H1, H0, L1, L0); 1024-aligned, so `_e4m3_digits` ORs it in
# The decode table with a copy per lane (`SharedSmem` ``lane_tab``, `GCMOE_ABLATION=lanetab`: exact, and 0-6 %
# slower on the H100 in session 57, so not the default): word (code, lane) at 4 (32 code + lane), so each lane reads
# its own bank. A warp's 32 lookups of one table take ~2.5 SMEM wavefronts on average where the lanes' codes differ
# (MXFP8 weights of a normal matrix: 254 codes, conflicts between codes with equal low 5 bits), one here.
SH_LANE_TAB = 256 * 32 * 4
SH_W = 1024  # [2][2 tiles][64 rows][128 B], 16 B chunk c of row r at c ^ ((r & 3) << 1): conflict-free lds.64
SH_S = SH_W + 2 * 2 * SH_ROWS * v1.K128  # [2][2][64] scale words
SH_X_STRIDE = SH_STEP * SH_BLOCK + 32  # bytes per token and step: 8 words mod 32 banks, so B loads miss no bank twice
SH_X = SH_S + 2 * 2 * SH_ROWS * 4  # [2][group][SH_X_STRIDE]: the step's digit planes
SH_P_ROWS = SH_ROWS + 4  # f32 per (block, token) row of the block contributions: the C fragments' stores hit 32 banks


class SharedSmem:
  """The shared-expert items' SMEM past `SH_X` for token groups of ``tokens`` (offsets from the pipeline area), and
  where the decode table lies: `SH_TAB`, or with ``lane_tab`` a copy per lane after the accumulators (`SH_LANE_TAB`
  bytes: 102 KB at 8 tokens, 6 KB past the two-CTA pipeline area, and 138 of 144 KB at 16)."""

  def __init__(self, tokens: int, lane_tab: bool = False):
    self.tokens = tokens
    self.lane_tab = lane_tab
    self.xe = SH_X + 2 * tokens * SH_X_STRIDE  # [2][tokens][SH_STEP] block exponents
    self.p = self.xe + 2 * tokens * SH_STEP * 4  # [SH_STEP][tokens][SH_P_ROWS] f32: the step's block contributions
    self.acc = self.p + SH_STEP * tokens * SH_P_ROWS * 4  # [tokens][SH_ROWS] f32 accumulators
    end = self.acc + tokens * SH_ROWS * 4
    self.tab = end if lane_tab else SH_TAB
    self.bytes = end + SH_LANE_TAB if lane_tab else end


SH_BYTES = SharedSmem(SH_TOKENS).bytes
SH_BYTES_WIDE = SharedSmem(SH_TOKENS_WIDE).bytes
# The shared block dots' magic conversions (`_sh_compute`): every digit chain's sum is below 2**22 in magnitude, so
# an MMA chain started at MAGIC ends at the float32 bits of 1.5 2**23 + S; the hi x lo chains start at 3 MAGIC less
# the hi x hi and lo x lo chains' ends and sum F x F, F = hi + lo, so they end at MAGIC + (Shl + Slh).
MAGIC3 = v1._i32((3 * MAGIC) & 0xFFFFFFFF)
F32_64 = v1._f32_bits(64.0)
# Block exponents e = ex + ew in this range take one multiplication by 2**e (`_sh_compute`): |p| is 0 or in
# [2**-18, 2**23), so p 2**(e // 2) and p 2**e are normal and both of the semantics' multiplications exact.
SH_FAST_EXP = 100
# E4M3 byte -> 512 v without a table (`_e4m3_hl`): its 7 exponent/mantissa bits at float32 bits 20-26 and the sign at
# 31 are the float32 v 2**-120 (E4M3 subnormals become float32 subnormals), and fma(f, 2**127, 1.5 2**21) adds
# 128 v exactly to a magic number whose ulp is 2**-2, so the bits minus the magic are 512 v.
MAGIC_FP8 = v1._f32_bits(1.5 * 2.0**21)
F32_2P127 = v1._f32_bits(2.0**127)
E4M3_EM_ONE = 7 << 23  # 1.0 in that field (E4M3 exponent 7 at float32 bits 23-26): |v| >= 1 from there up
# The 4 x 4 byte transpose of `_e4m3_digits`: interleave bytes 0, 1 (or 2, 3) of two words, then take the low (or high)
# halves of two words.
PRMT_BYTES01 = 0x5140
PRMT_BYTES23 = 0x7362
PRMT_HALVES_LO = 0x5410
PRMT_HALVES_HI = 0x7632
PRMT_BYTE0 = 0x4440  # + i: byte i of the first word, zero-extended (the second word is 0)
EXPAND_SELECT = 0x5140  # prmt selector of the sm_120a seam: bytes (w0, (w >> 4)0, w1, (w >> 4)1) of a 16-bit word


def pass_tier(v: Variant, qmma: bool = False, ablation: str = "") -> tuple[int, int]:
  """(n-tiles of the widest pass, CTAs per SM) of role 2 for variant ``v``: on sm_90a `abi.pass_tier` (by the rows
  an expert receives at the variant's capacity); on sm_120a, and in the fused transport's variants (R > 1, whose
  role 2 has the most code: their 32-row passes are not measured), two CTAs and passes of 16 rows up to capacity
  `abi.SMALL_CAPACITY` (on sm_120a without a shared expert, whose 70 KB exceed a CTA's SMEM there at two per SM),
  else one and 64 rows."""
  if qmma and v.shared:
    return NT_MAX, 1
  if ablation == "threecta" and not qmma and not v.shared and v.ranks == 1:
    return 1, 3  # (`RoleKernelsV2.three_cta`: passes of one or two rows, `PIPE_AREA`[2])
  return abi.pass_tier(v.capacity, v.top_k, v.experts, ablation, by_rows=not qmma and v.ranks == 1)


def stage_bytes(nt: int, token_stride: int = TOKEN_STRIDE, w_bytes: int = W_BYTES) -> int:
  raw = w_bytes + SC_BYTES + nt * 8 * (16 + token_stride)
  return -(-raw // STAGE_ALIGN) * STAGE_ALIGN


def any_stage_bytes(rows: int) -> int:
  """A `kbany` pass's stage of ``rows`` (1 or 2) rows: the weight tile, its scale words, the exponent words of the
  8 slots and the digit planes of slots 0 .. rows - 1 (`_stage`'s one- and two-row bodies read no other slot),
  128-aligned so that the tile's ldmatrix rows stay conflict-free."""
  return -(-(W_BYTES + SC_BYTES + 8 * 16 + rows * TOKEN_STRIDE) // 128) * 128


def stages(nt: int, pipe_bytes: int, token_stride: int = TOKEN_STRIDE, w_bytes: int = W_BYTES) -> int:
  """Pipeline depth for ``nt`` n-tiles: as many K128 stages as fit ``pipe_bytes``, at most `MAX_STAGES`."""
  return min(MAX_STAGES, pipe_bytes // stage_bytes(nt, token_stride, w_bytes))


def kpair_tile(kb, half, per_bar: int):
  """The K128 tile that ``half`` of stage ``kb`` of a `RoleKernelsV2.kpair` pass holds (0: the rows of warps 0-3,
  which accumulate; 1: those of warps 4-7, which hand each block's p to them), the stages meeting at a CTA barrier
  every ``per_bar``: between two barriers warps 0-3 run tiles 2 per_bar q .. 2 per_bar q + per_bar - 1, warps 4-7 the
  per_bar tiles after them, whose p warps 0-3 add after the next barrier, so every row takes its blocks in
  increasing K (`tests/test_kernels_v2_math.py::test_kpair_tiles_reach_the_accumulators_in_k_order`)."""
  return 2 * per_bar * (kb // per_bar) + kb % per_bar + per_bar * half


def _stage_tile(kb, half, per_bar: int):
  """The K128 tile of ``half`` of stage ``kb``: ``kb`` itself, or in a `kpair` pass (``per_bar`` > 0) `kpair_tile`."""
  return kpair_tile(kb, half, per_bar) if per_bar else kb


# ---- PTX helpers (SMEM addresses are 32-bit shared-window addresses) ----------------------------------------------


def _lds(addr) -> Int32:
  return v1._ptx1("ld.shared.u32 {$w0}, [{$r0}];", addr)


def _lds2(addr):
  return cute.arch.inline_ptx("ld.shared.v2.u32 {{$w0}, {$w1}}, [{$r0}];", write_only_types=[Int32] * 2,
                              read_only_args=[addr])


def _lds4(addr):
  return cute.arch.inline_ptx("ld.shared.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];", write_only_types=[Int32] * 4,
                              read_only_args=[addr])


def _sts4(addr, w0, w1, w2, w3) -> None:
  cute.arch.inline_ptx("st.shared.v4.u32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                       read_only_args=[addr, Int32(w0), Int32(w1), Int32(w2), Int32(w3)])


def _kpair_p(pset, w, per_bar, r, lane):
  """Where lane ``lane`` of warp ``w`` + 4 of a `kpair` pass keeps its four blocks' p of stage ``r`` of a barrier
  step in the set at ``pset`` (`_compute` stores there, `_kpair_add` loads, one 16 B access each)."""
  return pset + (w * per_bar + r) * KPAIR_P_BYTES + lane * 16


def _lds64(addr) -> Int64:
  return cute.arch.inline_ptx("ld.shared.u64 {$w0}, [{$r0}];", write_only_types=[Int64], read_only_args=[addr])


def _sts64(addr, v) -> None:
  cute.arch.inline_ptx("st.shared.u64 [{$r0}], {$r1};", read_only_args=[addr, Int64(v)])


def _sts(addr, v) -> None:
  cute.arch.inline_ptx("st.shared.u32 [{$r0}], {$r1};", read_only_args=[addr, Int32(v)])


def _sts_if(pred, addr, v) -> None:
  """st.shared.b32 where ``pred`` is non-zero (predicated, no branch)."""
  cute.arch.inline_ptx("{ .reg .pred _p; setp.ne.s32 _p, {$r0}, 0; @_p st.shared.b32 [{$r1}], {$r2}; }",
                       read_only_args=[Int32(pred), addr, v])


def _lds_u8(addr) -> Int32:
  return v1._ptx1("ld.shared.u8 {$w0}, [{$r0}];", addr)


def _lds_u16(addr) -> Int32:
  return v1._ptx1("ld.shared.u16 {$w0}, [{$r0}];", addr)


def _sts_u16(addr, v) -> None:
  cute.arch.inline_ptx("st.shared.u16 [{$r0}], {$r1};", read_only_args=[addr, Int32(v)])


def _st_u8(addr, v) -> None:
  cute.arch.inline_ptx("st.global.u8 [{$r0}], {$r1};", read_only_args=[addr, Int32(v)])


def _cp16(dst, src, nbytes) -> None:
  """16 B global -> SMEM, bypassing L1 (data other CTAs wrote this call); ``nbytes`` 0 zero-fills."""
  cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};", read_only_args=[dst, src, nbytes])


def _cp16_first(dst, src, nbytes) -> None:
  """`_cp16` with the L2 lines marked evict-first (`GCMOE_ABLATION=l2ahead`: weights streamed once, so that they
  leave L2 before the GEMM2 weights prefetched there)."""
  cute.arch.inline_ptx("{ .reg .b64 pol; createpolicy.fractional.L2::evict_first.b64 pol, 1.0; "
                       "cp.async.cg.shared.global.L2::cache_hint [{$r0}], [{$r1}], 16, {$r2}, pol; }",
                       read_only_args=[dst, src, nbytes])


def _prefetch_l2(src, nbytes: int) -> None:
  """A bulk prefetch of ``nbytes`` (a multiple of 16, 16-aligned) of global memory into L2, no completion."""
  cute.arch.inline_ptx(f"cp.async.bulk.prefetch.L2.global [{{$r0}}], {nbytes};", read_only_args=[src])


def _cp4(dst, src) -> None:
  cute.arch.inline_ptx("cp.async.ca.shared.global [{$r0}], [{$r1}], 4;", read_only_args=[dst, src])


def _commit() -> None:
  cute.arch.inline_ptx("cp.async.commit_group;", read_only_args=[])


def _wait_group(n: int) -> None:
  cute.arch.inline_ptx(f"cp.async.wait_group {n};", read_only_args=[])


# ---- the TMA pipeline: mbarriers (SMEM, 8 B), the weight tile by TMA, the B rows by bulk copies --------------------


def _mbar_init(addr, count: int) -> None:
  cute.arch.inline_ptx("mbarrier.init.shared::cta.b64 [{$r0}], {$r1};", read_only_args=[addr, Int32(count)])


def _mbar_inval(addr) -> None:
  cute.arch.inline_ptx("mbarrier.inval.shared::cta.b64 [{$r0}];", read_only_args=[addr])


def _mbar_arrive(addr) -> None:
  cute.arch.inline_ptx("mbarrier.arrive.shared::cta.b64 _, [{$r0}];", read_only_args=[addr])


def _mbar_arrive_tx(addr, nbytes) -> None:
  """Arrives and adds ``nbytes`` to the phase's expected transaction count (the copies' complete_tx remove them)."""
  cute.arch.inline_ptx("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{$r0}], {$r1};",
                       read_only_args=[addr, Int32(nbytes)])


def _mbar_try(addr, parity) -> Int32:
  """1 once the phase of parity ``parity`` has completed (try_wait: the thread may sleep a bounded while)."""
  return v1._ptx1("{ .reg .pred _p; mbarrier.try_wait.parity.shared::cta.b64 _p, [{$r0}], {$r1}; "
                  "selp.s32 {$w0}, 1, 0, _p; }", addr, Int32(parity))


def _cp_arrive(addr) -> None:
  """An arrival on the mbarrier once this thread's earlier cp.async copies have landed (counted in its init)."""
  cute.arch.inline_ptx("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [{$r0}];", read_only_args=[addr])


def _tma_tile(dst, tmap, c0, c1, bar) -> None:
  """The TMA copy of the box at (c0, c1) of the 2D TensorMap at generic address ``tmap`` (a by-value kernel
  parameter, `ptx.rewrite_tensormaps_by_value`) into SMEM ``dst``, completing bytes on ``bar``."""
  cute.arch.inline_ptx("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], "
                       "[{$r1}, {{$r2}, {$r3}}], [{$r4}];", read_only_args=[dst, tmap, Int32(c0), Int32(c1), bar])


def _slot_tma(tw, bars, kb, n_st: int):
  """`_issue`'s ``tma`` for block ``kb`` of a `tma_w` pass (``tw``: `RoleKernelsV2._chunk`'s; None: the pass copies its
  weights per thread): ``tw`` and the ``full`` mbarrier of the block's slot."""
  return None if tw is None else (tw, bars + 8 * (kb % n_st))


def _bulk(dst, src, nbytes: int, bar) -> None:
  """A bulk copy of ``nbytes`` (a multiple of 16, both addresses 16-aligned) global -> SMEM, through L2 (rows other
  CTAs wrote this call), completing bytes on ``bar``."""
  cute.arch.inline_ptx("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], "
                       "{$r2}, [{$r3}];", read_only_args=[dst, src, Int32(nbytes), bar])


def _fence_async_smem() -> None:
  """Orders this thread's generic SMEM accesses before later async-proxy (TMA, bulk copy) writes of the same bytes."""
  cute.arch.inline_ptx("fence.proxy.async.shared::cta;", read_only_args=[])


def _fence_mbar_init() -> None:
  cute.arch.inline_ptx("fence.mbarrier_init.release.cluster;", read_only_args=[])


def _ldsm_x4(addr):
  return cute.arch.inline_ptx("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                              write_only_types=[Int32] * 4, read_only_args=[addr])


def _ldsm_b4_x4(addr):
  """Four 8 x 16 matrices of E2M1 codes staged 16 per 16-byte slot (TMA 16U4_ALIGN16B), each code unpacked into
  the low 4 bits of a byte (``ldmatrix ... b8x16.b4x16_p64``, sm_120a/sm_121a): lane 4 g + t4 gets codes 4 t4 ..
  4 t4 + 3 of row g of each matrix."""
  return cute.arch.inline_ptx(
    "ldmatrix.sync.aligned.m8n16.x4.shared.b8x16.b4x16_p64 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
    write_only_types=[Int32] * 4, read_only_args=[addr])


def _mma_s8(a, b, c):
  """D = A B + C (m16n8k32, int8 x int8 + int32 -> int32, exact: no sum here leaves int32)."""
  return cute.arch.inline_ptx(
    "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {{$w0}, {$w1}, {$w2}, {$w3}}, {{$r0}, {$r1}, {$r2}, {$r3}}, "
    "{{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
    write_only_types=[Int32] * 4, read_only_args=[a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3]])


def _qmma(a, b, c, sfa, sfb, byte: int):
  """The sm_120a seam: D = (A 2**(sfa - 127)) (B 2**(sfb - 127)) + C for K32 block ``byte`` of the packed scale
  words (m16n8k32, E2M1 weights in 8-bit containers x E4M3 activations, UE8M0 scales, f32 accumulate; paper §4.3:
  the byte-id immediate selects the block, so no scale byte is moved in the loop). Thread-id 0: lane 4 g + c of a
  quad supplies the scale of A row g + 8 c (c in 0, 1) and lane 4 n that of B column n."""
  return cute.arch.inline_ptx(
    "{ .reg .f32 _d<4>, _c<4>; "
    "mov.b32 _c0, {$r6}; mov.b32 _c1, {$r7}; mov.b32 _c2, {$r8}; mov.b32 _c3, {$r9}; "
    "mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col.f32.e2m1.e4m3.f32.ue8m0 "
    "{_d0, _d1, _d2, _d3}, {{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {_c0, _c1, _c2, _c3}, "
    f"{{$r10}}, {{{byte}, 0}}, {{$r11}}, {{{byte}, 0}}; "
    "mov.b32 {$w0}, _d0; mov.b32 {$w1}, _d1; mov.b32 {$w2}, _d2; mov.b32 {$w3}, _d3; }",
    write_only_types=[Int32] * 4,
    read_only_args=[a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3], sfa, sfb])


def _exp4(w) -> Int32:
  """The E2M1 codes in nibbles 0-3 of ``w`` in the 8-bit containers of the sm_120a MMA (code << 2, byte i = nibble
  i): the compact path's ``prmt`` expansion (paper §4.3)."""
  return (_prmt(w & 0xFFFF, (w & 0xFFFF) >> 4, Int32(EXPAND_SELECT)) & 0x0F0F0F0F) << 2


def _e4m3_code(n) -> Int32:
  """The E4M3 byte of ``n / 512`` for ``n`` = 512 x an E4M3 value (`roles_v1._e4m3_int`): exact, no rounding."""
  f = v1._fmul(v1._i2f(n), Int32(v1._f32_bits(2.0 ** -9)))
  return v1._ptx1("{ .reg .b16 _h; .reg .f32 _f, _z; mov.b32 _f, {$r0}; mov.f32 _z, 0f00000000; "
                  "cvt.rn.satfinite.e4m3x2.f32 _h, _z, _f; cvt.u32.u16 {$w0}, _h; }", f) & 0xFF


def _e4m3_hl(code) -> tuple[Int32, Int32]:
  """The E4M3 byte ``code`` (a finite weight v, in the low byte) as the shared expert's split (`roles_v1._split`):
  ``8 v`` if |v| >= 1 else 0, and ``512 v`` if |v| < 1 else 0 (`MAGIC_FP8`; each role-2 CTA fills the digit table
  `SH_TAB` with it)."""
  sgn = (code << 24) & v1._i32(0x80000000)
  em = (code << 20) & 0x07F00000
  n = v1._float_op("fma.rn.f32", sgn | em, Int32(F32_2P127), Int32(MAGIC_FP8)) - MAGIC_FP8
  h = cutlass.select_(em >= E4M3_EM_ONE, n >> v1.E4M3_HI_SHIFT, Int32(0))
  return h, n - (h << v1.E4M3_HI_SHIFT)


def _sign_digits(v, n: int) -> tuple[Int32, ...]:
  """``v`` (|v| < 64**n) as n signed 6-bit digits, low first: v = sum 64**i d_i, every digit carrying the sign of v
  (the digit planes of `abi.PLANES` and `abi.SHARED_PLANES`)."""
  neg = v < 0
  m = cutlass.select_(neg, -v, v)
  out = []
  for i in range(n):
    d = m >> (abi.DIGIT_BITS * i)
    if i < n - 1:
      d = d & ((1 << abi.DIGIT_BITS) - 1)
    out.append(cutlass.select_(neg, -d, d))
  return tuple(out)


def _sh_tiles_per_step(rows: int) -> int:
  """K128 tiles per step of a shared-expert item of ``rows`` weight rows: the step's weights fill `SH_W`'s buffer,
  and its 8 warps take an m16 tile and a K128 tile each (2 for 64 rows, 4 for the 32 of a half)."""
  return 2 * SH_ROWS // rows


def _sh_ntiles(tokens: int) -> int:
  """The n-tiles of 8 columns a shared-expert token group of ``tokens`` (a Python int) takes."""
  return -(-tokens // SH_TOKENS)


def _sh_slots(rows: int) -> int:
  """SMEM token slots (`SH_X_STRIDE`, `SH_STEP` exponent words) per token of a step of a shared-expert item of
  ``rows`` weight rows: 2 for a half, whose step holds twice the K32 blocks."""
  return _sh_tiles_per_step(rows) * 4 // SH_STEP


def _digit_entry(code) -> Int32:
  """The decode table's word for E4M3 byte ``code`` (`SH_TAB`): bytes H1, H0, L1, L0 of its hi and lo parts."""
  h, lw = _e4m3_hl(code)
  h0, h1 = _sign_digits(h, 2)
  l0, l1 = _sign_digits(lw, 2)
  return (h1 & 0xFF) | ((h0 & 0xFF) << 8) | ((l1 & 0xFF) << 16) | (l0 << 24)


def _e4m3_digits(word, tab, lane_tab: bool = False) -> tuple[Int32, Int32, Int32, Int32]:
  """The four E4M3 weight bytes of ``word`` as the digit-plane words (H1, H0, L1, L0): byte i of each is that digit
  of byte i. Four table loads (``tab`` is 1024-aligned, so the byte offset is ORed in; with ``lane_tab`` it is the
  lane's column of the per-lane table, `SH_LANE_TAB`, and byte b's word lies 128 b on), then a 4 x 4 byte transpose
  by eight prmt."""
  if lane_tab:
    # (a byte by one prmt, then one IMAD/LEA: the shift-and-mask form took three instructions a lookup)
    t = [_lds(tab + _prmt(word, Int32(0), Int32(PRMT_BYTE0 + i)) * 128) for i in range(4)]
  else:
    t = [_lds(tab | ((word << 2) & 0x3FC)), _lds(tab | ((word >> 6) & 0x3FC)), _lds(tab | ((word >> 14) & 0x3FC)),
         _lds(tab | ((word >> 22) & 0x3FC))]
  u0 = _prmt(t[0], t[1], Int32(PRMT_BYTES01))  # (t0.b0, t1.b0, t0.b1, t1.b1)
  u1 = _prmt(t[0], t[1], Int32(PRMT_BYTES23))  # (t0.b2, t1.b2, t0.b3, t1.b3)
  w0 = _prmt(t[2], t[3], Int32(PRMT_BYTES01))
  w1 = _prmt(t[2], t[3], Int32(PRMT_BYTES23))
  lo, hi = Int32(PRMT_HALVES_LO), Int32(PRMT_HALVES_HI)
  return _prmt(u0, w0, lo), _prmt(u0, w0, hi), _prmt(u1, w1, lo), _prmt(u1, w1, hi)


def _sh_chain_f32(s1, s2, s3) -> Int32:
  """f32 (RN) of S = 4096 S1 + 64 S2 + S3 from three digit chains that each end at the float32 bits of MAGIC + S_i
  (|S_i| < 2**22; `RoleKernelsV2._sh_compute`): 64 f32(S1) + f32(S2) is exact (below 2**24), so the last FMA rounds
  S once."""
  f1 = v1._fadd(s1, MAGIC_NEG)
  f2 = v1._fadd(s2, MAGIC_NEG)
  f3 = v1._fadd(s3, MAGIC_NEG)
  return _fma(_fma(f1, F32_64, f2), F32_64, f3)


def _sh_block_a(tile, j: int, g, tab, decode: bool = True, lane_tab: bool = False):
  """The A fragments of K32 block j of the warp's 16 weight rows (``tile``: row g's chunk pair at t4; rows g + 8
  follow 8 rows on): the digit planes H1, H0, L1, L0 of its E4M3 bytes and F1 = H1 | L1, F0 = H0 | L0. Without
  ``decode`` (`GCMOE_ABLATION=shnodecode`, timing only, results wrong) the planes are the four raw words, rotated so
  that no two fragments are equal (equal ones would let the compiler merge MMAs): the shared items' time without
  `_e4m3_digits`' table loads and prmt, to tell the decode's cost from the weights' stream."""
  wa = tile + 32 * (Int32(j) ^ (g % 4))  # chunk pair j of rows g, g + 8 (`_sh_issue`'s swizzle)
  lo_words = _lds2(wa)
  hi_words = _lds2(wa + 8 * v1.K128)
  words = (lo_words[0], hi_words[0], lo_words[1], hi_words[1])
  dg = [_e4m3_digits(w, tab, lane_tab) if decode else tuple(words[(i + p) % 4] for p in range(SH_PLANES))
        for i, w in enumerate(words)]
  ah1, ah0, al1, al0 = (tuple(dg[i][p] for i in range(4)) for p in range(SH_PLANES))
  return (ah1, ah0, al1, al0, tuple(ah1[i] | al1[i] for i in range(4)), tuple(ah0[i] | al0[i] for i in range(4)))


def _two_digit_sum(x, y, r: int) -> Int32:
  """Row g + 8 r of a lane's two C columns 2 t4, 2 t4 + 1 of X = A1 B and Y = A0 B (`_sh_two_rows`): the block's
  digit-product sum 4096 X[2 t4] + 64 (X[2 t4 + 1] + Y[2 t4]) + Y[2 t4 + 1], exact in int32."""
  return (x[2 * r] << 12) + ((x[2 * r + 1] + y[2 * r]) << 6) + y[2 * r + 1]


def _sh_p(fhh, fhx, fll) -> Int32:
  """The semantics' block p from f32 of its split dots Shh, Shl + Slh, Sll (`roles_v1._fp8_block_p`)."""
  return _fma(fll, v1.FP8_PART_BITS[2], _fma(fhh, v1.FP8_PART_BITS[0], v1._fmul(fhx, v1.FP8_PART_BITS[1])))


@cute.jit
def _sh_store(p, es, ex, dst, store) -> None:
  """p[c] 2**es[c] to SMEM ``dst[c]`` (where ``store`` is non-zero, if given): one multiplication if every block
  exponent of the warp is within `SH_FAST_EXP`, else the semantics' two (and NaN where the token's exponent word
  ``ex[c]`` says so)."""
  slow = Int32(0)
  for c in cutlass.range_constexpr(len(es)):
    slow = slow | cutlass.select_((es[c] < -SH_FAST_EXP) | (es[c] > SH_FAST_EXP), Int32(1), Int32(0))
  if _warp_any(slow) == 0:
    for c in cutlass.range_constexpr(len(p)):
      _sh_sts(store, dst[c], v1._fmul(p[c], (es[c] + v1.F32_BIAS) << v1.F32_MANT_BITS))
  else:
    for c in cutlass.range_constexpr(len(p)):
      r = v1._scale_pow2(p[c], es[c])
      _sh_sts(store, dst[c], cutlass.select_(ex[c] == abi.SHARED_NAN_EXP, Int32(v1.F32_QNAN), r))


def _sh_sts(store, addr, v) -> None:
  if store is None:
    _sts(addr, v)
  else:
    _sts_if(store, addr, v)


def _bar_or(pred) -> Int32:
  """__syncthreads_or: 1 in every thread if ``pred`` is non-zero in any thread of the CTA."""
  return v1._ptx1("{ .reg .pred _gp, _gq; setp.ne.s32 _gp, {$r0}, 0; bar.red.or.pred _gq, 0, _gp; "
                  "selp.s32 {$w0}, 1, 0, _gq; }", Int32(pred))


def _ld_gpu(addr) -> Int32:
  """A relaxed gpu-scope load: data other CTAs of this kernel wrote (never a stale L1 line)."""
  return cute.arch.load(v1._gptr(addr), Int32, sem="relaxed", scope="gpu")


def _prmt(a, b, c) -> Int32:
  return v1._ptx1("prmt.b32 {$w0}, {$r0}, {$r1}, {$r2};", Int32(a), Int32(b), c)


def _dec4(w, tabs=DECODE_TABLES) -> Int32:
  """The E2M1 codes in nibbles 0-3 of ``w`` as four int8 ``2 w`` (byte i = nibble i; ``tabs``: `CTL_TABLES`)."""
  sel = w & 0x7777
  pos = _prmt(tabs[2], POS_HI, sel)
  neg = _prmt(tabs[1], NEG_HI, sel)
  m = _prmt(tabs[3], 0, (w >> 3) & 0x1111)
  return (pos & ~m) | (neg & m)


def _scale_byte(word, s: int) -> Int32:
  """Byte ``s`` of ``word``, zero-extended: one prmt, which ptxas fuses with no shift-and-mask pair."""
  return _prmt(word, 0, 0x4440 + s)


def _split_fragments(words, s: int, tabs):
  """The split decode of K32 block ``s`` of a stage's weight words: the A fragments of P and N (`_stage`)."""
  w4 = (words[2 * s], words[2 * s + 1], words[2 * s] >> 16, words[2 * s + 1] >> 16)
  return (tuple(_prmt(tabs[0], POS2_HI, w) for w in w4), tuple(_prmt(tabs[1], NEG_HI, w & 0x7777) for w in w4))


# ---- the BF16 wide pass (`abi.bf16_passes`, docs/kernels_v2.md "Session 59") ------------------------------------
# A K32 block's weights decoded to BF16 with the block scale folded in (`bf16fold.decode_pair`), the activations'
# BF16 plane (`abi.Workspace.xbf`) in the fragment's K order, two BF16 wgmma m64nNk16 per block from zero, the
# block's sum added to the FP32 accumulator in K order. The B area of a stage holds, per K32 block, wgmma's
# no-swizzle core matrices (8 tokens x 8 K, 16 B a token) as [k8 group][n8 group]: 64 B per (token, block).
BF16_B_BLOCK_BYTES = 4 * 128  # a block's four k8 groups of one n8 group
BF16_PLANE_BYTES = 64  # a (row, K32 block) of a BF16 plane
BF16_NAN = 0x7FC0
# The scale bytes the fold takes without a finite-range question: top bits 01, i.e. 2**-63 <= 2**ew <= 2**0 (where
# `SCALE_BYTE_BITS`' fast path holds and ``2**(126 + ew)`` is a normal BF16). A pass that meets another byte runs
# its int8 body again.
BF16_BYTE_MASK = v1._i32(0xC0C0C0C0)
BF16_BYTE_OK = 0x40404040


def bf16_b_chunk(slot, q, nt):
  """Byte offset in a `bf16` stage's B area of 16-B chunk ``q`` (block q // 4, k8 group q % 4: positions 8 (q % 4)
  .. + 7 of the block's BF16 plane) of ``slot``: wgmma's no-swizzle core matrix (k8 group, slot // 8), row slot %
  8, in a pass of ``nt`` n-tiles (ints or DSL values)."""
  return (q // 4) * (nt * BF16_B_BLOCK_BYTES) + ((q % 4) * nt + slot // 8) * 128 + (slot % 8) * 16


def _bf16_decode(word, r: int, mult) -> Int32:
  """`bf16fold.decode_pair`: the folded BF16 weights of nibbles (r, r + 4) of ``word``, five instructions."""
  sh = 6 - 4 * r
  shift = f"shl.b32 _x, {{$r0}}, {sh};" if sh > 0 else f"shr.u32 _x, {{$r0}}, {-sh};"
  return v1._ptx1("{ .reg .b32 _x, _t, _m; " + shift + f" and.b32 _t, _x, {bf16fold.E2M1_SIGN_MASK:#010x}; "
                  f"and.b32 _m, _x, {bf16fold.E2M1_MAG_MASK:#010x}; mad.lo.u32 _m, _t, 64, _m; "
                  "mul.rn.bf16x2 {$w0}, _m, {$r1}; }", word, mult)


def _fold_mult(word, s: int) -> Int32:
  """`bf16fold.fold_scale_of_byte` of byte ``s`` of a scale word: ``2**(126 + ew)`` in both BF16 halves."""
  return bf16fold.fold_scale_bits(_scale_byte(word, s))


def _store_bf16_plane(n, e, bad, lane, bf_addr) -> None:
  """A lane's element of a K32 block's BF16 plane (`abi.Workspace.xbf`): ``q 2**e`` (exact: ``512 q`` times
  ``2**(e - 9)``; NaN for a NaN block, whose row takes the digit bodies) at `bf16fold.plane_position` of its K."""
  folded = v1._fmul(v1._i2f(n), v1._exp2_bits(e - 9)) >> v1.BF16_SHIFT
  v1._st_bf16(bf_addr + bf16fold.plane_position(lane) * v1.BF16_BYTES,
              cutlass.select_(bad != 0, Int32(BF16_NAN), folded))


def _e4m3_bf16(w0, w1, r: int, mult) -> Int32:
  """`bf16fold.decode_e4m3_pair`: the BF16 weights of bytes r of ``w0`` and ``w1`` (K 8 t4 + r and + r + 4 of a
  lane's `bf16fold.shared_lane_words`), times ``mult`` (`bf16fold.fold_scale_e4m3`), six instructions."""
  sel = r | (r << 4) | ((4 + r) << 8) | ((4 + r) << 12)
  # (the multiplier moved into a register: a constant would reach mul.bf16x2 as an integer immediate)
  return v1._ptx1("{ .reg .b32 _x, _s, _m, _c; "
                  f"prmt.b32 _x, {{$r0}}, {{$r1}}, {sel:#06x}; and.b32 _s, _x, 0x00800080; "
                  "and.b32 _m, _x, 0x007F007F; mad.lo.u32 _m, _s, 16, _m; shl.b32 _m, _m, 4; mov.b32 _c, {$r2}; "
                  "mul.rn.bf16x2 {$w0}, _m, _c; }", w0, w1, mult)


def _smem_desc(saddr, lbo: int, sbo: int) -> Int64:
  """wgmma's shared-memory matrix descriptor, no swizzle: start, leading (K) and stride (N) byte offsets / 16."""
  return Int64((saddr & 0x3FFFF) >> 4) | Int64((lbo >> 4) << 16) | Int64((sbo >> 4) << 32)


def _wgmma_bf16_block(nt: int, a, desc0, desc1):
  """One K32 block's sum into fresh registers: two BF16 wgmma m64n(8 nt)k16, the first from zero (scale-d false),
  A from registers (``a``: the block's eight `_bf16_decode` words, k16 step 0's four first), then their commit."""
  r = 4 * nt
  d = ", ".join(f"{{$w{i}}}" for i in range(r))
  cute.arch.inline_ptx("wgmma.fence.sync.aligned;", read_only_args=[])
  res = cute.arch.inline_ptx(
    "{ .reg .pred _p; setp.ne.b32 _p, 0, 0; "
    f"wgmma.mma_async.sync.aligned.m64n{8 * nt}k16.f32.bf16.bf16 {{{d}}}, {{{{$r0}}, {{$r1}}, {{$r2}}, {{$r3}}}}, "
    "{$r8}, _p, 1, 1, 0; "
    f"wgmma.mma_async.sync.aligned.m64n{8 * nt}k16.f32.bf16.bf16 {{{d}}}, {{{{$r4}}, {{$r5}}, {{$r6}}, {{$r7}}}}, "
    "{$r9}, 1, 1, 1, 0; }",
    write_only_types=[Int32] * r, read_only_args=list(a) + [desc0, desc1])
  cute.arch.inline_ptx("wgmma.commit_group.sync.aligned;", read_only_args=[])
  return res


def _wgmma_wait_add(nt: int, pending: int, acc, d) -> None:
  """Waits until at most ``pending`` wgmma groups are in flight, then ``acc[i] += d[i]`` (FP32, round to nearest):
  one statement, so that nothing reads the sums before the wait (inline PTX has no read-write operands)."""
  r = 4 * nt
  adds = " ".join(f"add.rn.f32 {{$w{i}}}, {{$r{i}}}, {{$r{r + i}}};" for i in range(r))
  res = cute.arch.inline_ptx(f"{{ wgmma.wait_group.sync.aligned {pending}; {adds} }}", write_only_types=[Int32] * r,
                             read_only_args=[acc[i] for i in range(r)] + [d[i] for i in range(r)])
  for i in range(r):
    acc[i] = res[i]


def _wgmma_wait(nt: int, pending: int, d):
  """Waits until at most ``pending`` wgmma groups are in flight, then returns ``d``'s registers (moved in the same
  statement, so that nothing reads them before the wait)."""
  r = 4 * nt
  movs = " ".join(f"mov.b32 {{$w{i}}}, {{$r{i}}};" for i in range(r))
  return cute.arch.inline_ptx(f"{{ wgmma.wait_group.sync.aligned {pending}; {movs} }}",
                              write_only_types=[Int32] * r, read_only_args=[d[i] for i in range(r)])


def _scaled_add(fast: bool, df, xw, wb, acc):
  """``acc + df * 2**n`` of one block (``df`` = f32(D), ``xw`` the token's exponent word, ``wb`` the row's scale
  byte): the fast path's exact scaled FMA, or the slow path's two-step scaling with NaN blocks (`_stage`)."""
  if fast:
    return _fma(df, xw + (wb << v1.F32_MANT_BITS), acc)
  return v1._fadd(acc, _scaled_p(False, df, xw, wb))


def _scaled_p(fast: bool, df, xw, wb):
  """The block's p = ``df * 2**n`` that `_scaled_add` adds (a `RoleKernelsV2.kpair` pass hands it between warps). On
  the fast path the product is exact and normal, so ``fadd(acc, p)`` has the bits of `_scaled_add`'s FMA."""
  if fast:
    return v1._fmul(df, xw + (wb << v1.F32_MANT_BITS))
  p = v1._scale_pow2(df, (xw >> v1.F32_MANT_BITS) + wb - v1.F32_BIAS)
  return cutlass.select_(xw == abi.NAN_WORD, Int32(v1.F32_QNAN), p)


def _split_mma(a_pos, a_neg, b, c):
  """A B + C of a K32 block in the split decode (A = P + N, `_split_fragments`): two chained MMAs from ``c``."""
  return _mma_s8(a_neg, b, _mma_s8(a_pos, b, c))


def _digit_pair(s0, s1) -> Int32:
  """S0 + 2**6 S1 (one IMAD): with S0 the word MAGIC + S0, the word MAGIC + T that `_row_update` takes."""
  return s1 * (1 << abi.DIGIT_BITS) + s0


def _row_update(fast: bool, t, s2, xw, scale_word, s: int, acc, pv=None, at: int = 0, p_only: bool = False):
  """``acc`` after block ``s`` of one (row, token) from the words MAGIC + T (T = S0 + 2**6 S1) and MAGIC + S2 of
  its plane sums: f32(D) by the magic conversion, then `_scaled_add` (`_stage`; the row's weight scale is byte ``s``
  of ``scale_word``). With ``pv`` (a `kpair` pass) the block's p goes to ``pv[at]`` too and is added by ``fadd``
  (the same bits); ``p_only`` (a `kbany` pass, which adds the p in K order at the end): ``acc`` is returned as it
  is."""
  tf = v1._fadd(t, MAGIC_NEG)
  sf = v1._fadd(s2, MAGIC_NEG)
  df = _fma(sf, F32_4096, tf)
  if pv is None:
    return _scaled_add(fast, df, xw, _scale_byte(scale_word, s), acc)
  p = _scaled_p(fast, df, xw, _scale_byte(scale_word, s))
  pv[at] = p
  return acc if p_only else v1._fadd(acc, p)


def _shfl_xor(v, off: int) -> Int32:
  return v1._ptx1(f"shfl.sync.bfly.b32 {{$w0}}, {{$r0}}, {off}, 31, -1;", v)


def _shfl_idx(v, src) -> Int32:
  return v1._ptx1("shfl.sync.idx.b32 {$w0}, {$r0}, {$r1}, 31, -1;", v, src)


def _fma(a, b, c) -> Int32:
  return v1._float_op("fma.rn.ftz.f32", a, b, c)


def _lanes():
  """(warp, lane, g, t4) of this thread: its warp, and its row group g and column pair t4 in MMA fragments."""
  tid, _, _ = cute.arch.thread_idx()
  lane = tid % 32
  return tid // 32, lane, lane // 4, lane % 4


def _weight_words(sb, warp, lane):
  """The stage's weight fragments of this thread, raw: word t4 (nibbles 8 t4..8 t4 + 7) of rows g and g + 8 of each
  K32 block, 2 s and 2 s + 1 for block s (ldmatrix.x4 twice from the tile swizzled by ``(row >> 1) & 3``)."""
  q = lane // 8
  r = 16 * warp + (q % 2) * 8 + lane % 8
  sw = (r // 2) % 4
  m01 = _ldsm_x4(sb + r * 64 + (((q // 2) ^ sw) << 4))
  m23 = _ldsm_x4(sb + r * 64 + (((2 + q // 2) ^ sw) << 4))
  return (m01[0], m01[1], m01[2], m01[3], m23[0], m23[1], m23[2], m23[3])


def _atom_add(addr, v) -> Int32:
  """The old value of a relaxed gpu-scope atomic add (the item queue: an order of claims, no data published)."""
  return v1._ptx1("atom.relaxed.gpu.global.add.u32 {$w0}, [{$r0}], {$r1};", addr, Int32(v))


def _expanded_fragment(sb, warp, lane, s):
  """The A fragment of K32 block ``s`` from the expanded tile, in the MMA's K order (a0/a1: codes 4 t4.. of rows g
  and g + 8, a2/a3: codes 16 + 4 t4..), each code shifted into bits 5:2 of its byte, the e2m1 container of the
  mixed-input QMMA (paper §4.3: ``fragment_i8[i] << 2``; no carry crosses a byte, codes are below 16)."""
  q = lane // 8
  r = 16 * warp + (q % 2) * 8 + lane % 8
  c = 2 * s + q // 2  # matrices 0, 1: codes 0-15 of the block (rows 0-7, 8-15); 2, 3: codes 16-31
  m = _ldsm_b4_x4(sb + r * 128 + ((c ^ (r % 8)) << 4))
  return (m[0] << 2, m[1] << 2, m[2] << 2, m[3] << 2)


def _atom_exch_acq_rel(addr, v) -> Int32:
  """The old value of an acq_rel gpu-scope atomic exchange (the halves' meeting, `_shared_gemm1`)."""
  return v1._ptx1("atom.acq_rel.gpu.global.exch.b32 {$w0}, [{$r0}], {$r1};", addr, Int32(v))


def _atom_add_acq_rel(addr, v) -> Int32:
  """The old value of an acq_rel gpu-scope atomic add (role 1's arrivals: the add that completes a count acquires
  every earlier release of it)."""
  return v1._ptx1("atom.acq_rel.gpu.global.add.u32 {$w0}, [{$r0}], {$r1};", addr, Int32(v))


def _ld_u8(addr) -> Int32:
  return v1._ptx1("{ .reg .b16 _h; ld.global.u8 _h, [{$r0}]; cvt.u32.u16 {$w0}, _h; }", addr)


def _red_release_add(addr, v) -> None:
  cute.arch.inline_ptx("red.release.gpu.global.add.u32 [{$r0}], {$r1};", read_only_args=[addr, Int32(v)])


def _st_tag(addr, lo, hi) -> None:
  """One relaxed gpu-scope 64-bit store of (``lo``, ``hi``): a reader's 64-bit load sees both words or neither
  (`abi.Workspace.g1tags`; after a fence, so that with `_ld_tags`' acquire it publishes the stores before it)."""
  cute.arch.inline_ptx("{ .reg .b64 _t; mov.b64 _t, {{$r1}, {$r2}}; st.relaxed.gpu.global.b64 [{$r0}], _t; }",
                       read_only_args=[addr, Int32(lo), Int32(hi)])


def _ld_tags(addr):
  """Two consecutive `_st_tag` words, each one 64-bit access, by one acquire gpu-scope load (16-aligned): (low,
  high) of the first, then of the second. Acquire, so a tag seen done orders this thread's later accesses (and,
  through a CTA barrier, the CTA's copies) after the stores it follows; no fence is needed after it."""
  return cute.arch.inline_ptx("{ .reg .b64 _a, _b; ld.acquire.gpu.global.v2.b64 {_a, _b}, [{$r0}]; "
                              "mov.b64 {{$w0}, {$w1}}, _a; mov.b64 {{$w2}, {$w3}}, _b; }",
                              write_only_types=[Int32] * 4, read_only_args=[addr])


# ---- the fused transport's peer accesses (system scope: a peer may be another GPU) ---------------------------------


def _exp_word(xe, bad):
  """A block's exponent word (``xe`` = its UE8M0 exponent + `roles_v1.FP4_DOT_SHIFT` as the bits of 2**xe;
  `abi.NAN_WORD` for a NaN block) and whether it sends its row to the slow path (NaN, or ``xe`` outside
  `abi.FAST_EXP`): phase 0's rule, which the pull engine's receiving side repeats."""
  word = cutlass.select_(bad, Int32(abi.NAN_WORD), xe << v1.F32_MANT_BITS)
  return word, bad | (xe < abi.FAST_EXP[0]) | (xe > abi.FAST_EXP[1])


def _e4m3_n(code) -> Int32:
  """512 x the E4M3 value of byte ``code`` (an integer: the smallest subnormal is 2**-9), NaN codes aside (phase 0
  never writes one: a non-finite element quantizes to 0 and flags its block)."""
  ex = (code >> 3) & 15
  m = code & 7
  mag = cutlass.select_(ex == 0, m, (m | 8) << cutlass.max(ex - 1, 0))
  return cutlass.select_((code & 0x80) != 0, -mag, mag)


def _plane_entry(code) -> Int32:
  """The pull engine's decode table word for E4M3 byte ``code``: bytes 0-2 the digit planes 0-2 (`abi.PLANES`) of
  512 x its value, as phase 0 writes them (`_sign_digits`), byte 3 zero."""
  d = _sign_digits(_e4m3_n(code), PLANES)
  return (d[0] & 0xFF) | ((d[1] & 0xFF) << 8) | ((d[2] & 0xFF) << 16)


def _fence_async_global() -> None:
  """Orders this thread's earlier acquires (a peer's published row) before its later async-proxy reads (bulk copies)
  of global memory."""
  cute.arch.inline_ptx("fence.proxy.async.global;", read_only_args=[])


def _peer(wsb, p) -> Int64:
  """Rank ``p``'s workspace base address, from this workspace's peer table (written before the first replay)."""
  return v1._ld(wsb + abi.HEADER["peers"] + Int64(p) * 8, Int64)


def _ld_cg(addr) -> Int32:
  """A load through L2 only: data a peer wrote during this call (after an acquire of its flag)."""
  return v1._ptx1("ld.global.cg.u32 {$w0}, [{$r0}];", addr)


def _copy16(dst, src) -> None:
  """16 B global -> global, the source read through L2 only (a peer's row)."""
  cute.arch.inline_ptx("{ .reg .b32 _a, _b, _c, _d; ld.global.cg.v4.u32 {_a, _b, _c, _d}, [{$r1}]; "
                       "st.global.v4.u32 [{$r0}], {_a, _b, _c, _d}; }", read_only_args=[dst, src])


def _st_release_sys(addr, v) -> None:
  cute.arch.inline_ptx("st.release.sys.global.u32 [{$r0}], {$r1};", read_only_args=[addr, Int32(v)])


def _red_release_sys(addr, v) -> None:
  cute.arch.inline_ptx("red.release.sys.global.add.u32 [{$r0}], {$r1};", read_only_args=[addr, Int32(v)])


def _fence_sys() -> None:
  cute.arch.inline_ptx("fence.acq_rel.sys;", read_only_args=[])


def _warp_any(pred) -> Int32:
  return v1._ptx1("{ .reg .pred _p, _q; setp.ne.s32 _p, {$r0}, 0; vote.sync.any.pred _q, _p, -1; "
                  "selp.s32 {$w0}, 1, 0, _q; }", Int32(pred))


class RoleKernelsV2(v1.RoleKernelsV1):
  """v1's roles 1 and 3 and a tensor-core role 2 for one `Variant` and target architecture.

  Everything but the MMA seam is shared between the targets: ``sm_90a`` runs the exact int8 digit-plane MMAs,
  ``sm_120a`` (and ``sm_121a``) the block-scaled QMMA of paper §4.3 (`_qmma`) on E4M3 codes (plane 0 of each block)
  and packed UE8M0 scale words (`abi.Workspace.xsf`/``asf``).
  """

  GENERATION = "v2"

  def __init__(self, variant: Variant, arch: str = "sm_90a"):
    super().__init__(variant)
    v = variant
    self.qmma = arch.startswith("sm_12")
    self.ablation = _config.kernel_ablation()  # timing builds only (wrong results): see `_config`
    self.nblk_h = v.hidden // v1.K32
    self.nblk_i = v.intermediate // v1.K32
    self.j1 = 2 * v.intermediate // TILE_M
    self.j2 = v.hidden // TILE_M
    # The shared expert's items per token group of `SH_TOKENS` (`_shared_core`): its GEMM1 in blocks of 32
    # activation columns (64 W13 rows, one K32 block of its output), its GEMM2 in blocks of 64 output columns.
    self.n_cb = v.shared_intermediate // v1.K32 if v.shared else 0
    self.n_hb = v.hidden // SH_ROWS if v.shared else 0
    # SMEM: control words, the expert table (count[e], then the hit list), then the pipeline, in which the
    # shared-expert items (`SH_BYTES`) also run.
    self.table = CTRL_BYTES
    # One GPU at T <= `scan_tokens`: the CTA's own route lists after the table (`_scan_routes`): each expert's first
    # row in them, then the rows (assignments) expert by expert.
    self.scan_tokens = abi.scan_tokens(v.top_k, v.capacity, v.ranks)
    assert self.scan_tokens > 0 or v.ranks > 1  # (k <= 64): every one-GPU variant has the scan path
    self.scan_first = self.table + 8 * v.experts
    self.scan_rows = self.scan_first + 4 * v.experts
    scan_bytes = 4 * (v.experts + self.scan_tokens * v.top_k) if self.scan_tokens else 0
    # The dynamic SMEM is declared 1024-aligned (`STAGE_ALIGN`), and the pipeline starts at a multiple of it.
    self.pipe = -(-(CTRL_BYTES + 8 * v.experts + scan_bytes) // STAGE_ALIGN) * STAGE_ALIGN
    # Variants whose experts receive few rows at their capacity run passes of at most 16 or 32 rows with a
    # 128-register budget, so two CTAs share an SM and hide each other's latencies; the others run 64-row passes
    # (239-254 registers with the shared expert) at one CTA (`pass_tier`). An expert hit by more rows than a pass
    # holds streams its weights once per pass: under uniform routing few do at r = 8 in 16-row passes, about half at
    # r = 32 in 32-row ones (DSV4.1-Flash B = 256), which two CTAs still run faster than one (docs/kernels_v2.md).
    self.nt_max, self.ctas = pass_tier(v, self.qmma, self.ablation)
    # The FP4 operand path of the sm_120a seam (paper §4.3), chosen by the geometry at the variant's design point
    # (B = its token capacity): the compact tile (raw nibbles, 64 B per K128 row, expanded in registers by prmt)
    # exactly for the tile_n tiers where its freed SMEM decides co-residency (`geometry.compact_weights`), the
    # expanded tile (unpacked by TMA and ldmatrix, 128 B per row in SMEM, one shift per register) otherwise.
    # sm_90a always stages the compact tile (its int8 decode is the prmt tables; ldmatrix's unpack is sm_120a's).
    self.tile_n = geometry.select_tile_n(geometry.rows_per_expert(v.capacity, v.top_k, v.experts))[0]
    self.compact = not self.qmma or geometry.compact_weights(self.tile_n)
    self.w_bytes = W_BYTES if self.compact else W_BYTES_EXPANDED
    self.token_stride = (TOKEN_STRIDE if not self.qmma else QMMA_TOKEN_STRIDE if self.compact
                         else QMMA_EXPANDED_TOKEN_STRIDE)
    # The fused transport (R > 1): the receive side holds the R C tokens of every rank (`abi.Workspace`), and role
    # 1 keeps one tag byte per global assignment in SMEM (the local expert it goes to, or 0xFF).
    self.fused = v.ranks > 1
    self.relay = v.relay
    # The split decode of narrow passes (`_stage`); not with the fused transport, whose extra code leaves it too few
    # registers at the two-CTA cap (ptxas spilled 40 B); `GCMOE_ABLATION=widedecode` turns it off for A/B timing.
    self.split_decode = not self.fused and self.ablation != "widedecode"
    # The stage producer, chosen per target by measurement where there is one (docs/kernels_v2.md "The TMA
    # producer"): on the H200 the TMA producer (`_tma_mainloop`) was as fast at B = 1 and up to 1.8x slower at
    # B = 256 than every thread issuing cp.async (`_cpasync_mainloop`): one bulk copy per gathered B row leaves the
    # TMA unit with up to 128 small requests per stage. sm_90a takes cp.async (`GCMOE_ABLATION=tma`: the TMA producer,
    # results exact, for A/B timing); sm_120a/sm_121a, unmeasured, the paper's TMA producer (§4.4, §5.1).
    self.tma = self.qmma or self.ablation == "tma"
    # One-row passes in `_stage`'s plane-column body (sm_90a's int8 path with the split decode; not the TMA
    # producer, which copies every slot), and two-row passes in its two-row body (in the 1-tile pass's code: a pass
    # of its own spilled at the two-CTA cap): `GCMOE_ABLATION=nosingle` builds both as 1-tile passes, for A/B timing.
    self.single = (self.split_decode and not self.qmma and not self.tma
                   and self.ablation != "nosingle")
    # The decode's prmt tables from SMEM (`CTL_TABLES`) and the scale bytes by prmt (`_scale_byte`) in the int8
    # variants of the cp.async producer.
    self.smem_tables = not self.qmma and not self.tma
    self.cache = abi.pull_cache(v.top_k, v.ranks)  # rx rows per (rank, token), else per (rank, token, slot)
    self.words = abi.counter_words(v.experts, v.capacity, v.shared, v.ranks, v.relay)
    self.relay_base = abi.relay_counters(v.experts, v.capacity, v.shared)
    self.queue = abi.queue_counter(v.experts, v.capacity, v.shared, v.ranks, v.relay)
    # Items are claimed from a queue (an atomic add per item) in item order, so a CTA that finished early takes the
    # next item: static round-robin gave GLM5.2 B = 1 a critical path of 2 GEMM1 + 1 GEMM2 items against a mean of
    # 1.6 GEMM1 items' worth (docs/kernels_v2.md "The item queue"). `GCMOE_ABLATION=static` builds the round-robin.
    self.dynamic = self.ablation != "static"
    # Pass bodies of 3 and 6 n-tiles (`_item`); `GCMOE_ABLATION=evenbodies` builds only the 1, 2, 4 and 8 bodies,
    # for A/B timing.
    self.odd_bodies = self.ablation != "evenbodies"
    # A barrier every two stages in narrow passes (`_cpasync_mainloop`), in the one-rank routed variants, where it
    # was measured (2-8 % faster, bit-identical, session 13), with or without the shared expert (since its items
    # left v1's SIMT math, those variants fit every routed-path option without spilling); the fused transport's
    # keep one per stage. `GCMOE_ABLATION=stagebar`: one per stage everywhere, for A/B timing.
    self.paired_barrier = self.ablation != "stagebar" and not self.fused
    # Passes of 3 or 4 rows in `_stage`'s four-row body (in the 1-tile pass's code, chosen per pass at run time, as
    # the two-row body; 4-6.5 % faster at B = 8..32 on the H200, session 28), in the variants of 16-row passes (r <=
    # 8, `abi.PASS_TIERS`), where such passes are common. In the 32-row ones they are rare, and the body's code cost
    # them one or two spill reloads per stage loop and 0.3-0.8 % at B = 64-256. `GCMOE_ABLATION=nofourrow` runs them
    # in the 1-tile body everywhere, for A/B timing (results exact).
    self.four_row = self.single and self.nt_max <= 2 and self.ablation != "nofourrow"
    # The two stages between paired barriers under one fast-path test (`_compute`), in the routed variants (with
    # the shared expert's code ptxas spilled 88 B at the two-CTA cap); `GCMOE_ABLATION=stagetest`: a test per stage,
    # for A/B timing (results exact).
    self.pair_test = not self.qmma and not v.shared and self.ablation not in ("stagetest", "nomath")
    # A paired step's copies under one range test (session 48: routed, 0.0-1.7 % faster at B = 1-8 on the H100; with
    # the shared expert within +-0.7 %, so those builds stay as they were). `GCMOE_ABLATION=copystep`: the form before.
    self.copy_block = not v.shared and self.ablation != "copystep"
    # `GCMOE_ABLATION=tmaw` (timing; session 50: exact, 3.5-11 % slower at B = 1-8 on the H100, not kept): the
    # per-thread producer's weight tiles by TMA, one instruction per stage from thread 0 completing on a `full` mbarrier
    # per slot that every thread waits for beside its own copy groups; the scale words and B rows stay per thread, the
    # CTA barrier still frees the slots. Takes four LDGSTS per thread and step out of the MIO queue
    # (docs/kernels_v2.md).
    self.tma_w = not self.tma and not self.fused and self.ablation == "tmaw"
    # In those of capacity <= 8 (calls of B <= 8), a step's second stage takes its weight copies between the step's
    # two stages instead of before them, so the step's LDGSTS reach the MIO queue in two bursts (session 49: exact,
    # -1.1 % over B = 1-8 on the H100, docs/kernels_v2.md "The second stage's weights between the stages").
    # `GCMOE_ABLATION=copyburst`: all before them everywhere; `copymid`: between them in every routed variant
    # (session 50: exact, within the noise at B = 16-64 on the H100, so not the default there).
    self.copy_mid = self.copy_block and self.pair_test and (
        self.ablation == "copymid" or v.capacity <= 8 and self.ablation not in ("copyburst", "tmaw"))
    # `GCMOE_ABLATION=threecta` (timing): three CTAs per SM at 80 registers in the routed one-GPU variants, every pass
    # of one or two rows (an expert's rows two at a time: exact at any B, meant for B <= 2, where no expert has more),
    # so that only the one- and two-row bodies are in the kernel. Session 52 on the H100: exact, 18-42 % slower at B =
    # 1-2; an SM's pace does not grow with a third CTA (docs/kernels_v2.md "Three CTAs per SM for B <= 2").
    self.three_cta = self.ctas == 3
    # `GCMOE_ABLATION=blocklanes` (timing): the one-row body with a K32 block per lane of a quad (`_stage`, `BL_X`);
    # `blocklanes1`: the same with one MMA chain per operand instead of two. Session 51 on the H100: exact, and 3-12 %
    # slower at B = 1-8 although the fast one-row body is up to 8 % shorter (docs/kernels_v2.md), so not kept.
    self.block_lanes = self.single and not self.fused and self.ablation in ("blocklanes", "blocklanes1")
    self.bl_chains = 1 if self.ablation == "blocklanes1" else 2
    # GEMM2 items of 64 rows with K split between warp pairs at calls of up to `KPAIR_TOKENS` tokens (each expert up
    # to that many rows: the one- and two-row bodies): `GCMOE_ABLATION=kpair`, built to be checked and timed on a
    # GPU (docs/kernels_v2.md "Item balance"; its results should be exact). The routed variants of 16-row passes
    # whose GEMM2 K is an even number of K128 tiles (with the shared expert ptxas spilled 256 B at the two-CTA cap).
    self.kpair = (self.ablation == "kpair" and self.single and self.nt_max <= SPLIT_DECODE_NT and not self.fused
                  and not v.shared and (v.intermediate // v1.K128) % 2 == 0)
    # GEMM2 weights into L2 ahead of their items (`GCMOE_ABLATION=l2ahead`, timing, results exact): in the one-rank
    # routed variants of up to 8 tokens (one pass per item, so each weight byte is read once and may go first).
    self.l2ahead = (self.ablation == "l2ahead" and not self.fused and not v.shared and not self.qmma
                    and v.capacity <= 8)
    # A routed GEMM2 item of one pass of up to 8 rows copies its first stages' weights and scale words into the
    # pipeline before it waits for its expert's GEMM1 items (`_w_ahead`; `GCMOE_ABLATION=wearly`, and `wearlyl2`
    # also prefetches the item's other stages into L2): at B = 1 the GEMM2 items of the first round wait 11-17 us on
    # the H100. Exact, and not faster (docs/kernels_v2.md "The H100 timeline, and four ideas that did not pay").
    self.w_early = (self.ablation in ("wearly", "wearly1", "wearlyl2") and not self.fused and not self.qmma
                    and not self.tma and not self.kpair)
    self.w_early_l2 = self.w_early and self.ablation == "wearlyl2"
    # `wearly1`: also the CTA's first item, claimed before the wait for every CTA's phase 0, where role 2 lists the
    # routes itself (routed variants, whose queue starts with the GEMM1 items).
    self.w_early1 = self.w_early and self.ablation == "wearly1" and self.dynamic and not v.shared
    # `GCMOE_ABLATION=trips` (timing, results exact): fewer round trips one after another in the waits (`_poll_pair`)
    # and the route list (`_route_ids` before phase 0).
    self.trips = self.ablation == "trips"
    # `GCMOE_ABLATION=shfree` (timing, results exact): the shared expert's F x F chains of a token group of 8 or 16
    # (`_sh_tiles`) start at a constant instead of at the ends of Shh's and Sll's, so each n-tile's MMAs form chains
    # of at most two instead of four (the same instructions in number; the same int32 sums mod 2**32).
    self.sh_free = self.ablation == "shfree"
    # The routed one-GPU passes wider than the split decode (`SPLIT_DECODE_NT`) on BF16 wgmma (`_stage_bf16`), their
    # B from the BF16 planes (`abi.Workspace.xbf`, ``abf``): `abi.bf16_passes` (docs/kernels_v2.md "Session 59";
    # `GCMOE_ABLATION=int8wide`: the int8 bodies).
    self.bf16 = abi.bf16_passes(v.capacity, v.top_k, v.experts, v.ranks, self.ablation, arch)
    assert not self.bf16 or (self.nt_max > SPLIT_DECODE_NT and not self.qmma and not self.fused and not self.tma)
    # Block sums in flight per warpgroup: at one CTA per SM two (block s + 1's wgmma runs while block s's sum is
    # added; no spills at 255 registers, where one spilled 28 B); at two one (each block's wgmma waited for before
    # the next block's decode: at 128 registers two spilled 148-236 B, one 92-136 B, within the two-CTA budget).
    # Equal within 2 % on the H100 at B = 64-256 (session 60). `GCMOE_ABLATION=bf16one` / ``bf16two`` force one.
    self.bf16_sets = {"bf16one": 1, "bf16two": 2}.get(self.ablation, 2 if self.ctas == 1 else 1)
    # The shared expert's token groups of 8 or 16 on BF16 wgmma (`_sh_compute_bf16`), GEMM1's B from ``xbf``,
    # GEMM2's from ``sabf``: `abi.shared_bf16` (docs/kernels_v2.md "Session 61"; `GCMOE_ABLATION=shbf16`).
    self.sh_bf16 = abi.shared_bf16(v.shared, v.ranks, self.ablation, arch)
    assert not self.sh_bf16 or (not self.qmma and not self.fused)
    # `GCMOE_ABLATION=kbany` (timing, results exact): a routed GEMM2 item of one or two rows waits per K128 block for
    # the two GEMM1 items producing it, one of one row taking its stages in the order they become ready
    # (`_any_mainloop`), in the one-rank routed variants of up to 8 tokens (the one-row body; the cp.async producer;
    # with the shared expert ptxas spilled 120-156 B at the two-CTA cap, reloaded 6-8 times in the shared items'
    # loops).
    self.kbany = (self.ablation in ("kbany", "kbany1", "kbanyeager") and self.single and not self.fused
                  and not v.shared and v.capacity <= 8 and self.smem_tables and not self.kpair)
    # Stages in flight up to which a `kbany` pass polls (`kbanyeager`: at every step where it has none left to
    # issue, for less lag between a GEMM1 item's end and its stages' copies, at a round trip a step).
    self.any_poll_pending = MAX_STAGES if self.ablation == "kbanyeager" else ANY_POLL_PENDING
    # The rows of the items that do (`kbany1`: one-row items only, the two-row ones waiting for their expert as
    # normal: the pace model prices in-order per-block waits below the expert-wide wait once a poll lags).
    self.kbany_rows = 1 if self.ablation == "kbany1" else 2
    # Role 2's queue order (`abi.item_order`): the shared expert's items first at up to 32 tokens, else the routed.
    self.item_order = abi.item_order(v.capacity, self.ablation)
    self.rcap = v.capacity * v.ranks
    # Role 1 of the fused transport: the peers' T at 16 + 4 p, this CTA's row claims per local expert from 128;
    # with the pull engine each warp's two mbarriers, the 1 KB decode table (`_plane_entry`, 1024-aligned for
    # `_e4m3_digits`) and the warps' slots.
    self.claimed = 128
    self.role1_smem = (self.claimed + 4 * v.experts + 127) // 128 * 128 if self.fused else 0
    self.role1_ctas = ROLE1_FUSED_CTAS_PER_SM if self.fused else 1
    self.engine = False
    if self.fused:
      self.mbars = self.role1_smem
      self.digit_tab = -(-(self.mbars + 8 * PULL_SLOTS * WARPS) // 1024) * 1024
      self.slots = self.digit_tab + 1024
      self.slot_bytes = v.hidden + v.hidden // v1.K32
      engine_smem = self.slots + PULL_SLOTS * WARPS * self.slot_bytes
      # The engine where its slots fit the dispatch SMs at two CTAs per SM, else at one (the paper's condition on
      # S_role1), else the register-batched pulls (`_pull_row`); H a multiple of 512 keeps every bulk copy's size
      # and address 16-byte aligned. `GCMOE_ABLATION=regpull`: the register-batched pulls, for A/B timing (exact).
      dev = geometry.RTX_PRO_5000 if self.qmma else geometry.H100
      for ctas in (ROLE1_FUSED_CTAS_PER_SM, 1):
        fits = (engine_smem + STATIC_SMEM <= dev.smem_per_block
                and ctas * (engine_smem + STATIC_SMEM + dev.reserved_smem_per_block) <= dev.smem_per_sm)
        if fits and v.hidden % 512 == 0 and self.ablation != "regpull" and THREADS == 256:
          self.engine = True
          self.role1_ctas = ctas
          self.role1_smem = engine_smem
          break
      self.arrive = abi.arrivals(v.experts, v.capacity, v.shared, v.relay)
      if self.rcap * v.top_k >= abi.ARRIVAL_CTA:
        raise ValueError(f"roles_v2: {variant.key}: R C k = {self.rcap * v.top_k} rows per expert must stay below "
                         f"abi.ARRIVAL_CTA = {abi.ARRIVAL_CTA}")
    # Token groups of two n-tiles where the pipeline area holds their SMEM (`SH_BYTES_WIDE`, ~106 KB: the one-CTA
    # sm_90a variants), else one (70 KB: the two-CTA variants, and SM120's 99 KB per CTA). With `lanetab` the
    # decode table per lane adds 32 KB (138 KB; 102 KB, 6 KB past the two-CTA pipeline area, still two CTAs an SM);
    # not on SM120 nor in the fused transport's variants (its small shape's role 2 spilled 156 B with it, budget 64).
    lane_tabs = not self.qmma and v.ranks == 1  # (where a table per lane may go)
    self.sh = SharedSmem(SH_TOKENS_WIDE if self.ctas == 1 and not self.qmma else SH_TOKENS,
                         self.ablation == "lanetab" and lane_tabs)
    # `smempad` (timing, session 57): `lanetab`'s SMEM, the single table's code
    sized = SharedSmem(self.sh.tokens, True) if self.ablation == "smempad" and lane_tabs else self.sh
    self.shared_smem = sized.bytes if v.shared else 0
    if self.qmma:
      # SM120's budget (99 KB per CTA, 100 KB per SM: `geometry.RTX_PRO_5000`): as many stages as fit c CTAs.
      dev = geometry.RTX_PRO_5000
      budget = (min(dev.smem_per_block, dev.smem_per_sm // self.ctas - dev.reserved_smem_per_block)
                - STATIC_SMEM - self.pipe)
      n = stages(self.nt_max, budget, self.token_stride, self.w_bytes)
      if n < 2 or self.shared_smem > budget:
        raise ValueError(f"roles_v2: {variant.key} does not fit SM120's SMEM at {self.ctas} CTA(s) per SM: "
                         f"{n} pipeline stage(s) of {stage_bytes(self.nt_max, self.token_stride, self.w_bytes)} B, "
                         f"shared-expert path {self.shared_smem} B, budget {budget} B")
      self.pipe_bytes = n * stage_bytes(self.nt_max, self.token_stride, self.w_bytes)
    else:
      self.pipe_bytes = PIPE_AREA[self.ctas - 1] // stage_bytes(self.nt_max) * stage_bytes(self.nt_max)
    if self.kbany:
      kb_n = v.intermediate // v1.K128
      if kb_n >= 31 or self._any_stages(1) < 4:
        raise ValueError(f"roles_v2: {variant.key}: a kbany pass needs fewer than 31 GEMM2 stages ({kb_n}) and 4 "
                         f"stages of {any_stage_bytes(1)} B beside its p in {self.pipe_bytes} B")
    if self.kpair:  # a kpair pass gives up one of its stages to the warps' p (`_cpasync_mainloop`)
      n = stages(1, self.pipe_bytes)
      if n < 3 or (n - 1) * stage_bytes(1) + 2 * 2 * (WARPS // 2) * KPAIR_P_BYTES > self.pipe_bytes:
        raise ValueError(f"roles_v2: {variant.key}: a kpair pass needs 3 stages of {stage_bytes(1)} B and the warps' "
                         f"p in {self.pipe_bytes} B")

  def tensormaps(self) -> list[dict[str, int | str]]:
    """Role 2's TensorMaps, in formal order after the ABI's (`abi.ROLE2_TENSORMAPS`): the W13 and W2 weight tiles.

    Each weight tensor, ``[E][K/128][N][64 B]`` (`formats`), is a 2D map of ``E (K/128) N`` rows of 64 B. Compact
    weights: bytes, a box being one K128 tile of 128 rows (8 KiB) swizzled by 64 B, the layout `_weight_words` reads.
    Expanded weights (sm_120a/sm_121a, `compact` False): 128 4-bit codes per row as TMA's 16U4_ALIGN16B type, which
    lands every 16 codes in a 16-byte slot (16 KiB per box), swizzled by 128 B, the layout `_expanded_fragment`
    reads. The runtime encodes each from its base pointer (the ABI formal ``param``) when the pointer changes and
    passes the 128-byte descriptors by value (csrc/gc_runtime.cc)."""
    v = self.v
    maps = []
    for name, param, k, n in (("w13_map", "w13", v.hidden, 2 * v.intermediate),
                              ("w2_map", "w2", v.intermediate, v.hidden)):
      rows = v.experts * (k // v1.K128) * n
      if self.compact:
        maps.append(dict(name=name, param=param, dtype="uint8", dims=[64, rows], row_stride=64, box=[64, TILE_M],
                         swizzle=64))
      else:
        # The expanded path: the same rows as 128 4-bit codes each, unpacked to 16-byte slots by TMA (box[0] must be
        # 128 codes for this type, swizzle none or 128 B), read by ldmatrix's b4x16_p64 unpack (paper §4.3).
        maps.append(dict(name=name, param=param, dtype="u4x16_align16", dims=[v1.K128, rows], row_stride=64,
                         box=[v1.K128, TILE_M], swizzle=128))
    return maps

  def dynamic_smem(self, role: int) -> int:
    if role == 1:
      return self.role1_smem
    return self.pipe + max(self.pipe_bytes, self.shared_smem) if role == 2 else 0

  def ctas_per_sm(self, role: int) -> int:
    """CTAs of role ``role`` the kernel is built to co-schedule per SM (its grid is that times the compute SMs)."""
    if role == 1:
      return self.role1_ctas
    return self.ctas if role == 2 else 1

  @cute.jit
  def launch_role1(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
                   w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
                   s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
                   workspace: cute.Pointer, tokens: Int32, clamp: Float32):
    if cutlass.const_expr(self.fused):
      self.role1_fused(x, ids, route_weights, w13, w13_scale, w2, w2_scale, s13, s13_scale, s2, s2_scale, y,
                       workspace, tokens, clamp).launch(
        grid=[1, 1, 1], block=[THREADS, 1, 1], smem=self.role1_smem, min_blocks_per_mp=v1.MIN_CTAS_PER_SM)
    else:
      self.role1_dispatch(x, ids, route_weights, w13, w13_scale, w2, w2_scale, s13, s13_scale, s2, s2_scale, y,
                          workspace, tokens, clamp).launch(
        grid=[1, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=v1.MIN_CTAS_PER_SM)

  @cute.jit
  def launch_role2(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
                   w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
                   s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
                   workspace: cute.Pointer, tokens: Int32, clamp: Float32, tmap_w13: Int64, tmap_w2: Int64):
    self.role2_tc(x, ids, route_weights, w13, w13_scale, w2, w2_scale, s13, s13_scale, s2, s2_scale, y,
                  workspace, tokens, clamp, tmap_w13, tmap_w2).launch(
      grid=[1, 1, 1], block=[THREADS, 1, 1], smem=self.dynamic_smem(2), min_blocks_per_mp=v1.MIN_CTAS_PER_SM)
    # (Two CTAs per SM: build.py rewrites .minnctapersm and .maxnreg and assembles with the local ptxas.)

  # ////////////////////////////////////////////////////////////////////////////////////////////////////////////////

  @cute.kernel
  def role1_fused(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
                  w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
                  s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
                  workspace: cute.Pointer, tokens: Int32, clamp: Float32):
    """Role 1 of the fused transport (R > 1, paper §4.5), every CTA of the dispatch partition
    (`ROLE1_FUSED_CTAS_PER_SM` per SM):

    1. block 0: this rank's ids >= L R are faults (role 1, as in v1);
    2. thread p waits (bounded) until rank p published this call (``x_ready >= cur``: its role 2 quantized x and
       stored its ids, route weights and T); its T to SMEM. With B <= `DIRECT_SCAN_TOKENS` (the direct scan) only
       block 0 polls the peers, then opens the local ``rgate`` with their T, and the other CTAs wait on that;
    3. the route scan: a warp per global token g = p C + t reads its k ids and route weights from rank p once,
       stores each route's local expert (or 0xFF) into ``rtags`` and its weight into ``grw`` (the packed routes),
       and a lane whose route is local claims the route's place in its expert's ``rows`` (an atomic add on
       ``claim[e]``, `abi.arrivals`); then the CTA adds `abi.ARRIVAL_CTA` minus its claims to each ``arrive[e]``;
    4. the pulls: the same warp copies each token with a local route once (the pull cache keyed by (rank, token);
       without it, k < R, a warp per global route) from rank p's workspace into ``rx*[g]`` with `PULL_DEPTH`
       16-byte loads per lane in flight, then each of its local routes adds 1 to its expert's ``arrive[e]``;
    5. expert-granular publish: the thread whose add completes ``arrive[e]`` (every CTA listed its routes, every
       row of e landed) publishes e (`_publish`), so role 2 can start on an expert while others' rows are in flight.
    """
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    warp = tid // 32
    lane = tid % 32
    smem = cute.arch.get_dyn_smem(Int32, alignment=1024).toint()
    claimed = smem + self.claimed  # u32 per local expert: the rows this CTA claimed
    ranks, cap, k, local = v.ranks, v.capacity, v.top_k, v.experts
    wsb = workspace.toint()
    idb = ids.toint()
    n_tok = cutlass.min(cutlass.max(tokens, 0), cap)
    n_assign = n_tok * k
    cur = v1._ld(wsb + abi.HEADER["epoch"]) + 1
    par = cur & 1
    lo = v1._ld(wsb + abi.HEADER["rank"]) * local
    counters = wsb + ws.counters + Int64(par) * (self.words * v1.WORD_BYTES)
    arrive = counters + self.arrive * v1.WORD_BYTES
    claim = arrive + local * v1.WORD_BYTES
    complete = Int32(grid) * abi.ARRIVAL_CTA
    gate = wsb + ws.rgate
    pub = Int64(par) * (cap * k)
    if bid == 0:
      for a in range(tid, n_assign, THREADS):
        eid = v1._ld_nc(idb + Int64(a) * v1.WORD_BYTES)
        if eid >= local * ranks:
          v1._record_fault(wsb, 1, bid, cur, eid, a)
    for e in range(tid, local, THREADS):
      _sts(claimed + e * 4, 0)
    if cutlass.const_expr(self.engine):
      _sts(smem + self.digit_tab + tid * 4, _plane_entry(tid))  # 256 threads, 256 codes
    ok = Int32(1)
    direct = n_tok <= DIRECT_SCAN_TOKENS
    if direct & (bid != 0):
      if tid == 0:
        ok = self._wait_geq(gate, cur, wsb, cur, bid, Int32(abi.WAIT_GATE), abi.ROLE_TRANSPORT, patience=2)
      ok = 1 - _bar_or(ok == 0)
      if (ok != 0) & (tid < ranks):
        tp = _ld_cg(gate + 4 + tid * 4)
        ok = cutlass.select_(tp >= 0, Int32(1), Int32(0))
        _sts(smem + 16 + tid * 4, cutlass.max(tp, 0))
    else:
      if tid < ranks:
        pb = _peer(wsb, tid)
        ok = self._wait_geq(pb + abi.HEADER["x_ready"], cur, wsb, cur, bid, abi.WAIT_PEER + tid,
                            abi.ROLE_TRANSPORT, "sys")
        tp = cutlass.select_(ok != 0, _ld_cg(pb + ws.pub_tokens + Int64(par) * 4), Int32(-1))
        _sts(smem + 16 + tid * 4, cutlass.max(tp, 0))
        if direct:
          v1._st(gate + 4 + tid * 4, tp)
      if direct:  # block 0 of the direct scan opens the gate, with the peers' T (or -1 where a wait failed)
        cute.arch.sync_threads()
        if tid == 0:
          cute.arch.fence_acq_rel_gpu()
          cute.arch.store(v1._gptr(gate), cur, sem="release", scope="gpu")
    ok = 1 - _bar_or(ok == 0)
    # A CTA whose wait failed lists no route and never adds to ``arrive``: no expert completes, and role 2's waits
    # for the queue end on the recorded fault.
    # With the pull cache a warp takes a global token and pulls its row once if any of its k routes is local;
    # without it (k < R) a warp takes a global route and pulls the row for that route alone.
    per = 1 if self.cache else k
    lanes = k if self.cache else 1
    if ok != 0:
      for gr in range(bid * WARPS + warp, ranks * cap * per, Int32(grid) * WARPS):
        gt = gr // per
        p = gt // cap
        t = gt - p * cap
        if lane < lanes:
          a = gt * k + (lane if self.cache else gr - gt * k)  # the global assignment this lane reads
          tag = Int32(0xFF)
          if t < _lds(smem + 16 + p * 4):
            at = pub + (a - gt * k) + t * k
            pb = _peer(wsb, p)
            gid = _ld_cg(pb + ws.pub_ids + at * v1.WORD_BYTES)
            rw = _ld_cg(pb + ws.pub_rw + at * v1.WORD_BYTES)
            if (gid >= lo) & (gid < lo + local):
              tag = gid - lo
              v1._st(wsb + ws.grw + Int64(a) * v1.WORD_BYTES, rw)
              pos = _atom_add(claim + Int64(tag) * v1.WORD_BYTES, 1)
              v1._st(wsb + ws.rows + (Int64(tag) * (self.rcap * k) + pos) * v1.WORD_BYTES, a)
              cute.arch.inline_ptx("red.shared.add.u32 [{$r0}], 1;", read_only_args=[claimed + tag * 4])
          _st_u8(wsb + ws.rtags + Int64(a), tag)
      cute.arch.sync_threads()
      # This CTA listed its routes: its share of every expert's arrivals (the release carries its rows[e] entries).
      for e in range(tid, local, THREADS):
        cute.arch.fence_acq_rel_gpu()
        add = abi.ARRIVAL_CTA - _lds(claimed + e * 4)
        if _atom_add_acq_rel(arrive + Int64(e) * v1.WORD_BYTES, add) + add == complete:
          self._publish(e, wsb, cur, counters, claim)
      if cutlass.const_expr(self.engine):
        # The pull engine: lane 0 posts the next row's bulk copies into one slot before the warp drains the
        # other's, so a warp keeps a peer read in flight while it makes planes (`_post`, `_drain`).
        slots = smem + self.slots + warp * (PULL_SLOTS * self.slot_bytes)
        bars = smem + self.mbars + warp * (8 * PULL_SLOTS)
        if lane == 0:
          for b in cutlass.range_constexpr(PULL_SLOTS):
            _mbar_init(bars + 8 * b, 1)
          _fence_mbar_init()
          _fence_async_global()
        cute.arch.sync_warp()
        phases = Int32(0)  # bit s: the parity of slot s's next completion
        armed = Int32(0)  # bit s: slot s holds a posted copy not yet seen landed
        dead = Int32(0)  # a wait expired (recorded): post and drain nothing more
        b = Int32(0)
        pend = Int32(-1)
        for gr in range(bid * WARPS + warp, ranks * cap * per, Int32(grid) * WARPS):
          if dead == 0:
            tag, p, t = self._route_tag(gr, lane, smem, wsb)
            if _warp_any(tag != 0xFF) != 0:
              if lane == 0:
                self._post(slots + b * self.slot_bytes, bars + b * 8, _peer(wsb, p), t)
              armed = armed ^ (1 << b)
              if pend >= 0:
                o = 1 - b
                if self._drain(slots + o * self.slot_bytes, bars + o * 8, (phases >> o) & 1, pend, lane, smem, wsb,
                               cur, arrive, complete, counters, claim) != 0:
                  phases = phases ^ (1 << o)
                  armed = armed ^ (1 << o)
                else:
                  dead = Int32(1)
              pend = gr
              b = 1 - b
        if (pend >= 0) & (dead == 0):
          o = 1 - b
          if self._drain(slots + o * self.slot_bytes, bars + o * 8, (phases >> o) & 1, pend, lane, smem, wsb, cur,
                         arrive, complete, counters, claim) != 0:
            armed = armed ^ (1 << o)
        # After an expired wait a slot may still be filling (its phase never completed, so it was never re-armed):
        # one more bounded wait per such slot, so that no bulk copy lands in SMEM after this CTA is gone.
        for s in cutlass.range_constexpr(PULL_SLOTS):
          if (armed >> s) & 1 != 0:
            self._landed(bars + 8 * s, (phases >> s) & 1, wsb)
      else:
        for gr in range(bid * WARPS + warp, ranks * cap * per, Int32(grid) * WARPS):
          tag, p, t = self._route_tag(gr, lane, smem, wsb)
          if _warp_any(tag != 0xFF) != 0:
            self._pull_row(wsb, _peer(wsb, p), gr, t, lane)
            cute.arch.sync_warp()  # the warp's row stores, before each route's release
            self._arrive(tag, arrive, complete, wsb, cur, counters, claim)

  @cute.jit
  def _route_tag(self, gr: Int32, lane: Int32, smem: Int32, wsb: Int64):
    """Role 1's pull loops: (this lane's route's local expert, or 0xFF: none or not this lane's; the source rank;
    the source token) of global token (or, without the pull cache, route) ``gr``, from the tags the scan stored."""
    v = self.v
    per = 1 if self.cache else v.top_k
    gt = gr // per
    p = gt // v.capacity
    t = gt - p * v.capacity
    tag = Int32(0xFF)
    a = gt * v.top_k + (lane if self.cache else gr - gt * v.top_k)
    if lane < (v.top_k if self.cache else 1):
      tag = cutlass.select_(t < _lds(smem + 16 + p * 4), _ld_u8(wsb + self.ws.rtags + Int64(a)), Int32(0xFF))
    return tag, p, t

  @cute.jit
  def _arrive(self, tag: Int32, arrive: Int64, complete: Int32, wsb: Int64, cur: Int32, counters: Int64,
              claim: Int64):
    """After a warp's row landed (its stores, then a warp barrier): each lane with a local route adds 1 to its
    expert's arrivals (acq_rel), and the one whose add completes them publishes the expert."""
    if tag != 0xFF:
      cute.arch.fence_acq_rel_gpu()
      if _atom_add_acq_rel(arrive + Int64(tag) * v1.WORD_BYTES, 1) + 1 == complete:
        self._publish(tag, wsb, cur, counters, claim)

  @cute.jit
  def _post(self, slot: Int32, bar: Int32, pb: Int64, t: Int32):
    """Lane 0 of the pull engine: token ``t``'s E4M3 codes and scale bytes from the peer at ``pb`` into ``slot``
    (two bulk copies completing bytes on ``bar``). The warp's last reads of the slot (its drain two rows ago) come
    first (a warp barrier there, the async proxy fence here)."""
    v, ws = self.v, self.ws
    nblk = v.hidden // v1.K32
    _fence_async_smem()
    _mbar_arrive_tx(bar, self.slot_bytes)
    _bulk(slot, pb + ws.xq + Int64(t) * v.hidden, v.hidden, bar)
    _bulk(slot + v.hidden, pb + ws.xsf + Int64(t) * nblk, nblk, bar)

  @cute.jit
  def _landed(self, bar: Int32, parity: Int32, wsb: Int64) -> Int32:
    """Every lane of a warp: bounded wait (``header.timeout_ns``) for the phase ``parity`` of the mbarrier at
    ``bar``; 1 on every lane if it completed, else 0."""
    timeout = v1._ld(wsb + abi.HEADER["timeout_ns"], cutlass.Uint64)
    start = cute.arch.globaltimer()
    done = _mbar_try(bar, parity)
    elapsed = cutlass.Uint64(0)
    while (done == 0) & (elapsed <= timeout):
      done = _mbar_try(bar, parity)
      elapsed = cutlass.Uint64(cute.arch.globaltimer() - start)
    return 1 - _warp_any(done == 0)

  @cute.jit
  def _drain(self, slot: Int32, bar: Int32, parity: Int32, gr: Int32, lane: Int32, smem: Int32, wsb: Int64,
             cur: Int32, arrive: Int64, complete: Int32, counters: Int64, claim: Int64) -> Int32:
    """The pull engine's warp, once row ``gr``'s copy landed in ``slot`` (`_landed` on ``bar``): writes received
    row ``gr`` as phase 0 writes a local one (sm_90a: the three digit planes from the decode table, 16 codes per
    lane and step, each plane's 16 bytes one store; the exponent words, the flag; sm_120a: the codes as plane 0),
    the scale bytes, then counts its local routes' arrivals; 1 if the row landed. An expired wait records
    ``WAIT_RECEIVED`` + the source rank and returns 0, and the row's experts never complete (role 2's waits then
    end on the fault)."""
    v, ws = self.v, self.ws
    nblk = v.hidden // v1.K32
    tag, p, t = self._route_tag(gr, lane, smem, wsb)
    landed = self._landed(bar, parity, wsb)
    if landed == 0:
      if lane == 0:
        bid, _, _ = cute.arch.block_idx()
        v1._record_fault(wsb, abi.ROLE_TRANSPORT, bid, cur, Int32(abi.WAIT_RECEIVED) + p, t)
    else:
      planes = wsb + ws.rxplanes + Int64(gr) * (nblk * BLOCK_BYTES)
      tab = smem + self.digit_tab
      for c in range(lane, v.hidden // 16, 32):  # 16 codes: half a K32 block
        words = [_lds(slot + c * 16 + 4 * i) for i in range(4)]
        dst = planes + (c // 2) * BLOCK_BYTES + (c % 2) * 16
        if cutlass.const_expr(self.qmma):
          v1._st_v4(dst, *words)
        else:
          d = [_e4m3_digits(w, tab) for w in words]
          for q in cutlass.range_constexpr(PLANES):
            v1._st_v4(dst + 32 * q, d[0][q], d[1][q], d[2][q], d[3][q])
      sf = slot + v.hidden
      if cutlass.const_expr(not self.qmma):
        slow = Int32(0)
        for blk in range(lane, nblk, 32):
          byte = _lds_u8(sf + blk)
          word, block_slow = _exp_word(byte - v1.F32_BIAS + v1.FP4_DOT_SHIFT, byte == 0xFF)
          v1._st(wsb + ws.rxexp + (Int64(gr) * nblk + blk) * 4, word)
          if block_slow:
            slow = Int32(1)
        if (_warp_any(slow) != 0) & (lane == 0):
          v1._st(wsb + ws.rxflag + Int64(gr) * 4, cur)
      for w in range(lane, nblk // 4, 32):
        v1._st(wsb + ws.rxsf + Int64(gr) * nblk + w * 4, _lds(sf + w * 4))
      cute.arch.sync_warp()  # the warp's row stores (and its reads of the slot), before each route's release
      self._arrive(tag, arrive, complete, wsb, cur, counters, claim)
    return landed

  @cute.jit
  def _publish(self, e: Int32, wsb: Int64, cur: Int32, counters: Int64, claim: Int64):
    """One thread, whose acq_rel add completed expert ``e``'s arrivals (every CTA's rows[e] entries and every row of
    e are visible to it): writes ``count[e]``, publishes ``ready[e] = cur`` (release) and appends e to the active
    queue if it has rows, then counts the expert published; the thread that counts the last one closes the queue.
    The stall test hook's expert is neither published nor counted, so the queue stays open."""
    v, ws = self.v, self.ws
    count = v1._ld(claim + Int64(e) * v1.WORD_BYTES)
    v1._st(wsb + ws.count + Int64(e) * v1.WORD_BYTES, count)
    if e != v1._ld(wsb + abi.HEADER["stall_expert"]):
      cute.arch.store(v1._gptr(wsb + ws.ready + Int64(e) * v1.WORD_BYTES), cur, sem="release", scope="gpu")
      queue = self._active_queue(wsb, cur)
      if count > 0:
        v1._queue_append(queue, e)
      published, _ = abi.fused_counters(v.experts, v.capacity, v.shared)
      if _atom_add_acq_rel(counters + published * v1.WORD_BYTES, 1) == v.experts - 1:
        v1._queue_close(queue)

  @cute.jit
  def _pull_row(self, wsb: Int64, pb: Int64, gr: Int32, t: Int32, lane: Int32):
    """One warp copies token ``t``'s quantized row from the peer at ``pb`` into received row ``gr``: the digit
    planes and exponent words as 16-byte chunks, `PULL_DEPTH` loads per lane issued before their stores (a fabric
    round trip per batch, not per chunk), then the scale bytes and the flag as words."""
    ws = self.ws
    n_planes = self.nblk_h * BLOCK_BYTES // 16
    n_chunks = n_planes + self.nblk_h // 4
    per_lane = -(-n_chunks // 32)
    rounds = -(-per_lane // PULL_DEPTH)
    depth = -(-per_lane // rounds)
    src_p = pb + ws.xplanes + Int64(t) * (n_planes * 16)
    dst_p = wsb + ws.rxplanes + Int64(gr) * (n_planes * 16)
    src_e = pb + ws.xexp + Int64(t) * (self.nblk_h * 4) - n_planes * 16
    dst_e = wsb + ws.rxexp + Int64(gr) * (self.nblk_h * 4) - n_planes * 16

    def chunk(planes, exps, i, c):
      """The address of chunk ``c`` (batch ``i`` of the lanes) in a row at ``planes`` / ``exps``."""
      if cutlass.const_expr(32 * i + 31 < n_planes):
        return planes + c * 16
      if cutlass.const_expr(32 * i >= n_planes):
        return exps + c * 16
      return cutlass.select_(c < n_planes, planes, exps) + c * 16

    for r in cutlass.range_constexpr(rounds):
      vals = []
      for d in cutlass.range_constexpr(depth):
        i = r * depth + d
        c = cutlass.min(lane + 32 * i, n_chunks - 1)  # a lane past the end reloads the last chunk (not stored)
        vals.append(v1._ld_cg_v4(chunk(src_p, src_e, i, c)))
      for d in cutlass.range_constexpr(depth):
        i = r * depth + d
        c = lane + 32 * i
        dst = chunk(dst_p, dst_e, i, c)
        if cutlass.const_expr(32 * i + 31 < n_chunks):
          v1._st_v4(dst, *vals[d])
        else:
          if c < n_chunks:
            v1._st_v4(dst, *vals[d])
    # Scale bytes (a word per 4 K32 blocks) and the flag (word n_sf): one batch.
    n_sf = self.nblk_h // 4
    sf_lane = -(-(n_sf + 1) // 32)
    vals = []
    for d in cutlass.range_constexpr(sf_lane):
      c = cutlass.min(lane + 32 * d, n_sf)
      src = cutlass.select_(c < n_sf, pb + ws.xsf + Int64(t) * self.nblk_h + c * 4, pb + ws.xflag + Int64(t) * 4)
      vals.append(_ld_cg(src))
    for d in cutlass.range_constexpr(sf_lane):
      c = lane + 32 * d
      if c <= n_sf:
        dst = cutlass.select_(c < n_sf, wsb + ws.rxsf + Int64(gr) * self.nblk_h + c * 4,
                              wsb + ws.rxflag + Int64(gr) * 4)
        v1._st(dst, vals[d])

  # ////////////////////////////////////////////////////////////////////////////////////////////////////////////////

  @cute.kernel
  def role2_tc(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
               w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
               s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
               workspace: cute.Pointer, tokens: Int32, clamp: Float32, tmap_w13: Int64, tmap_w2: Int64):
    """Role 2. ``tmap_w13``/``tmap_w2``: the TensorMaps of the W13 and W2 weight tiles (`tensormaps`), passed by
    value in the parameter space (the build's §5.1 rewrite turns these pointer formals into 128-byte ones).

    ``tokens`` holds `abi.TOKENS_SOLO` where the graph holds this kernel alone (`abi.SCAN_TOKENS`): then its last
    `solo_ctas` CTAs, launched beyond the item grid, do the work of roles 1 and 3 (`_solo_finalize`) and the
    others take the items (`_items`). The combining CTAs branch off here, at the start, with the item path first:
    code after the item loop (even one branch) cost ptxas 16-28 B more spills at the two-CTA register cap, and the
    same branch the other way round 24 B (GLM5.2 T8 routed, session 32); this way it costs none."""
    if cutlass.const_expr(self.scan_tokens > 0):
      bid, _, _ = cute.arch.block_idx()
      n, combining, items_grid = self._solo_split(tokens)
      if bid < items_grid:
        self._items(x, ids, route_weights, w13, w13_scale, w2, w2_scale, s13, s13_scale, s2, s2_scale, y, workspace,
                    tokens, clamp, tmap_w13, tmap_w2)
      else:
        self._solo_finalize(ids.toint(), y.toint(), workspace.toint(), n, bid - items_grid, items_grid, combining)
    else:  # (the fused transport: no combining CTAs)
      self._items(x, ids, route_weights, w13, w13_scale, w2, w2_scale, s13, s13_scale, s2, s2_scale, y, workspace,
                  tokens, clamp, tmap_w13, tmap_w2)

  @cute.jit
  def _solo_split(self, tokens: Int32):
    """(T, the combining CTAs, the item CTAs) from role 2's ``tokens`` parameter (`abi.TOKENS_SOLO`) and the grid
    (a few instructions on the parameter: `role2_tc` and `_items` each evaluate it)."""
    grid, _, _ = cute.arch.grid_dim()
    n = tokens
    combining = Int32(0)
    if cutlass.const_expr(self.scan_tokens > 0):
      n = cutlass.select_(tokens >= abi.TOKENS_SOLO, tokens - abi.TOKENS_SOLO, tokens)
      combining = cutlass.select_(tokens >= abi.TOKENS_SOLO, self._solo_ctas(n), Int32(0))
    return n, combining, Int32(grid) - combining

  @cute.jit
  def _items(self, x: cute.Pointer, ids: cute.Pointer, route_weights: cute.Pointer, w13: cute.Pointer,
             w13_scale: cute.Pointer, w2: cute.Pointer, w2_scale: cute.Pointer, s13: cute.Pointer,
             s13_scale: cute.Pointer, s2: cute.Pointer, s2_scale: cute.Pointer, y: cute.Pointer,
             workspace: cute.Pointer, tokens: Int32, clamp: Float32, tmap_w13: Int64, tmap_w2: Int64):
    """Role 2's item CTAs (all but the combining ones: `_solo_split`): phase 0, the expert table, then the items
    of the queue."""
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    tokens, _, grid32 = self._solo_split(tokens)
    ctl = cute.arch.get_dyn_smem(Int32, alignment=STAGE_ALIGN).toint()
    table = ctl + self.table
    pipe = ctl + self.pipe
    wsb = workspace.toint()
    n_tok = cutlass.min(cutlass.max(tokens, 0), v.capacity)
    cur = v1._ld(wsb + abi.HEADER["epoch"]) + 1
    par = cur & 1
    counters = wsb + ws.counters + Int64(par) * (self.words * v1.WORD_BYTES)
    c_bits = v1._bf16_rne(v1._float_bits(clamp)) << v1.BF16_SHIFT
    warp = tid // 32
    lane = tid % 32
    if cutlass.const_expr(self.timeline):
      if tid == 0:
        _sts(ctl + CTL_TL, 0)
        self._tl_cta(wsb, cur, bid, Int32(0))
    if cutlass.const_expr(self.smem_tables):
      if tid == 0:  # read after phase 0's barrier
        for q, word in enumerate(DECODE_TABLES):
          _sts(ctl + CTL_TABLES + 4 * q, Int32(word))

    route_ids = None
    if cutlass.const_expr(self.trips and self.scan_tokens > 0):
      # (`trips`: the routes `_scan_routes` lists, loaded before phase 0, so their round trip overlaps its own)
      route_ids = self._route_ids(ids.toint(), n_tok * v.top_k, lane)

    # ---- phase 0: MXFP8 of x into digit planes, a warp per (token, K32 block) --------------------------------
    for q in range(bid * WARPS + warp, n_tok * self.nblk_h, grid32 * WARPS):
      t = q // self.nblk_h
      b = q - t * self.nblk_h
      val = v1._ld_nc_bf16(x.toint() + (Int64(t) * v.hidden + b * v1.K32 + lane) * v1.BF16_BYTES)
      n, e, bad = self._quantize_lane(val, lane, wsb + ws.xplanes + Int64(q) * BLOCK_BYTES,
                                      wsb + ws.xexp + Int64(q) * 4, wsb + ws.xflag + Int64(t) * 4,
                                      wsb + ws.xsf + Int64(q), cur,
                                      bf_addr=(wsb + ws.xbf + Int64(q) * BF16_PLANE_BYTES
                                               if self.bf16 or self.sh_bf16 else None))
      if cutlass.const_expr(v.shared):
        self._store_digits(n, e, bad, lane, wsb + ws.sxp + Int64(q) * SH_BLOCK, wsb + ws.sxe + Int64(q) * 4)
      if cutlass.const_expr(self.engine):  # the row as the peers' pull engines copy it (`abi.Workspace.xq`)
        _st_u8(wsb + ws.xq + Int64(q) * v1.K32 + lane, _e4m3_code(n))
        if cutlass.const_expr(not self.qmma):  # (the sm_120a seam stored the scale byte already)
          if lane == 0:
            _st_u8(wsb + ws.xsf + Int64(q), cutlass.select_(bad != 0, Int32(0xFF), e + v1.F32_BIAS))
    if cutlass.const_expr(self.fused):
      # This call's routes and T for the peers' role 1, by parity (a peer may still read the previous call's).
      pub = Int64(par) * (v.capacity * v.top_k)
      for a in range(bid * THREADS + tid, n_tok * v.top_k, grid32 * THREADS):
        v1._st(wsb + ws.pub_ids + (pub + a) * 4, v1._ld_nc(ids.toint() + Int64(a) * 4))
        v1._st(wsb + ws.pub_rw + (pub + a) * 4, v1._ld_nc(route_weights.toint() + Int64(a) * 4))
      if (bid == 0) & (tid == 0):
        v1._st(wsb + ws.pub_tokens + Int64(par) * 4, n_tok)
    cute.arch.sync_threads()
    if tid == 0:
      if cutlass.const_expr(self.timeline):
        self._tl_cta(wsb, cur, bid, Int32(1))
      cute.arch.fence_acq_rel_gpu()
      _red_release_add(counters + v.experts * v1.WORD_BYTES, 1)

    # ---- the experts hit: role 1's active queue, once it is closed (the fused transport: as it grows) ----------
    # Up to `scan_tokens` the CTA lists the routes itself, before it waits for the other CTAs' phase 0: the routes
    # do not depend on it, and the table is then ready when that wait ends.
    scanned = Int32(0)
    if cutlass.const_expr(self.scan_tokens > 0):
      scanned = cutlass.select_(n_tok <= self.scan_tokens, Int32(1), Int32(0))
      if scanned != 0:
        self._scan_routes(ids.toint(), n_tok * v.top_k, ctl, route_ids)
    item0 = Int32(-1)
    pre1 = Int32(0)
    if cutlass.const_expr(self.w_early1):
      # The first item claimed now, and a GEMM1 item's first weight stages copied while the CTA waits below.
      if scanned != 0:
        item0 = self._claim(counters, ctl)
        if item0 < _lds(ctl + 4) * self.j1:
          h0 = item0 // self.j1
          e0 = _lds(table + (v.experts + h0) * 4)
          if _lds(table + e0 * 4) <= 8:  # (one pass of the 1-tile body: `_item`)
            pre1 = Int32(1)
            self._w_ahead(False, e0, item0 - h0 * self.j1, w13.toint(), w13_scale.toint(), pipe)
    queue = self._active_queue(wsb, cur)
    ok = Int32(1)
    if tid == 0:
      ok = self._wait_geq(counters + v.experts * v1.WORD_BYTES, grid32, wsb, cur, bid, abi.WAIT_XQ)
      if cutlass.const_expr(self.fused):
        # Every CTA's x and routes are in: the peers may read them (unless the test hook withholds the call).
        if (bid == 0) & (ok != 0) & (v1._ld(wsb + abi.HEADER["stall_expert"]) != abi.STALL_CALL):
          _fence_sys()
          _st_release_sys(wsb + abi.HEADER["x_ready"], cur)
      if cutlass.const_expr(self.fused):
        # The queue's size is unknown until role 1 closes it: the items are decoded as it grows (`_claim_streaming`).
        _sts(ctl, ok)
        _sts(ctl + 4, -1)
        _sts(ctl + CTL_HITS, 0)
      else:
        _sts(ctl + CTL_SCANNED, scanned)
        if scanned == 0:  # (else `_scan_routes` wrote the table and the experts hit at ctl + 4)
          if ok != 0:
            ok = self._await_queue(queue, wsb, cur, bid)
          _sts(ctl + 4, cutlass.select_(ok != 0, v1._ld(queue + v1.WORD_BYTES) - 1, Int32(0)))
        _sts(ctl, ok)
      if cutlass.const_expr(v.shared):
        _sts(ctl + CTL_TOKENS, n_tok)
    cute.arch.sync_threads()
    if cutlass.const_expr(not self.fused):
      if scanned == 0:
        self._fill_table(queue, wsb, table, _lds(ctl + 4))
    cute.arch.sync_threads()
    ok = _lds(ctl)
    n_hit = _lds(ctl + 4)
    if cutlass.const_expr(self.fused):
      n_hit = _lds(ctl + CTL_HITS)
    if cutlass.const_expr(self.kpair):
      # GEMM2 items of 64 rows (`kpair`) where every expert hit holds at most `KPAIR_TOKENS` rows.
      if tid == 0:
        kp = cutlass.select_(n_tok <= KPAIR_TOKENS, Int32(1), Int32(0))
        for h in range(n_hit):
          if _lds(table + _lds(table + (v.experts + h) * 4) * 4) > KPAIR_TOKENS:
            kp = Int32(0)
        _sts(ctl + CTL_KPAIR, kp)
    cute.arch.sync_threads()
    if cutlass.const_expr(self.timeline):
      if tid == 0:
        self._tl_cta(wsb, cur, bid, Int32(2))

    # Items, in the order of `abi.item_order`: GEMM1 tiles (n1), GEMM2 tiles (n2, each after its expert's GEMM1
    # tiles), and with the shared expert its GEMM1 column blocks (n_s1) and GEMM2 column blocks (n_s2, each after
    # its token group's GEMM1 blocks).
    n1 = n_hit * self.j1
    n2 = n_hit * (0 if cutlass.const_expr(self.ablation == "nogemm2") else self._per2(ctl))
    n_s1 = Int32(0)
    n_s2 = Int32(0)
    n_tg, per_cb = self._shared_groups(n_tok)
    if cutlass.const_expr(v.shared):
      n_s1 = per_cb * self.n_cb
      n_s2 = per_cb * self.n_hb
    n_items = cutlass.select_(ok != 0, n1 + n2 + n_s1 + n_s2, Int32(0))
    if cutlass.const_expr(v.shared):  # where each kind's items start in the queue
      at, sizes = {}, {"routed GEMM1": n1, "routed GEMM2": n2, "shared GEMM1": n_s1, "shared GEMM2": n_s2}
      end = Int32(0)
      for kind in self.item_order:
        at[kind] = end
        end = end + sizes[kind]
      r1_at, r2_at, s1_at, s2_at = (at[kind] for kind in sizes)
    failed = Int32(0)
    first, step = bid, grid32
    takes = Int32(1)
    if cutlass.const_expr(self.relay):
      # The relay return path: the first min(R, grid - 1) CTAs are copiers (paper eq. 13 with one reserved CTA),
      # the others take the items.
      n_relay = cutlass.min(Int32(v.ranks), grid32 - 1)
      first = bid - n_relay
      step = grid32 - n_relay
      if bid < n_relay:
        if ok != 0:
          # A copier follows the experts in queue order, and needs the closed queue.
          if tid == 0:
            _sts(ctl, self._await_queue(queue, wsb, cur, bid))
            _sts(ctl + 4, v1._ld(queue + v1.WORD_BYTES) - 1)
          cute.arch.sync_threads()
          if _lds(ctl) != 0:
            self._fill_table(queue, wsb, table, _lds(ctl + 4))
            cute.arch.sync_threads()
            self._copier(bid, n_relay, _lds(ctl + 4), table, wsb, cur, bid, counters, pipe)
        takes = Int32(0)  # a copier takes no item
    item = n_items
    if takes != 0:
      if cutlass.const_expr(self.fused):
        item, n_hit = self._claim_streaming(counters, ctl, queue, table, wsb, cur, bid, n_s1)
      elif cutlass.const_expr(self.w_early1):
        if scanned != 0:
          item = item0
        else:
          item = self._claim(counters, ctl)
      elif cutlass.const_expr(self.dynamic):
        item = self._claim(counters, ctl)
      else:
        item = first
    called = ok  # (``ok`` is reused by the items' waits)
    if cutlass.const_expr(self.fused):
      n1, n2, n_items, r1_at, r2_at, s1_at, s2_at = self._item_bounds(n_hit, n_s1, n_s2, called)
    while item < n_items:
      if cutlass.const_expr(self.timeline):
        self._tl_item(wsb, cur, bid, ctl, item, 0)
      if failed == 0:
        it = item  # the routed item (GEMM1 tiles, then GEMM2 tiles)
        routed = item < n1 + n2
        if cutlass.const_expr(v.shared):
          routed = ((item >= r1_at) & (item < r1_at + n1)) | ((item >= r2_at) & (item < r2_at + n2))
          it = cutlass.select_(item >= r2_at, item - r2_at + n1, item - r1_at)  # the routed-only numbering
        if routed:
          g2 = it >= n1
          it = cutlass.select_(g2, it - n1, it)
          per = cutlass.select_(g2, self._per2(ctl), Int32(self.j1))
          h = it // per
          j = it - h * per
          e = _lds(table + (v.experts + h) * 4)
          count = _lds(table + e * 4)
          if g2:
            ok = Int32(1)
            pre = Int32(0)
            if cutlass.const_expr(self.w_early):
              if (count >= 1) & (count <= 8):  # (one pass of the 1-tile body: `_item`)
                pre = Int32(1)
                self._w_ahead(True, e, j, w2.toint(), w2_scale.toint(), pipe)
            any1 = None
            if cutlass.const_expr(self.kbany):  # (an item of 1-2 rows waits per K128 block instead: `_any_mainloop`)
              any1 = cutlass.select_(count <= self.kbany_rows, Int32(1), Int32(0))
            if tid == 0:
              if cutlass.const_expr(self.l2ahead):
                if n_tok <= L2_AHEAD_TOKENS:  # (its weights do not wait for the expert's GEMM1)
                  self._l2_ahead(w2.toint(), w2_scale.toint(), e, j)
              if cutlass.const_expr(self.kbany):
                if any1 == 0:
                  ok = self._wait_gemm1(counters, e, wsb, cur, bid)
              else:
                ok = self._wait_gemm1(counters, e, wsb, cur, bid)
            if _bar_or(ok == 0) != 0:
              failed = Int32(1)
              if cutlass.const_expr(self.w_early):
                _wait_group(0)  # the copies ahead land before anything else uses the pipeline area
            else:
              if cutlass.const_expr(self.timeline):
                self._tl_item(wsb, cur, bid, ctl, item, 1)
              self._item(True, e, j, count, route_weights.toint(), w2.toint(), w2_scale.toint(), wsb, c_bits,
                         cur, ctl, pipe, tmap_w2, _lds(ctl + CTL_KPAIR) if cutlass.const_expr(self.kpair) else None,
                         pre if cutlass.const_expr(self.w_early) else None, any1)
              if cutlass.const_expr(self.relay):  # the copiers follow each expert's GEMM2 items done
                self._count_done(counters, self.relay_base + e)
          else:
            if cutlass.const_expr(self.l2ahead):
              # GEMM1 item i < P prefetches GEMM2 item n2 - P + i: the last P of the queue, claimed when the first
              # GEMM2 round is done and each waiting for a whole round's DRAM latency otherwise.
              n_ahead = cutlass.min(cutlass.min(n1, n2), Int32(L2_AHEAD_BYTES // self._gemm2_item_bytes()))
              if (tid == 0) & (n_tok <= L2_AHEAD_TOKENS) & (it < n_ahead):
                t2 = n2 - n_ahead + it
                h2 = t2 // self.j2
                self._l2_ahead(w2.toint(), w2_scale.toint(), _lds(table + (v.experts + h2) * 4), t2 - h2 * self.j2)
            if cutlass.const_expr(self.kbany):
              if tid == 0:
                _sts(ctl + CTL_G1SLOW, 0)  # (set by the item's requantization where a block is slow)
            self._item(False, e, j, count, route_weights.toint(), w13.toint(), w13_scale.toint(), wsb, c_bits,
                       cur, ctl, pipe, tmap_w13, None, pre1 if cutlass.const_expr(self.w_early1) else None)
            self._count_done(counters, e)
            if cutlass.const_expr(self.kbany):
              if tid == 0:  # (after `_count_done`'s fence: the item's blocks are visible before its tag)
                _st_tag(wsb + self.ws.g1tags + (Int64(e) * self.j1 + j) * 8, cur, _lds(ctl + CTL_G1SLOW))
        else:
          if cutlass.const_expr(v.shared):
            token_counters = counters + Int64(v.experts + 1) * v1.WORD_BYTES
            n_tok = _lds(ctl + CTL_TOKENS)  # (`CTL_TOKENS`)
            n_tg, per_cb = self._shared_groups(n_tok)
            # Column-block-major: the groups' items on the same weight rows run together (L2 reuse).
            if item < s1_at + n_s1:
              s = item - s1_at
              cb = s // per_cb
              tg = cutlass.min(s - cb * per_cb, n_tg - 1)
              self._shared_gemm1(tg, cb, s - cb * per_cb - tg, n_tok, s13.toint(), s13_scale.toint(), wsb, cur,
                                 c_bits, pipe, token_counters + Int64(tg) * v1.WORD_BYTES)
            else:
              s = item - s2_at
              hb = s // per_cb
              tg = cutlass.min(s - hb * per_cb, n_tg - 1)
              failed = self._shared_gemm2(tg, hb, s - hb * per_cb - tg, n_tok, s2.toint(), s2_scale.toint(), wsb,
                                          cur, bid, pipe, token_counters + Int64(tg) * v1.WORD_BYTES)
      if cutlass.const_expr(self.timeline):
        self._tl_item(wsb, cur, bid, ctl, item, 2)
      if cutlass.const_expr(self.w_early1):
        pre1 = Int32(0)  # (the first item only)
      # A CTA that failed a wait goes on claiming (and skipping) items, as with the round-robin, so the claims of
      # the others stay in item order.
      if cutlass.const_expr(self.fused):
        item, n_hit = self._claim_streaming(counters, ctl, queue, table, wsb, cur, bid, n_s1)
        n1, n2, n_items, r1_at, r2_at, s1_at, s2_at = self._item_bounds(n_hit, n_s1, n_s2, called)
      elif cutlass.const_expr(self.dynamic):
        item = self._claim(counters, ctl)
      else:
        item = item + step
    if cutlass.const_expr(self.w_early1):
      _wait_group(0)  # a first item's copies ahead land even where its call failed before the item ran
    if cutlass.const_expr(self.timeline):
      if tid == 0:
        self._tl_cta(wsb, cur, bid, Int32(3))
        self._tl_cta_put(wsb, cur, bid, Int32(4), Int64(_lds(ctl + CTL_TL)))
        self._tl_cta_put(wsb, cur, bid, Int32(5), Int64(Int32(cute.arch.smid()) + 1))
    if cutlass.const_expr(v.ranks == 1):
      # Role 3 may run beside this kernel (`abi.FINALIZE_EARLY_TOKENS`), or this kernel's combining CTAs do its work
      # (`abi.TOKENS_SOLO`): either waits for every item CTA's count.
      self._count_done(counters, abi.role2_done(v.experts, v.capacity, v.shared, v.ranks, v.relay))

  @cute.jit
  def _wait_gemm1(self, counters: Int64, e: Int32, wsb: Int64, cur: Int32, bid: Int32) -> Int32:
    """One thread: a routed GEMM2 item's bounded wait for every GEMM1 item of its expert (`_wait_geq`)."""
    return self._wait_geq(counters + Int64(e) * v1.WORD_BYTES, Int32(self.j1), wsb, cur, bid, abi.WAIT_GEMM1 + e)

  def _gemm2_item_bytes(self) -> int:
    """The W2 bytes a routed GEMM2 item streams: its `TILE_M` rows' E2M1 tiles and scale words over K = I."""
    kb_n = self.v.intermediate // v1.K128
    return TILE_M * kb_n * (v1.FP4_TILE_BYTES + v1.WORD_BYTES)

  @cute.jit
  def _l2_ahead(self, w2: Int64, w2_scale: Int64, e: Int32, j: Int32):
    """Prefetch into L2 the W2 rows of routed GEMM2 item (e, j) (`GCMOE_ABLATION=l2ahead`): per K128 tile the item's
    `W_BYTES` of E2M1 rows, then its rows' scale words (`[E, K/128, N, 64]` and `[E, K/128, N]`)."""
    v = self.v
    kb_n = v.intermediate // v1.K128
    pw_e, psc_e = self._expert_weights(e, w2, w2_scale, v.hidden, kb_n)
    self._prefetch_tiles(pw_e, v.hidden, j * TILE_M, 0, kb_n)
    for kb in cutlass.range_constexpr(kb_n):
      _prefetch_l2(psc_e + (Int64(kb) * v.hidden + j * TILE_M) * v1.WORD_BYTES, SC_BYTES)

  @cute.jit
  def _w_ahead(self, g2: cutlass.Constexpr, e: Int32, j: Int32, pw: Int64, psc: Int64, pipe: Int32):
    """`w_early`: the weights and scale words of the first stages of routed item (e, j)'s one-tile pass (GEMM2, or
    with ``g2`` False GEMM1), copied (one cp.async group) into the pipeline stages its prologue would fill
    (`_cpasync_mainloop`), which then copies only their B side; with `w_early_l2`, thread 0 also prefetches the
    item's other K128 tiles into L2."""
    v = self.v
    n_rows = v.hidden if cutlass.const_expr(g2) else 2 * v.intermediate
    kb_n = (v.intermediate if cutlass.const_expr(g2) else v.hidden) // v1.K128
    n_st = self._pass_stages(1)
    st_bytes = stage_bytes(1, self.token_stride, self.w_bytes)
    n_pro = min(n_st - self._per_bar(1, n_st, kb_n), kb_n)
    pw_e, psc_e = self._expert_weights(e, pw, psc, n_rows, kb_n)
    row0 = j * TILE_M
    for s in cutlass.range_constexpr(n_pro):
      self._issue_w(s, pipe + s * st_bytes, pw_e, psc_e, row0, n_rows)
    _commit()
    if cutlass.const_expr(self.w_early_l2):
      tid, _, _ = cute.arch.thread_idx()
      if tid == 0:
        self._prefetch_tiles(pw_e, n_rows, row0, n_pro, kb_n)

  def _pass_stages(self, nt: int) -> int:
    """Pipeline stages of a pass of ``nt`` n-tiles in the pipeline area (`GCMOE_ABLATION=shallow`: at most
    `SHALLOW_STAGES` in one-tile passes)."""
    n = stages(nt, self.pipe_bytes, self.token_stride, self.w_bytes)
    return min(n, SHALLOW_STAGES) if self.ablation == "shallow" and nt == 1 else n

  def _any_stages(self, rows: int) -> int:
    """Pipeline stages of a `kbany` pass of ``rows`` rows: as many `any_stage_bytes` as fit the pipeline area, beside
    a one-row pass's p (`ANY_P_BYTES` per GEMM2 stage), at most `MAX_STAGES`."""
    p_bytes = self.v.intermediate // v1.K128 * ANY_P_BYTES if rows == 1 else 0
    return min(MAX_STAGES, (self.pipe_bytes - p_bytes) // any_stage_bytes(rows))

  def _expert_weights(self, e: Int32, pw: Int64, psc: Int64, n_rows: int, kb_n: int) -> tuple[Int64, Int64]:
    """Expert e's E2M1 tiles (``[E, K/128, N, 64 B]``) and scale words (``[E, K/128, N]``) in the weight tensor at
    ``pw`` / scales at ``psc`` of ``n_rows`` rows N and ``kb_n`` K128 tiles."""
    return (pw + Int64(e) * (kb_n * n_rows * v1.FP4_TILE_BYTES), psc + Int64(e) * (n_rows * kb_n * v1.WORD_BYTES))

  @cute.jit
  def _prefetch_tiles(self, pw_e: Int64, n_rows: cutlass.Constexpr, row0: Int32, kb0: cutlass.Constexpr,
                      kb1: cutlass.Constexpr):
    """One thread: bulk L2 prefetches of rows ``row0`` .. ``row0`` + `TILE_M` - 1 of K128 tiles ``kb0`` .. ``kb1`` - 1
    of an expert's E2M1 tiles at ``pw_e`` (`W_BYTES` each)."""
    for kb in cutlass.range_constexpr(kb0, kb1):
      _prefetch_l2(pw_e + (Int64(kb) * n_rows + row0) * v1.FP4_TILE_BYTES, W_BYTES)

  def _per_bar(self, nt: int, n_st: int, n_kb: int) -> int:
    """K128 stages per CTA barrier of a pass of ``nt`` n-tiles (`_cpasync_mainloop`): two in narrow passes
    (`PAIRED_BARRIER_NT`) where the stages pair up and the pipeline is deep enough, else one."""
    if self.ablation == "bar4" and nt == 1 and n_kb % 4 == 0 and n_st >= 8:
      return 4  # (timing: a barrier every four stages of the one-tile passes, 4 in flight while 4 compute)
    return 2 if self.paired_barrier and nt <= PAIRED_BARRIER_NT and n_kb % 2 == 0 and n_st >= 6 else 1

  def _per2(self, ctl: Int32) -> Int32:
    """GEMM2 items per expert hit in this call: `j2`, or in a `kpair` build twice as many items of 64 rows where
    `CTL_KPAIR` says so (read here each time: a register kept across the item loop costs more)."""
    if cutlass.const_expr(self.kpair):
      return cutlass.select_(_lds(ctl + CTL_KPAIR) != 0, Int32(2 * self.j2), Int32(self.j2))
    return Int32(self.j2)

  def _solo_ctas(self, tokens: Int32) -> Int32:
    """The combining CTAs where role 2 runs alone with ``tokens`` tokens: one per token and block of
    `v1.COMBINE_COLS` columns (at least one, which also advances the epoch)."""
    return cutlass.max(cutlass.min(cutlass.max(tokens, 0), self.v.capacity), 1) * abi.combine_blocks(self.v.hidden)

  @cute.jit
  def _solo_finalize(self, idb: Int64, yb: Int64, wsb: Int64, tokens: Int32, chunk: Int32, items_grid: Int32,
                     combining: Int32):
    """One of the ``combining`` CTAs where the graph holds role 2 alone (`abi.TOKENS_SOLO`), launched beyond the item
    grid: it starts when an item CTA leaves. Each counts itself in (all its threads read the epoch), waits (bounded at
    twice the timeout, through faults: the item CTAs run to their end either way) until the ``items_grid`` item CTAs
    counted themselves done, and combines y[t] over its block of `v1.COMBINE_COLS` columns (``chunk`` = t n + block,
    n = `abi.combine_blocks`; NaN after a fault, read after the wait). Each first does role 1's fault check (an id
    >= E; the record is written once, and each CTA knows its own finding, so none writes y before another has
    recorded the fault). Combining CTA 0 also zeroes the next call's counters, and last advances the epoch once every
    combining CTA is in (a second thread waits for them beside the first) and mirrors a fault to the host."""
    v = self.v
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    n_blk = abi.combine_blocks(v.hidden)
    n_tok = cutlass.min(cutlass.max(tokens, 0), v.capacity)
    epoch = v1._ld(wsb + abi.HEADER["epoch"])
    cur = epoch + 1
    done = self._counter(wsb, cur, abi.role2_done(v.experts, v.capacity, v.shared, v.ranks, v.relay))
    cute.arch.sync_threads()  # (every thread's epoch read before the count that lets CTA 0 advance it)
    if tid == 0:
      _red_release_add(done + v1.WORD_BYTES, 1)
    if cutlass.const_expr(self.timeline):
      if (chunk == 0) & (tid == 0):
        self._tl_stamp(wsb, cur, Int32(0))  # (role 1's words of the timeline: combining CTA 0's check)
    bad = Int32(0)
    for a in range(tid, n_tok * v.top_k, v1.THREADS):
      eid = v1._ld_nc(idb + Int64(a) * v1.WORD_BYTES)
      if eid >= v.experts:
        v1._record_fault(wsb, 1, bid, cur, eid, a)  # (as role 1 would: the first such id wins)
        bad = Int32(1)
    bad = _bar_or(bad)
    if chunk == 0:
      self._clear_next_counters(wsb, epoch)
      if cutlass.const_expr(self.timeline):
        if tid == 0:
          self._tl_stamp(wsb, cur, Int32(1))
    if tid == 0:
      self._wait_geq(done, items_grid, wsb, cur, bid, Int32(abi.WAIT_ROLE2), 3, "gpu", 2, False)
      if cutlass.const_expr(self.timeline):
        if chunk == 0:
          self._tl_stamp(wsb, cur, Int32(2))
    if (chunk == 0) & (tid == 32):
      self._wait_geq(done + v1.WORD_BYTES, combining, wsb, cur, bid, Int32(abi.WAIT_ROLE3), 3, "gpu", 2, False)
    cute.arch.sync_threads()
    fault = v1._ld(wsb + abi.HEADER["error_flag"]) | bad
    t = chunk // n_blk
    if t < n_tok:
      self._combine(t, chunk - t * n_blk, 1, wsb, idb, yb, fault)
    if chunk == 0:
      cute.arch.sync_threads()
      if tid == 0:
        if cutlass.const_expr(self.timeline):
          self._tl_stamp(wsb, cur, Int32(3))
          self._tl_put(wsb, cur, Int32(4), Int64(cur))
        v1._st(wsb + abi.HEADER["epoch"], cur)
        if fault != 0:
          v1._mirror_fault(wsb)

  @cute.jit
  def _tl_cta_put(self, wsb: Int64, cur: Int32, bid: Int32, word: Int32, value: Int64) -> None:
    """Timeline build: ``value`` into word ``word`` of this CTA's record (`abi.TL_CTA_WORDS`; CTAs past
    `abi.TL_CTAS` record nothing)."""
    if bid < abi.TL_CTAS:
      self._tl_put(wsb, cur, abi.TL_HEAD + bid * abi.TL_CTA_WORDS + word, value)

  @cute.jit
  def _tl_cta(self, wsb: Int64, cur: Int32, bid: Int32, word: Int32) -> None:
    """Timeline build: a stamp into word ``word`` of this CTA's record."""
    self._tl_cta_put(wsb, cur, bid, word, cute.arch.globaltimer())

  @cute.jit
  def _tl_item(self, wsb: Int64, cur: Int32, bid: Int32, ctl: Int32, item: Int32, phase: cutlass.Constexpr):
    """Timeline build, thread 0: the item's start (phase 0, also its MMAs' start), the start of its MMAs after a
    wait (1) or its end (2, which also counts it) in this CTA's next item record."""
    tid, _, _ = cute.arch.thread_idx()
    if tid == 0:
      n = _lds(ctl + CTL_TL)
      if n < abi.TL_ITEMS:
        rec = Int32(8) + 4 * n
        if cutlass.const_expr(phase == 0):
          self._tl_cta_put(wsb, cur, bid, rec, Int64(item))
          self._tl_cta(wsb, cur, bid, rec + 1)
          self._tl_cta(wsb, cur, bid, rec + 2)
        elif cutlass.const_expr(phase == 1):
          self._tl_cta(wsb, cur, bid, rec + 2)
        else:
          self._tl_cta(wsb, cur, bid, rec + 3)
      if cutlass.const_expr(phase == 2):
        _sts(ctl + CTL_TL, n + 1)

  @cute.jit
  def _fill_table(self, queue: Int64, wsb: Int64, table: Int32, n_hit: Int32):
    """The CTA fills its expert table from the closed queue: count[e] at 4 e, the experts hit in queue (publication)
    order from 4 E."""
    tid, _, _ = cute.arch.thread_idx()
    for h in range(tid, n_hit, THREADS):
      e = v1._ld(queue + Int64(2 + h) * v1.WORD_BYTES) - 1
      _sts(table + (self.v.experts + h) * 4, e)
      _sts(table + e * 4, v1._ld(wsb + self.ws.count + Int64(e) * v1.WORD_BYTES))

  @cute.jit
  def _route_ids(self, idb: Int64, n_assign: Int32, lane: Int32):
    """`trips`: the expert ids `_scan_routes` reads, assignments ``lane`` and ``lane`` + 32 (-1 past ``n_assign``)."""
    eid = Int32(-1)
    eid2 = Int32(-1)
    if lane < n_assign:
      eid = v1._ld_nc(idb + Int64(lane) * v1.WORD_BYTES)
    if cutlass.const_expr(self.scan_tokens * self.v.top_k > 32):
      if lane + 32 < n_assign:
        eid2 = v1._ld_nc(idb + Int64(lane + 32) * v1.WORD_BYTES)
    return eid, eid2

  @cute.jit
  def _scan_routes(self, idb: Int64, n_assign: Int32, ctl: Int32, route_ids=None):
    """The whole CTA, at T <= `scan_tokens` (one GPU): the expert table from the routes themselves, as role 1's
    closed queue would give it (count[e] at 4 e, the experts hit from 4 E, here in expert order; their number at
    ``ctl + 4``), and each expert's rows in assignment order (`scan_rows`, expert e's from ``scan_first[e]``), which
    `_chunk` reads instead of role 1's ``rows``. Lane a of every warp holds assignments a and a + 32 (n_assign <=
    64: `abi.scan_tokens`); ids < 0 (padding) and >= E match no expert (role 1, or where role 2 runs alone its
    combining CTAs, record those as faults). Which CTA runs which rows is all the order decides: the bits are the
    same. ``route_ids`` (`trips`): `_route_ids`, loaded before phase 0."""
    v = self.v
    tid, _, _ = cute.arch.thread_idx()
    warp = tid // 32
    lane = tid % 32
    table = ctl + self.table
    first = ctl + self.scan_first
    below = Int32(cute.arch.lanemask_lt())
    two = self.scan_tokens * v.top_k > 32  # (a second assignment per lane)
    if cutlass.const_expr(route_ids is None):
      # (the loads of `_route_ids` in place: a call of that jit function changed the normal build's code)
      eid = Int32(-1)
      eid2 = Int32(-1)
      if lane < n_assign:
        eid = v1._ld_nc(idb + Int64(lane) * v1.WORD_BYTES)
      if cutlass.const_expr(two):
        if lane + 32 < n_assign:
          eid2 = v1._ld_nc(idb + Int64(lane + 32) * v1.WORD_BYTES)
    else:
      eid, eid2 = route_ids
    for e in range(warp, v.experts, WARPS):
      count = v1._popc(v1._ballot(eid == e))
      if cutlass.const_expr(two):
        count = count + v1._popc(v1._ballot(eid2 == e))
      if lane == 0:
        _sts(table + e * 4, count)
    cute.arch.sync_threads()
    if warp == 0:
      # Experts in chunks of 32, a lane each: the hit list by ballot, the first rows by an inclusive scan.
      n_hit = Int32(0)
      n_rows = Int32(0)
      for c in cutlass.range_constexpr(0, v.experts, 32):
        e = c + lane
        count = Int32(0)
        if e < v.experts:
          count = _lds(table + e * 4)
        hit = v1._ballot(count > 0)
        upto = count
        for d in cutlass.range_constexpr(5):
          up = _shfl_idx(upto, cutlass.max(lane - (1 << d), 0))
          upto = upto + cutlass.select_(lane >= (1 << d), up, Int32(0))
        if e < v.experts:
          _sts(first + e * 4, n_rows + upto - count)
        if count > 0:
          _sts(table + (v.experts + n_hit + v1._popc(hit & below)) * 4, e)
        n_hit = n_hit + v1._popc(hit)
        n_rows = n_rows + _shfl_idx(upto, 31)
      if lane == 0:
        _sts(ctl + 4, n_hit)
    cute.arch.sync_threads()
    for e in range(warp, v.experts, WARPS):
      hits = v1._ballot(eid == e)
      if eid == e:
        _sts(ctl + self.scan_rows + (_lds(first + e * 4) + v1._popc(hits & below)) * 4, lane)
      if cutlass.const_expr(two):  # assignments 32.. after 0..31: the rows stay in assignment order
        hits2 = v1._ballot(eid2 == e)
        if eid2 == e:
          _sts(ctl + self.scan_rows + (_lds(first + e * 4) + v1._popc(hits) + v1._popc(hits2 & below)) * 4,
               lane + 32)

  @cute.jit
  def _item_bounds(self, n_hit: Int32, n_s1: Int32, n_s2: Int32, ok: Int32):
    """The queue's item ranges with ``n_hit`` experts hit (`abi.item_order`): (routed GEMM1 items, routed GEMM2
    items, all items, where routed GEMM1, routed GEMM2, shared GEMM1 and shared GEMM2 start)."""
    n1 = n_hit * self.j1
    n2 = n_hit * (0 if cutlass.const_expr(self.ablation == "nogemm2") else self.j2)
    n_items = cutlass.select_(ok != 0, n1 + n2 + n_s1 + n_s2, Int32(0))
    at, sizes = {}, {"routed GEMM1": n1, "routed GEMM2": n2, "shared GEMM1": n_s1, "shared GEMM2": n_s2}
    end = Int32(0)
    for kind in self.item_order:
      at[kind] = end
      end = end + sizes[kind]
    return (n1, n2, n_items, *(at[kind] for kind in sizes))

  @cute.jit
  def _claim_streaming(self, counters: Int64, ctl: Int32, queue: Int64, table: Int32, wsb: Int64, cur: Int32,
                       bid: Int32, n_s1: Int32):
    """`_claim` for role 2 of the fused transport, which does not wait for role 1 to close its active queue: (the
    item, the experts hit it may be decoded with). A routed GEMM1 item of the h-th expert published runs as soon as
    queue entry h is filled (thread 0 puts the expert and its count into the table), with h + 1 experts hit; the
    items that depend on the queue's size (routed GEMM2 items, and what follows the routed GEMM1 items) wait until
    it is closed, and the first claim that sees it closed has the CTA fill the whole table. An expired wait is
    recorded as `_await_queue` records it, and the CTA stops (an item past every count)."""
    v = self.v
    tid, _, _ = cute.arch.thread_idx()
    if tid == 0:
      item = _atom_add(counters + self.queue * v1.WORD_BYTES, 1)
      known = _lds(ctl + 4)
      hits = known
      fill = Int32(0)
      if known < 0:
        r1_at = Int32(0)
        if cutlass.const_expr(self.item_order.index("routed GEMM1") > 0):
          assert self.item_order[0] == "shared GEMM1"
          r1_at = n_s1
        hits = Int32(0)
        if (item >= r1_at) & (_lds(ctl) != 0):
          h = (item - r1_at) // self.j1
          entry_at = queue + Int64(2 + cutlass.min(h, v.experts - 1)) * v1.WORD_BYTES
          flag = v1._gptr(wsb + abi.HEADER["error_flag"])
          timeout = v1._ld(wsb + abi.HEADER["timeout_ns"], cutlass.Uint64)
          start = cute.arch.globaltimer()
          size = cute.arch.load(v1._gptr(queue + v1.WORD_BYTES), Int32, sem="acquire", scope="gpu")
          entry = cute.arch.load(v1._gptr(entry_at), Int32, sem="acquire", scope="gpu")
          entry = cutlass.select_(h < v.experts, entry, Int32(0))
          fault = cute.arch.load(flag, Int32, sem="relaxed", scope="gpu")
          elapsed = cutlass.Uint64(0)
          while (size == 0) & (entry == 0) & (fault == 0) & (elapsed <= timeout):
            cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(v1.SPIN_SLEEP_NS)])
            size = cute.arch.load(v1._gptr(queue + v1.WORD_BYTES), Int32, sem="acquire", scope="gpu")
            entry = cute.arch.load(v1._gptr(entry_at), Int32, sem="acquire", scope="gpu")
            entry = cutlass.select_(h < v.experts, entry, Int32(0))
            fault = cute.arch.load(flag, Int32, sem="relaxed", scope="gpu")
            elapsed = cutlass.Uint64(cute.arch.globaltimer() - start)
          cute.arch.fence_acq_rel_gpu()  # the CTA reads count[e], rows[e] and the received rows after its barrier
          if size > 0:
            hits = size - 1
            fill = Int32(1)
            _sts(ctl + 4, hits)
          elif entry > 0:
            e = entry - 1
            _sts(table + (v.experts + h) * 4, e)
            _sts(table + e * 4, v1._ld(wsb + self.ws.count + Int64(e) * v1.WORD_BYTES))
            hits = h + 1
          else:
            if fault == 0:
              self._queue_fault(queue, wsb, cur, bid)
            item = Int32(abi.ITEM_NONE)
      _sts(ctl + CTL_CLAIM, item)
      _sts(ctl + CTL_HITS, hits)
      _sts(ctl + CTL_FILL, fill)
    cute.arch.sync_threads()
    item = _lds(ctl + CTL_CLAIM)
    hits = _lds(ctl + CTL_HITS)
    fill = _lds(ctl + CTL_FILL)
    cute.arch.sync_threads()  # every thread read them before the next claim overwrites them
    if fill != 0:
      self._fill_table(queue, wsb, table, hits)
      cute.arch.sync_threads()
    return item, hits

  @cute.jit
  def _claim(self, counters: Int64, ctl: Int32) -> Int32:
    """The next item of this CTA from the call's queue (every thread gets it; the item count or more: none left).

    Claims are handed out in item order, and every item waits only for earlier ones (GEMM2 tiles for their
    expert's GEMM1 tiles, the shared expert's GEMM2 blocks for its GEMM1 blocks), which CTAs that are running hold:
    with the whole grid resident, the queue cannot deadlock."""
    tid, _, _ = cute.arch.thread_idx()
    if tid == 0:
      _sts(ctl + CTL_CLAIM, _atom_add(counters + self.queue * v1.WORD_BYTES, 1))
    cute.arch.sync_threads()
    item = _lds(ctl + CTL_CLAIM)
    cute.arch.sync_threads()  # every thread read it before the next claim overwrites it
    return item

  @cute.jit
  def _store_digits(self, n: Int32, e: Int32, bad: Int32, lane: Int32, planes: Int64, exp: Int64):
    """One K32 block of a shared-expert operand, a lane per element (``n`` = 512 v): the digits H1, H0, L1, L0 of
    its hi and lo parts (`roles_v1._split`) in planes 0-3 at ``planes`` + 32 p + lane, its exponent word
    (`abi.SHARED_NAN_EXP` for a NaN block) at ``exp`` (`abi.Workspace.sxp`)."""
    h, lw = v1._split(n)
    h0, h1 = _sign_digits(h, 2)
    l0, l1 = _sign_digits(lw, 2)
    for p, d in enumerate((h1, h0, l1, l0)):
      _st_u8(planes + Int64(32 * p) + Int64(lane), d)
    if lane == 0:
      v1._st(exp, cutlass.select_(bad != 0, Int32(abi.SHARED_NAN_EXP), e))

  @cute.jit
  def _shared_gemm1(self, tg: Int32, cb: Int32, half: Int32, n_tok: Int32, s13: Int64, s13s: Int64, wsb: Int64,
                    cur: Int32, c_bits: Int32, sb: Int32, counter: Int64):
    """Shared expert GEMM1, token group tg, activation columns 32 cb..: W13 rows 64 cb.. (gate and up of those
    columns, `formats` interleave) against the group's x (`_shared_core`), SwiGLU, then the K32 block cb of each
    token's requantized output to ``sap``/``sae`` (a warp per token), and the group's counter += 1 (release).

    A group of one or two tokens (`abi.HALVES_TOKENS`: every group at B = 1 and 2, the tails of one or two tokens)
    takes the block in two items, ``half`` 0 and 1, of 32 W13 rows (16 columns) each: twice the CTAs on the
    critical path of a B = 1 or 2 layer, whose shared GEMM1 items are the longest (docs/kernels_v2.md "One-token
    halves"). The MXFP8 block needs the amax of all 32 columns, so each half stores its tokens' 16 BF16 outputs
    into the block's exchange (`abi.Workspace.shx`) and swaps the call's tag into it (acq_rel); the half that finds
    the tag there already requantizes the block from both (warp 0, each token in turn) and counts it done: the same
    values and the same arithmetic, so the same bits."""
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    sh = self.sh
    t0 = tg * sh.tokens
    nt = cutlass.min(n_tok - t0, Int32(sh.tokens))
    col = tid % 32
    if nt <= abi.HALVES_TOKENS:
      rows = SH_ROWS // 2
      self._shared_core(abi.HALVES_TOKENS, nt, t0, s13, s13s, 2 * v.shared_intermediate, v.hidden,
                        cb * SH_ROWS + half * rows, wsb + ws.sxp, wsb + ws.sxe, sb, rows)
      xch = wsb + ws.shx + Int64(cb) * abi.SHX_BYTES
      gate = v1._gate_row(col % (rows // 2))  # lane l < 16 holds column 16 half + l (lanes 16-31 the same ones)
      # Warp 0 takes both tokens in turn (the token a constant: a warp per token cost ptxas 28 B more spills).
      a0 = Int32(0)
      a1 = Int32(0)
      if tid < 32:
        a0 = self._half_swiglu(0, gate, half, col, xch, sb, wsb, c_bits)
        if nt > 1:
          a1 = self._half_swiglu(1, gate, half, col, xch, sb, wsb, c_bits)
      cute.arch.sync_threads()
      old = Int32(0)
      if tid == 0:
        cute.arch.fence_acq_rel_gpu()  # the warp's stores, ordered by the barrier, before the tag
        old = _atom_exch_acq_rel(xch, cur)
      if _bar_or((tid == 0) & (old == cur)) != 0:  # the second half: the other's values are in
        if tid < 32:
          self._half_requantize(0, a0, half, xch, t0, cb, col, wsb, cur)
          if nt > 1:
            self._half_requantize(1, a1, half, xch, t0, cb, col, wsb, cur)
        self._count_done(counter)
    else:
      self._shared_dispatch(nt, t0, s13, s13s, 2 * v.shared_intermediate, v.hidden, cb * SH_ROWS,
                            wsb + ws.sxp, wsb + ws.sxe, sb,
                            (wsb + ws.xbf, wsb + ws.xflag, cur) if self.sh_bf16 else None)
      gate = v1._gate_row(col)
      for j in cutlass.range_constexpr(sh.tokens // WARPS):
        tok = tid // 32 + j * WARPS
        if tok < nt:  # warp-uniform: a warp per token, a lane per column
          hg = _lds(sb + sh.acc + (tok * SH_ROWS + gate) * 4)
          hu = _lds(sb + sh.acc + (tok * SH_ROWS + gate + v1.GATE_UP_GROUP) * 4)
          self._requantize(self._swiglu_bits(hg, hu, Int32(v1.F32_ONE), wsb, c_bits), t0, tok, cb, col, wsb, cur)
      self._count_done(counter)

  @cute.jit
  def _half_swiglu(self, tok: cutlass.Constexpr, gate: Int32, half: Int32, col: Int32, xch: Int64, sb: Int32,
                   wsb: Int64, c_bits: Int32) -> Int32:
    """A warp, after a shared GEMM1 half (`_shared_gemm1`): the BF16 SwiGLU output of token ``tok``'s column
    16 half + l in lane l (and l - 16), which lanes l < 16 store into the block's exchange ``xch``."""
    hg = _lds(sb + self.sh.acc + (tok * SH_ROWS + gate) * 4)
    hu = _lds(sb + self.sh.acc + (tok * SH_ROWS + gate + v1.GATE_UP_GROUP) * 4)
    a = self._swiglu_bits(hg, hu, Int32(v1.F32_ONE), wsb, c_bits)
    values = xch + abi.SHX_VALUES + tok * abi.SHX_TOKEN_BYTES
    if col < v1.K32 // 2:
      v1._st_bf16(values + (half * (v1.K32 // 2) + col) * v1.BF16_BYTES, a)
    return a

  @cute.jit
  def _half_requantize(self, tok: cutlass.Constexpr, a: Int32, half: Int32, xch: Int64, t0: Int32, cb: Int32,
                       col: Int32, wsb: Int64, cur: Int32):
    """A warp, in the second half of a block to arrive: token ``tok``'s block from its own outputs ``a`` and the
    other half's in the exchange, requantized (`_requantize`)."""
    word = _ld_cg(xch + abi.SHX_VALUES + tok * abi.SHX_TOKEN_BYTES + (col // 2) * 4)
    other = (word >> (v1.BF16_SHIFT * (col % 2))) & v1.BF16_MASK
    self._requantize(cutlass.select_(col // (v1.K32 // 2) == half, a, other), t0, tok, cb, col, wsb, cur)

  def _shared_groups(self, n_tok: Int32):
    """(token groups, shared items per column block) of a call of ``n_tok`` tokens: a last group of one or two
    tokens (`abi.HALVES_TOKENS`) takes two items per column block (halves of 32 weight rows, `_shared_gemm1`,
    `_shared_gemm2`), the others one; per column block the groups' items come first, then the last group's second
    half."""
    n_tg = (n_tok + self.sh.tokens - 1) // self.sh.tokens
    return n_tg, n_tg + cutlass.select_(n_tok - (n_tg - 1) * self.sh.tokens <= abi.HALVES_TOKENS, Int32(1),
                                        Int32(0))

  @cute.jit
  def _requantize(self, bits: Int32, t0: Int32, tok: Int32, cb: Int32, lane: Int32, wsb: Int64, cur: Int32):
    """A warp, a lane per column: MXFP8 of token t0 + tok's K32 block cb of the shared SwiGLU output (BF16 ``bits``)
    into ``sap``/``sae`` (`_store_digits`), and (`sh_bf16`) its BF16 plane into ``sabf``, the token's ``saflag``
    tagged with ``cur`` where the block is NaN or its exponent leaves `abi.FAST_EXP` (phase 0's rule for x)."""
    ws = self.ws
    n, e, bad = self._mx_lane(bits << v1.BF16_SHIFT)
    blk = Int64(t0 + tok) * self.n_cb + cb
    self._store_digits(n, e, bad, lane, wsb + ws.sap + blk * SH_BLOCK, wsb + ws.sae + blk * 4)
    if cutlass.const_expr(self.sh_bf16):
      _store_bf16_plane(n, e, bad, lane, wsb + ws.sabf + blk * BF16_PLANE_BYTES)
      if lane == 0:
        _, slow = _exp_word(e + v1.FP4_DOT_SHIFT, bad != 0)
        if slow:
          v1._st(wsb + ws.saflag + Int64(t0 + tok) * 4, cur)

  @cute.jit
  def _count_done(self, base: Int64, word: Int32 = 0):
    """After the CTA's stores: thread 0 adds 1 to the counter ``word`` words past ``base`` (fence, then a release
    add)."""
    tid, _, _ = cute.arch.thread_idx()
    cute.arch.sync_threads()
    if tid == 0:
      cute.arch.fence_acq_rel_gpu()
      _red_release_add(base + Int64(word) * v1.WORD_BYTES, 1)

  @cute.jit
  def _shared_gemm2(self, tg: Int32, hb: Int32, half: Int32, n_tok: Int32, s2: Int64, s2s: Int64, wsb: Int64,
                    cur: Int32, bid: Int32, sb: Int32, counter: Int64) -> Int32:
    """Shared expert GEMM2, token group tg, output columns 64 hb..: after the group's GEMM1 items (bounded wait),
    W2 rows 64 hb.. against its requantized activations, bf16 into ``shared_out``. Returns 1 when the wait failed.
    A group of one or two tokens takes the 64 columns in two items of 32 (``half``), like its GEMM1
    (`_shared_gemm1`): its output columns need no exchange."""
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    sh = self.sh
    t0 = tg * sh.tokens
    nt = cutlass.min(n_tok - t0, Int32(sh.tokens))
    ok = Int32(1)
    if tid == 0:
      ok = self._wait_geq(counter, Int32(self.n_cb), wsb, cur, bid, abi.WAIT_SHARED + t0)
    failed = Int32(0)
    if _bar_or(ok == 0) != 0:
      failed = Int32(1)
    elif nt <= abi.HALVES_TOKENS:
      rows = SH_ROWS // 2
      col0 = hb * SH_ROWS + half * rows
      self._shared_core(abi.HALVES_TOKENS, nt, t0, s2, s2s, v.hidden, v.shared_intermediate, col0, wsb + ws.sap,
                        wsb + ws.sae, sb, rows)
      tok = tid // rows
      row = tid % rows
      if tok < nt:
        out = wsb + ws.shared_out + (Int64(t0 + tok) * v.hidden + col0 + row) * v1.BF16_BYTES
        v1._st_bf16(out, v1._bf16_rne(_lds(sb + sh.acc + (tok * SH_ROWS + row) * 4)))
      cute.arch.sync_threads()  # the accumulators are zeroed by the next item
    else:
      self._shared_dispatch(nt, t0, s2, s2s, v.hidden, v.shared_intermediate, hb * SH_ROWS,
                            wsb + ws.sap, wsb + ws.sae, sb,
                            (wsb + ws.sabf, wsb + ws.saflag, cur) if self.sh_bf16 else None)
      row = tid % SH_ROWS
      for j in cutlass.range_constexpr(sh.tokens * SH_ROWS // THREADS):
        tok = tid // SH_ROWS + j * (THREADS // SH_ROWS)
        if tok < nt:
          acc = _lds(sb + sh.acc + (tok * SH_ROWS + row) * 4)
          out = wsb + ws.shared_out + (Int64(t0 + tok) * v.hidden + hb * SH_ROWS + row) * v1.BF16_BYTES
          v1._st_bf16(out, v1._bf16_rne(acc))
      cute.arch.sync_threads()  # the accumulators are zeroed by the next item
    return failed

  @cute.jit
  def _shared_dispatch(self, nt: Int32, t0: Int32, pw: Int64, psc: Int64, n: cutlass.Constexpr,
                       k: cutlass.Constexpr, row0: Int32, ap: Int64, ae: Int64, sb: Int32, bf=None):
    """`_shared_core` of 64 rows for a group of more than two tokens: one n-tile of tokens (`SH_TOKENS`), or, in the
    variants of wide groups, up to two. (A group of one or two tokens takes its items in halves of 32 rows.)"""
    if cutlass.const_expr(self.sh.tokens > SH_TOKENS):
      if nt > SH_TOKENS:
        self._shared_core(self.sh.tokens, nt, t0, pw, psc, n, k, row0, ap, ae, sb, bf=bf)
      else:
        self._shared_core(SH_TOKENS, nt, t0, pw, psc, n, k, row0, ap, ae, sb, bf=bf)
    else:
      self._shared_core(SH_TOKENS, nt, t0, pw, psc, n, k, row0, ap, ae, sb, bf=bf)

  @cute.jit
  def _shared_core(self, tbc: cutlass.Constexpr, nt: Int32, t0: Int32, pw: Int64, psc: Int64, n: cutlass.Constexpr,
                   k: cutlass.Constexpr, row0: Int32, ap: Int64, ae: Int64, sb: Int32,
                   rows: cutlass.Constexpr = SH_ROWS, bf=None):
    """``acc[t][r] = sum over K32 blocks b in order of p(t, r, b)`` (the FP8 x FP8 block dots of the `reference`
    module doc) for the group's tokens t < tbc (those past ``nt`` read zeros) and weight rows row0 + r, r < rows,
    into SMEM (``self.sh.acc``).

    MXFP8 weights ``pw`` [K/128, n, 128] (E4M3) with scales ``psc`` [n, ceil(K / (4 group))]; activations as the
    digit planes at ``ap`` and exponent words at ``ae`` (`abi.Workspace.sxp`). Each step of `SH_STEP` K32 blocks
    (twice that for the 32 rows of a half, `_sh_tiles_per_step`; a token's SMEM slots then run on over the next
    token's, `_sh_slots`): the next step's weights and activations are copied (cp.async) while this one's block
    dots run on the tensor cores (`_sh_compute`, one n-tile per 8 tokens of ``tbc``), the blocks' p to SMEM; then a
    thread per (token, row) adds the step's p in increasing K (the order the semantics fix, which the split of K
    across warps would otherwise break).

    ``bf`` (`sh_bf16`; groups of 8 or 16 tokens): (the operand's BF16 planes, its per-token flags, the call's tag).
    Where no token of the group is flagged, the steps copy the BF16 planes instead of the digit planes and run
    `_sh_compute_bf16`; otherwise the digit MMAs, as without ``bf``."""
    tid, _, _ = cute.arch.thread_idx()
    k_tiles = k // v1.K128
    n_steps = -(-k_tiles // _sh_tiles_per_step(rows))
    fast = Int32(0)
    if cutlass.const_expr(bf is not None):
      slow = Int32(0)
      if tid < nt:
        slow = cutlass.select_(_ld_gpu(bf[1] + Int64(t0 + tid) * 4) == bf[2], Int32(1), Int32(0))
      fast = 1 - _bar_or(slow)
    for i in range(tid, self.sh.tokens * SH_ROWS, THREADS):
      _sts(sb + self.sh.acc + i * 4, Int32(0))
    # The decode table, read after the first step's barrier: 256 threads, 256 codes; a code's copies rotated by the
    # thread, so that a warp's stores hit 32 banks.
    entry = _digit_entry(tid)
    if cutlass.const_expr(self.sh.lane_tab):
      for q in cutlass.range_constexpr(32):
        _sts(sb + self.sh.tab + tid * 128 + ((tid + q) % 32) * 4, entry)
    else:
      _sts(sb + SH_TAB + tid * 4, entry)
    self._sh_issue(tbc, Int32(0), Int32(0), nt, t0, pw, psc, n, k, row0, ap, ae, sb, rows, fast, bf)
    _commit()
    for s in range(n_steps):
      buf = s & 1
      if s > 0:
        self._sh_accumulate(tbc, s - 1, k, sb, rows)
      if s + 1 < n_steps:
        self._sh_issue(tbc, s + 1, buf ^ 1, nt, t0, pw, psc, n, k, row0, ap, ae, sb, rows, fast, bf)
      _commit()
      _wait_group(1)  # this thread's copies of step s have landed
      if cutlass.const_expr(bf is not None):
        _fence_async_smem()  # the copies wrote through the generic proxy; wgmma reads through the async one
      cute.arch.sync_threads()
      if cutlass.const_expr(bf is None):
        self._sh_compute(tbc, s, buf, k, sb, rows)
      else:
        if fast != 0:
          self._sh_compute_bf16(tbc, s, buf, k, sb)
        else:
          self._sh_compute(tbc, s, buf, k, sb, rows)
      cute.arch.sync_threads()
    self._sh_accumulate(tbc, Int32(n_steps - 1), k, sb, rows)
    cute.arch.sync_threads()

  @cute.jit
  def _sh_issue(self, tbc: cutlass.Constexpr, s: Int32, buf: Int32, nt: Int32, t0: Int32, pw: Int64, psc: Int64,
                n: cutlass.Constexpr, k: cutlass.Constexpr, row0: Int32, ap: Int64, ae: Int64, sb: Int32,
                rows: cutlass.Constexpr = SH_ROWS, fast=None, bf=None):
    """cp.async of step s into buffer buf: the two K128 tiles of the item's 64 weight rows and their scale words,
    the tbc tokens' digit planes, and the exponent words of the n-tiles' tokens (zeros past ``nt`` and past K, so
    the unused columns of the MMA keep every block exponent in range); where ``fast`` (`_shared_core`'s ``bf``),
    the tokens' BF16 planes instead (`_sh_issue_bf16`)."""
    tid, _, _ = cute.arch.thread_idx()
    group = self.v.shared_group
    k_tiles = k // v1.K128
    nblk = k // v1.K32
    scale_words = -(-k // (v1.SCALES_PER_WORD * group))
    chunks = v1.K128 // 16  # per weight row and K128 tile
    tps = _sh_tiles_per_step(rows)
    bps = 4 * tps  # K32 blocks per step
    for i in cutlass.range_constexpr(tps * rows * chunks // THREADS):
      q = tid + THREADS * i
      ts = q // (rows * chunks)
      r = (q // chunks) % rows
      c = q % chunks
      kt = tps * s + ts
      if kt < k_tiles:
        src = pw + (Int64(kt) * n + row0 + r) * v1.FP8_TILE_BYTES + c * 16
        dst = sb + SH_W + ((buf * tps + ts) * rows + r) * v1.K128 + 16 * (c ^ ((r % 4) << 1))
        _cp16(dst, src, Int32(16))
    if tid < tps * rows:
      ts = tid // rows
      r = tid % rows
      kt = tps * s + ts
      if kt < k_tiles:
        word = kt if group == v1.K32 else kt // 4
        _cp4(sb + SH_S + ((buf * tps + ts) * rows + r) * 4, psc + (Int64(row0 + r) * scale_words + word) * 4)
    if cutlass.const_expr(bf is None):
      self._sh_issue_digits(tbc, s, buf, nt, t0, nblk, bps, rows, ap, ae, sb)
    else:
      if fast != 0:
        self._sh_issue_bf16(tbc, s, buf, nt, t0, nblk, bps, bf[0], sb)
      else:
        self._sh_issue_digits(tbc, s, buf, nt, t0, nblk, bps, rows, ap, ae, sb)

  @cute.jit
  def _sh_issue_digits(self, tbc: cutlass.Constexpr, s: Int32, buf: Int32, nt: Int32, t0: Int32,
                       nblk: cutlass.Constexpr, bps: cutlass.Constexpr, rows: cutlass.Constexpr, ap: Int64, ae: Int64,
                       sb: Int32):
    """`_sh_issue`'s B side on the digit MMAs: the tokens' digit planes and exponent words of step s."""
    tid, _, _ = cute.arch.thread_idx()
    slots = _sh_slots(rows)
    per_tok = bps * SH_BLOCK // 16  # 16 B chunks per token and step
    # The exponents of the n-tiles' tokens (zeros past nt); a half's tokens run on over the slots of the next ones.
    ex_tok = tbc if tbc == abi.HALVES_TOKENS else _sh_ntiles(tbc) * SH_TOKENS
    if cutlass.const_expr(tbc == abi.HALVES_TOKENS):
      # A thread per 16 B chunk copies it for both tokens (the token a constant), the first few an exponent chunk:
      # a copy loop over (token, chunk) cost ptxas 44 B more spills at the two-CTA register cap.
      assert tbc * per_tok == THREADS
      if tid < per_tok:
        for t in cutlass.range_constexpr(tbc):
          self._sh_issue_x(Int32(t), tid, s, buf, nt, t0, nblk, bps, slots, ap, sb)
      if tid < ex_tok * (bps // 4):
        self._sh_issue_e(tid // (bps // 4), tid % (bps // 4), s, buf, nt, t0, nblk, bps, slots, ae, sb)
    else:
      for q in range(tid, tbc * per_tok, THREADS):
        self._sh_issue_x(q // per_tok, q % per_tok, s, buf, nt, t0, nblk, bps, slots, ap, sb)
      for q in range(tid, ex_tok * (bps // 4), THREADS):
        self._sh_issue_e(q // (bps // 4), q % (bps // 4), s, buf, nt, t0, nblk, bps, slots, ae, sb)

  @cute.jit
  def _sh_issue_bf16(self, tbc: cutlass.Constexpr, s: Int32, buf: Int32, nt: Int32, t0: Int32,
                     nblk: cutlass.Constexpr, bps: cutlass.Constexpr, bfp: Int64, sb: Int32):
    """`_sh_issue`'s B side on BF16 wgmma: step s's K32 blocks of the tokens' BF16 planes (``bfp``, `abi.Workspace`
    ``xbf`` or ``sabf``), 16-B chunk (block b, k8 group c) of token t into wgmma's core matrix (c, t // 8), row t %
    8 of block b's area (`bf16_b_chunk`), in the buffer's digit-plane room; zeros past ``nt`` and past K.
    Consecutive threads take a token's consecutive 512 B."""
    tid, _, _ = cute.arch.thread_idx()
    ntl = _sh_ntiles(tbc)
    per_tok = bps * BF16_PLANE_BYTES // 16
    base = sb + SH_X + buf * (self.sh.tokens * SH_X_STRIDE)
    assert (tbc * per_tok) % THREADS == 0 and bps * ntl * BF16_B_BLOCK_BYTES <= self.sh.tokens * SH_X_STRIDE
    for i in cutlass.range_constexpr(tbc * per_tok // THREADS):
      q = tid + THREADS * i
      tok = q // per_tok
      c = q % per_tok
      ok = (tok < nt) & (s * bps + c // 4 < nblk)
      src = bfp + cutlass.select_(ok, (Int64(t0 + tok) * nblk + s * bps) * BF16_PLANE_BYTES + c * 16, Int64(0))
      _cp16(base + bf16_b_chunk(tok, c, ntl), src, cutlass.select_(ok, Int32(16), Int32(0)))

  @cute.jit
  def _sh_issue_x(self, tok: Int32, c: Int32, s: Int32, buf: Int32, nt: Int32, t0: Int32, nblk: cutlass.Constexpr,
                  bps: cutlass.Constexpr, slots: cutlass.Constexpr, ap: Int64, sb: Int32):
    """cp.async of 16 B chunk c of token tok's digit planes of step s (zeros past ``nt`` and past K)."""
    blk = s * bps + c // (SH_BLOCK // 16)
    ok = (tok < nt) & (blk < nblk)
    src = ap + cutlass.select_(ok, (Int64(t0 + tok) * nblk + s * bps) * SH_BLOCK + c * 16, Int64(0))
    _cp16(sb + SH_X + (buf * self.sh.tokens + slots * tok) * SH_X_STRIDE + 16 * c, src,
          cutlass.select_(ok, Int32(16), Int32(0)))

  @cute.jit
  def _sh_issue_e(self, tok: Int32, c: Int32, s: Int32, buf: Int32, nt: Int32, t0: Int32, nblk: cutlass.Constexpr,
                  bps: cutlass.Constexpr, slots: cutlass.Constexpr, ae: Int64, sb: Int32):
    """cp.async of exponent chunk c (4 words) of token tok's step s (zeros past ``nt`` and past K)."""
    blk = s * bps + 4 * c
    ok = (tok < nt) & (blk < nblk)
    src = ae + cutlass.select_(ok, (Int64(t0 + tok) * nblk + blk) * 4, Int64(0))
    _cp16(sb + self.sh.xe + ((buf * self.sh.tokens + slots * tok) * SH_STEP + 4 * c) * 4, src,
          cutlass.select_(ok, Int32(16), Int32(0)))

  @cute.jit
  def _sh_compute(self, tbc: cutlass.Constexpr, s: Int32, buf: Int32, k: cutlass.Constexpr, sb: Int32,
                  rows: cutlass.Constexpr = SH_ROWS):
    """Step s's block dots on the tensor cores: warp w, the m16 tile w & 3 of the item's rows (A: the weights) x the
    group's ``tbc`` tokens (B), K128 tile 2 s + (w >> 2), its four K32 blocks; p(t, r, b) to ``self.sh.p``. The
    weights are decoded once per block for every token.

    A weight byte and an activation are each hi + lo with hi = 64 H1 + H0 and lo = 64 L1 + L0 (signed 6-bit
    digits; one of hi, lo is 0), and F = hi + lo has the digits F1 = H1 | L1, F0 = H0 | L0 (`_sh_block_a`). A
    block's three split dots are Shh, Sll and Shl + Slh = Sff - Shh - Sll, each from exact int8 MMAs over the
    digits: `_sh_tiles` for groups of n-tiles of 8 tokens, `_sh_two_rows` for the halves of a group of one or two
    tokens (the B = 1 and 2 layers, the tails of one or two tokens), which puts the tokens' digit planes in the
    columns of two n-tiles. Then the
    semantics' p and its scaling (`roles_v1._fp8_block_p`; one multiplication where every block exponent of the
    warp's block lies within `SH_FAST_EXP`). The K order of the MMA is permuted the same way for A and B (thread t4
    holds the bytes 8 t4 .. 8 t4 + 7 of a block, in one 8-byte load), which leaves every integer sum as it is."""
    warp, lane, g, t4 = _lanes()
    tab = sb + self.sh.tab + (lane * 4 if self.sh.lane_tab else 0)
    tps = _sh_tiles_per_step(rows)
    mt = warp % (rows // 16)
    ts = warp // (rows // 16)
    kt = tps * s + ts
    if kt < k // v1.K128:
      tile = sb + SH_W + ((buf * tps + ts) * rows + 16 * mt + g) * v1.K128 + 8 * t4
      srow = sb + SH_S + ((buf * tps + ts) * rows + 16 * mt + g) * 4
      sw = (_lds(srow), _lds(srow + 8 * 4))
      for j in cutlass.range_constexpr(4):  # the four K32 blocks of the warp's K128 tile
        lb = 4 * ts + j
        a = _sh_block_a(tile, j, g, tab, self.ablation != "shnodecode", self.sh.lane_tab)
        if cutlass.const_expr(self.v.shared_group == v1.K32):
          ew = tuple(((w >> (8 * j)) & v1.BYTE_MASK) - v1.UE8M0_BIAS for w in sw)
        else:
          ew = tuple(((w >> (8 * (kt % 4))) & v1.BYTE_MASK) - v1.UE8M0_BIAS for w in sw)
        if cutlass.const_expr(tbc == abi.HALVES_TOKENS):
          self._sh_two_rows(a, ew, buf, lb, mt, sb)
        else:
          self._sh_tiles(_sh_ntiles(tbc), a, ew, buf, lb, mt, sb)

  @cute.jit
  def _sh_compute_bf16(self, tbc: cutlass.Constexpr, s: Int32, buf: Int32, k: cutlass.Constexpr, sb: Int32):
    """`_sh_compute` on BF16 wgmma for a group of 8 or 16 tokens none of which is flagged (`_shared_core`):
    warpgroup ts (warps 4 ts .. 4 ts + 3, the m16 tiles of the item's 64 rows) takes K128 tile 2 s + ts; per K32
    block, the rows' E4M3 weights decoded to BF16 (`_e4m3_bf16`: lane t4's words of `bf16fold.shared_lane_words`,
    times 2**0: the weight scale is applied to the sum) and two wgmma m64n(8|16)k16 from zero over the tokens' BF16
    planes (``q 2**ex``, `_sh_issue_bf16`) give D = the block's dot times 2**ex, its products exact in FP32 (every
    block exponent of an unflagged token lies in `abi.FAST_EXP`); p = D 2**ew (`_sh_store`: one multiplication
    where |ew| <= `SH_FAST_EXP`, else the semantics' two). Not bit-exact with the digit MMAs (the tensor cores sum
    D in FP32, the semantics round three split dots), within the numerics bar (docs/kernels_v2.md "Session 61")."""
    warp, _, g, t4 = _lanes()
    sh = self.sh
    ntl = _sh_ntiles(tbc)
    tps = _sh_tiles_per_step(SH_ROWS)
    mt = warp % (SH_ROWS // 16)
    ts = warp // (SH_ROWS // 16)
    kt = tps * s + ts
    if kt < k // v1.K128:
      tile = sb + SH_W + ((buf * tps + ts) * SH_ROWS + 16 * mt + g) * v1.K128 + 8 * t4
      srow = sb + SH_S + ((buf * tps + ts) * SH_ROWS + 16 * mt + g) * 4
      sw = (_lds(srow), _lds(srow + 8 * 4))
      base = sb + SH_X + buf * (sh.tokens * SH_X_STRIDE)
      lbo = ntl * 128  # between k8 groups; n8 groups 128 apart
      one = Int32(bf16fold.fold_scale_e4m3(0))
      sums = [None, None]
      for j in cutlass.range_constexpr(4):  # the four K32 blocks of the warpgroup's K128 tile
        wa = tile + 32 * (Int32(j) ^ (g % 4))  # chunk pair j of rows g, g + 8 (`_sh_issue`'s swizzle)
        words = (_lds2(wa), _lds2(wa + 8 * v1.K128))
        a = [_e4m3_bf16(words[h][0], words[h][1], r, one) for r in range(4) for h in range(2)]
        blk = base + (4 * ts + j) * (ntl * BF16_B_BLOCK_BYTES)
        sums[j % 2] = _wgmma_bf16_block(ntl, a, _smem_desc(blk, lbo, 128), _smem_desc(blk + 2 * lbo, lbo, 128))
        if cutlass.const_expr(self.bf16_sets == 1):
          self._sh_store_bf16(_wgmma_wait(ntl, 0, sums[j % 2]), j, sw, kt, 4 * ts + j, mt, sb)
        elif cutlass.const_expr(j > 0):
          self._sh_store_bf16(_wgmma_wait(ntl, 1, sums[(j - 1) % 2]), j - 1, sw, kt, 4 * ts + j - 1, mt, sb)
      if cutlass.const_expr(self.bf16_sets == 2):
        self._sh_store_bf16(_wgmma_wait(ntl, 0, sums[1]), 3, sw, kt, 4 * ts + 3, mt, sb)

  @cute.jit
  def _sh_store_bf16(self, d, j: cutlass.Constexpr, sw, kt: Int32, lb: Int32, mt: Int32, sb: Int32):
    """Block j of the warp's tile (``lb`` of the step): p = D 2**ew of rows g, g + 8 (scale words ``sw``) to
    ``self.sh.p``, where `_sh_tiles` stores it (D element 4 i + c: token 8 i + 2 t4 + (c & 1), row g + 8 (c >> 1))."""
    _, _, g, t4 = _lanes()
    sh = self.sh
    if cutlass.const_expr(self.v.shared_group == v1.K32):
      ew = tuple(((w >> (8 * j)) & v1.BYTE_MASK) - v1.UE8M0_BIAS for w in sw)
    else:
      ew = tuple(((w >> (8 * (kt % 4))) & v1.BYTE_MASK) - v1.UE8M0_BIAS for w in sw)
    z4 = (Int32(0),) * 4
    for i in cutlass.range_constexpr(len(d) // 4):
      out = sb + sh.p + ((lb * sh.tokens + 8 * i + 2 * t4) * SH_P_ROWS + 16 * mt + g) * 4
      _sh_store(tuple(d[4 * i + c] for c in range(4)), tuple(ew[c // 2] for c in range(4)), z4,
                tuple(out + ((c % 2) * SH_P_ROWS + 8 * (c // 2)) * 4 for c in range(4)), None)

  @cute.jit
  def _sh_tiles(self, ntiles: cutlass.Constexpr, a, ew, buf: Int32, lb: Int32, mt: Int32, sb: Int32):
    """Block lb's dots for ``ntiles`` n-tiles of 8 tokens: twelve MMAs per n-tile give nine chains, each below 2**22
    in magnitude: Shh's (H1 H1; H1 H0 + H0 H1; H0 H0), Sll's likewise, and from F x F less those two, Shl + Slh's
    (started at `MAGIC3` less their ends). With every chain started at MAGIC, f32 of a chain is one subtraction, and
    f32(S) = RN(64 (64 f32(S1) + f32(S2)) + f32(S3)) with the inner FMA exact (below 2**24), i.e. cvt.rn of S
    (`_sh_chain_f32`)."""
    _, _, g, t4 = _lanes()
    sh = self.sh
    ah1, ah0, al1, al0, af1, af0 = a
    m4 = (Int32(MAGIC),) * 4
    for nt in cutlass.range_constexpr(ntiles):
      tok = SH_TOKENS * nt
      xa = sb + SH_X + (buf * sh.tokens + tok + g) * SH_X_STRIDE + lb * SH_BLOCK + 8 * t4
      bh1, bh0, bl1, bl0 = (_lds2(xa + 32 * p) for p in range(SH_PLANES))
      bf1 = (bh1[0] | bl1[0], bh1[1] | bl1[1])
      bf0 = (bh0[0] | bl0[0], bh0[1] | bl0[1])
      c1 = _mma_s8(ah1, bh1, m4)
      c2 = _mma_s8(ah0, bh1, _mma_s8(ah1, bh0, m4))
      c3 = _mma_s8(ah0, bh0, m4)
      d1 = _mma_s8(al1, bl1, m4)
      d2 = _mma_s8(al0, bl1, _mma_s8(al1, bl0, m4))
      d3 = _mma_s8(al0, bl0, m4)
      # (`shfree`: F x F's chains start at 3 MAGIC and drop Shh's and Sll's ends after their MMAs, the same int32 mod
      # 2**32, so its MMAs need not wait for the other six chains')
      start = lambda c, d: ((Int32(MAGIC3),) * 4 if self.sh_free  # noqa: E731
                            else tuple(MAGIC3 - c[i] - d[i] for i in range(4)))
      e1 = _mma_s8(af1, bf1, start(c1, d1))
      e2 = _mma_s8(af0, bf1, _mma_s8(af1, bf0, start(c2, d2)))
      e3 = _mma_s8(af0, bf0, start(c3, d3))
      if cutlass.const_expr(self.sh_free):
        e1, e2, e3 = (tuple(e[i] - c[i] - d[i] for i in range(4)) for e, c, d in ((e1, c1, d1), (e2, c2, d2),
                                                                                   (e3, c3, d3)))
      xe = sb + sh.xe + ((buf * sh.tokens + tok + 2 * t4) * SH_STEP + lb) * 4
      ex = (_lds(xe), _lds(xe + SH_STEP * 4))
      p = [Int32(0)] * 4
      es = [Int32(0)] * 4
      for c in cutlass.range_constexpr(4):
        p[c] = _sh_p(_sh_chain_f32(c1[c], c2[c], c3[c]), _sh_chain_f32(e1[c], e2[c], e3[c]),
                     _sh_chain_f32(d1[c], d2[c], d3[c]))
        es[c] = ex[c % 2] + ew[c // 2]
      # C fragment element c: token 2 t4 + (c & 1), row g + 8 (c >> 1)
      out = sb + sh.p + ((lb * sh.tokens + tok + 2 * t4) * SH_P_ROWS + 16 * mt + g) * 4
      _sh_store(p, es, tuple(ex[c % 2] for c in range(4)),
                tuple(out + ((c % 2) * SH_P_ROWS + 8 * (c // 2)) * 4 for c in range(4)), None)

  @cute.jit
  def _sh_two_rows(self, a, ew, buf: Int32, lb: Int32, mt: Int32, sb: Int32):
    """Block lb's dots for a group of two tokens (or one: the second's planes are zeros, its p is never read) over
    two n-tiles. In the first, column n holds token n >> 2's plane H1, H0, L1, L0 (n & 3), and four MMAs from 0,
    X = H1 B_h + L1 B_l and Y = H0 B_h + L0 B_l (B_h: the columns of H planes, B_l: of L), end with Shh of token 0
    in lanes t4 = 0, its Sll in t4 = 1, and token 1's in t4 = 2, 3; in the second, columns 0-3 hold F1, F0 of
    token 0, then of token 1, and two MMAs, F1 B and F0 B, end with Sff of token 0 in lanes t4 = 0 and of token 1
    in t4 = 1. Lane t4 = 2 tok (tok = 0, 1) takes the others by shuffles and forms p of rows g and g + 8 and token
    tok. Six MMAs where `_sh_tiles` issues twelve for an n-tile of 8 tokens, of which this group uses two columns.
    Each lane's int32 sum S = 4096 X[2 t4] + 64 (X[2 t4 + 1] + Y[2 t4]) + Y[2 t4 + 1] is exact (|S| < 32 3584**2),
    and f32 of it is cvt.rn, the value `_sh_chain_f32` rounds to in `_sh_tiles`."""
    _, _, g, t4 = _lanes()
    sh = self.sh
    ah1, ah0, al1, al0, af1, af0 = a
    on = Int32(-1)
    slots = _sh_slots(SH_ROWS // 2)
    z4 = (Int32(0),) * 4
    xa = sb + SH_X + (buf * sh.tokens) * SH_X_STRIDE + lb * SH_BLOCK + 8 * t4
    ftok = xa + ((g // 2) % 2) * (slots * SH_X_STRIDE)  # column g < 4: token g >> 1's F plane g & 1
    fh = _lds2(ftok + 32 * (g % 2))
    fl = _lds2(ftok + 32 * (g % 2 + 2))
    m_f = cutlass.select_(g < 4, on, Int32(0))
    bf = tuple((fh[i] | fl[i]) & m_f for i in range(2))
    xf = _mma_s8(af1, bf, z4)
    yf = _mma_s8(af0, bf, z4)
    ff = [Int32(0)] * 2  # Sff of token t4 in lanes t4 < 2, of rows g and g + 8; t4 = 2 takes token 1's from t4 = 1
    for r in cutlass.range_constexpr(2):
      f = _two_digit_sum(xf, yf, r)
      ff[r] = cutlass.select_(t4 == 0, f, _shfl_xor(f, 3))
    u = _lds2(xa + (g // 4) * (slots * SH_X_STRIDE) + 32 * (g % 4))  # token g >> 2, plane g & 3
    m_h = cutlass.select_(g % 4 < 2, on, Int32(0))
    bh = tuple(v & m_h for v in u)
    bl = tuple(v & ~m_h for v in u)
    x = _mma_s8(al1, bl, _mma_s8(ah1, bh, z4))
    y = _mma_s8(al0, bl, _mma_s8(ah0, bh, z4))
    tok = t4 // 2
    ex = _lds(sb + sh.xe + ((buf * sh.tokens + slots * tok) * SH_STEP + lb) * 4)  # (`_sh_issue`'s run-on slots)
    p = [Int32(0)] * 2
    es = [Int32(0)] * 2
    for r in cutlass.range_constexpr(2):  # rows g, g + 8
      hl = _two_digit_sum(x, y, r)  # Shh (t4 even) or Sll (odd)
      ll = _shfl_xor(hl, 1)
      p[r] = _sh_p(v1._i2f(hl), v1._i2f(ff[r] - hl - ll), v1._i2f(ll))
      es[r] = ex + ew[r]
    out = sb + sh.p + ((lb * abi.HALVES_TOKENS + tok) * SH_P_ROWS + 16 * mt + g) * 4  # p row (lb, tok)
    _sh_store(p, es, (ex, ex), (out, out + 8 * 4), t4 % 2 == 0)

  @cute.jit
  def _sh_accumulate(self, tbc: cutlass.Constexpr, s: Int32, k: cutlass.Constexpr, sb: Int32,
                     rows: cutlass.Constexpr = SH_ROWS):
    """A thread per (token, row < ``rows``): acc += p of step s's blocks, in increasing K."""
    tid, _, _ = cute.arch.thread_idx()
    sh = self.sh
    row = tid % rows
    bps = 4 * _sh_tiles_per_step(rows)
    ptok = tbc if tbc == abi.HALVES_TOKENS else sh.tokens  # p rows per block (`_sh_two_rows`, `_sh_tiles`)
    for j in cutlass.range_constexpr(-(-tbc * rows // THREADS)):
      tok = tid // rows + j * (THREADS // rows)
      if tok < tbc:
        a = sb + sh.acc + (tok * SH_ROWS + row) * 4
        acc = _lds(a)
        for lb in cutlass.range_constexpr(bps):
          p = _lds(sb + sh.p + ((lb * ptok + tok) * SH_P_ROWS + row) * 4)
          if cutlass.const_expr(lb >= 4 and (k // v1.K32) % bps != 0):
            # The last step of K may hold fewer K128 tiles than a step (acc kept as it is past K: adding +0 would
            # turn an ftz-flushed -0 into +0).
            acc = cutlass.select_(s * bps + lb < k // v1.K32, v1._fadd(acc, p), acc)
          else:
            acc = v1._fadd(acc, p)
        _sts(a, acc)

  @cute.jit
  def _await_queue(self, queue: Int64, wsb: Int64, cur: Int32, bid: Int32) -> Int32:
    """One thread: bounded wait until role 1 closed this call's active queue at ``queue`` (`abi.active_queue`); 1 if
    it did, else 0. An expired wait records the first expert role 1 left unpublished (``WAIT_READY + e``, observed
    ``ready[e]``: a stalled role 1), or else ``WAIT_QUEUE`` + the queue's size so far."""
    size, fault = self._spin_geq(queue + v1.WORD_BYTES, Int32(1), wsb)
    ok = Int32(0)
    if size > 0:
      ok = Int32(1)
      cute.arch.fence_acq_rel_gpu()  # the CTA reads the entries, count[e] and rows[e] after the barrier that follows
    elif fault == 0:
      self._queue_fault(queue, wsb, cur, bid)
    return ok

  @cute.jit
  def _queue_fault(self, queue: Int64, wsb: Int64, cur: Int32, bid: Int32):
    """A wait for the active queue expired: records what role 1 left unpublished, once (the first fault wins)."""
    v, ws = self.v, self.ws
    appended = v1._ld(queue)
    what = Int32(abi.WAIT_QUEUE) + appended
    observed = appended
    for x in range(v.experts):
      r = _ld_gpu(wsb + ws.ready + Int64(x) * v1.WORD_BYTES)
      if (r != cur) & (what >= abi.WAIT_QUEUE):
        what = Int32(abi.WAIT_READY) + x
        observed = r
    v1._record_fault(wsb, 2, bid, cur, what, observed)

  @cute.jit
  def _spin_geq(self, addr: Int64, target: Int32, wsb: Int64, scope: cutlass.Constexpr = "gpu",
                patience: cutlass.Constexpr = 1, until_fault: cutlass.Constexpr = True):
    """One thread: acquire-spin on the counter at ``addr`` until it reaches ``target``, another CTA records a fault
    (unless ``until_fault`` is False), or ``patience`` timeouts pass; (the value last seen, the error flag last
    seen). No fence, nothing recorded (the callers fence after they saw the target). `GCMOE_ABLATION=spin` polls with
    relaxed loads and no nanosleep between them (timing: what the sleep and the acquire loads add to each wait on the
    critical path)."""
    sem = "relaxed" if cutlass.const_expr(self.ablation == "spin") else "acquire"
    flag = v1._gptr(wsb + abi.HEADER["error_flag"])
    timeout = v1._ld(wsb + abi.HEADER["timeout_ns"], cutlass.Uint64)
    if cutlass.const_expr(patience != 1):
      timeout = timeout * patience
    start = cute.arch.globaltimer()
    seen, fault = self._poll_pair(addr, flag, sem, scope)
    elapsed = cutlass.Uint64(0)
    stops = -1 if until_fault else 0  # the error flag's bits that end the wait
    while (seen < target) & ((fault & stops) == 0) & (elapsed <= timeout):
      if cutlass.const_expr(self.ablation != "spin"):
        cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(v1.SPIN_SLEEP_NS)])
      seen, fault = self._poll_pair(addr, flag, sem, scope)
      elapsed = cutlass.Uint64(cute.arch.globaltimer() - start)
    return seen, fault

  def _poll_pair(self, addr: Int64, flag, sem: str, scope: str):
    """One poll of `_spin_geq`: (the counter at ``addr``, the error flag). The acquire load's L1 invalidation waits for
    its value, so the flag's load after it costs a second round trip; `trips` loads the flag first, so both are in
    flight at once (the flag only ends the wait early)."""
    if self.trips:
      fault = cute.arch.load(flag, Int32, sem="relaxed", scope="gpu")
      return cute.arch.load(v1._gptr(addr), Int32, sem=sem, scope=scope), fault
    seen = cute.arch.load(v1._gptr(addr), Int32, sem=sem, scope=scope)
    return seen, cute.arch.load(flag, Int32, sem="relaxed", scope="gpu")

  @cute.jit
  def _wait_geq(self, addr: Int64, target: Int32, wsb: Int64, cur: Int32, bid: Int32, what: Int32,
                role: cutlass.Constexpr = 2, scope: cutlass.Constexpr = "gpu",
                patience: cutlass.Constexpr = 1, until_fault: cutlass.Constexpr = True) -> Int32:
    """One thread: bounded acquire-spin until the counter at ``addr`` reaches ``target``; 1 if it did, else 0
    (a timeout is recorded as ``role`` with counter ``what``; another CTA's fault ends the wait too, unless
    ``until_fault`` is False). ``scope`` "sys": a counter or flag a peer (maybe another GPU) writes. ``patience``:
    the bound in timeouts (a wait on a thread that itself waits with the plain bound takes 2, so that thread's
    diagnostic is the one recorded)."""
    seen, fault = self._spin_geq(addr, target, wsb, scope, patience, until_fault)
    ok = Int32(0)
    if seen >= target:
      ok = Int32(1)
      if cutlass.const_expr(scope == "sys"):
        _fence_sys()
      else:
        cute.arch.fence_acq_rel_gpu()
    elif fault == 0:
      v1._record_fault(wsb, role, bid, cur, what, seen)
    return ok

  @cute.jit
  def _mx_lane(self, val: Int32):
    """MXFP8 of one K32 block held one element per lane (float32 bits): (``512 q`` of this lane's element, the
    block's exponent e, 1 if the block held a NaN/Inf). The arithmetic of `roles_v1._quantize_block` (amax over
    finite values, RNE onto E4M3 after the two-step scaling), the amax and the flag reduced across the warp."""
    a = val & v1.F32_ABS
    finite = a < v1.F32_INF
    amax = cutlass.select_(finite, a, Int32(0))
    bad = cutlass.select_(finite, Int32(0), Int32(1))
    for off in cutlass.range_constexpr(5):
      amax = cutlass.max(amax, _shfl_xor(amax, 1 << off))
      bad = cutlass.max(bad, _shfl_xor(bad, 1 << off))
    e = v1._e4m3_scale_exp(amax)
    neg = -e
    half = neg >> 1
    q = v1._fmul(v1._fmul(val, v1._exp2_bits(half)), v1._exp2_bits(neg - half))
    return cutlass.select_(finite, v1._e4m3_int(q), Int32(0)), e, bad

  @cute.jit
  def _quantize_lane(self, val: Int32, lane: Int32, planes: Int64, exp_addr: Int64, flag_addr: Int64, sf_addr: Int64,
                     cur: Int32, slow_word=None, bf_addr=None):
    """MXFP8 of one K32 block held one element per lane (float32 bits), written as digit planes + exponent word.

    The same arithmetic as `roles_v1._quantize_block` (amax over finite values, NaN/Inf flags the block, RNE onto
    E4M3 after the two-step scaling), with the amax and the flag reduced across the warp. A NaN block or an
    exponent outside `abi.FAST_EXP` tags the row's flag word with ``cur`` (and stores 1 to the SMEM word
    ``slow_word``, if given: `kbany`). The sm_120a seam stores the block's E4M3 codes in plane 0 and its UE8M0 byte
    at ``sf_addr`` instead (0xFF, NaN, for a NaN block). ``bf_addr`` (`bf16`): the block's BF16 plane, where the
    lane stores ``q 2**e`` (exact: ``512 q`` times ``2**(e - 9)``; NaN for a NaN block, whose row takes the int8
    body) at `bf16fold.plane_position` of its K.
    """
    n, e, bad = self._mx_lane(val)
    if cutlass.const_expr(bf_addr is not None):
      _store_bf16_plane(n, e, bad, lane, bf_addr)
    if cutlass.const_expr(self.qmma):
      _st_u8(planes + lane, _e4m3_code(n))
      if lane == 0:
        _st_u8(sf_addr, cutlass.select_(bad != 0, Int32(0xFF), e + v1.F32_BIAS))
    else:
      for p, d in enumerate(_sign_digits(n, PLANES)):
        _st_u8(planes + 32 * p + lane, d)
    if cutlass.const_expr(not self.qmma):  # the sm_120a seam reads neither the exponent word nor the flag
      if lane == 0:
        word, slow = _exp_word(e + v1.FP4_DOT_SHIFT, bad != 0)
        v1._st(exp_addr, word)
        if slow:
          v1._st(flag_addr, cur)
          if cutlass.const_expr(slow_word is not None):
            _sts(slow_word, 1)
    return n, e, bad

  @cute.jit
  def _item(self, g2: cutlass.Constexpr, e: Int32, j: Int32, count: Int32, rwb: Int64, pw: Int64, psc: Int64,
            wsb: Int64, c_bits: Int32, cur: Int32, ctl: Int32, pipe: Int32, tmap: Int64, kp=None, pre=None,
            anyo=None):
    """One GEMM1 (g2 False) or GEMM2 item: the expert's rows in passes of up to 8 `nt_max` rows (`_chunk`), each
    pass in the body of the fewest n-tiles that hold its rows (1, 2, 3, 4, 6 or 8: the 3 and 6 bodies spare a
    quarter of the MMAs and epilogue of passes of 17-24 and 33-48 rows, the usual ones at B = 64 and 128;
    `odd_bodies`). ``pre`` (`w_early`): 1 where `_w_ahead` copied the weights of this one-pass item's first stages.
    ``anyo`` (`kbany`): 1 where this GEMM2 item of one or two rows did not wait for its expert's GEMM1 items
    (`_any_mainloop`)."""
    n_end = count
    if cutlass.const_expr(kp is not None):
      if kp != 0:  # (`kpair`: 64 rows j of a GEMM2 item, its one or two rows in one pass)
        if count == 1:
          self._chunk(g2, 1, e, j, Int32(0), count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, 1, True)
        else:
          self._chunk(g2, 1, e, j, Int32(0), count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, 2, True)
        n_end = Int32(0)
    if cutlass.const_expr(self.three_cta):
      # (`three_cta`: an expert's rows in passes of two, the last of one if their number is odd; each pass sees its
      # own rows only, the rest of its slots padding, which it neither reads nor writes)
      for n0 in range(0, n_end, 2):
        if count - n0 == 1:
          self._chunk(g2, 1, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, 1, pre=pre)
        else:
          self._chunk(g2, 1, e, j, n0, n0 + 2, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, 2, pre=pre)
      n_end = Int32(0)
    for n0 in range(0, n_end, 8 * self.nt_max):
      rem = cutlass.min(count - n0, 8 * self.nt_max)
      if rem <= 8:
        if cutlass.const_expr(self.single):
          if rem == 1:
            if cutlass.const_expr(anyo is not None):
              if anyo != 0:
                self._chunk(g2, 1, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, 1, anyo=1)
              else:
                self._chunk(g2, 1, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, 1, pre=pre)
            else:
              self._chunk(g2, 1, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, 1, pre=pre)
          else:
            if cutlass.const_expr(anyo is not None and self.kbany_rows == 2):
              if (anyo != 0) & (rem == 2):
                self._chunk(g2, 1, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, anyo=2)
              else:
                self._chunk(g2, 1, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, pre=pre)
            else:
              self._chunk(g2, 1, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, pre=pre)
        else:
          self._chunk(g2, 1, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap, pre=pre)
      elif rem <= 16:
        self._chunk(g2, 2, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)
      else:
        if cutlass.const_expr(self.nt_max == 4):  # (`PASS_TIERS`: no body wider than the pass)
          if cutlass.const_expr(self.odd_bodies):
            if rem <= 24:
              self._chunk(g2, 3, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)
            else:
              self._chunk(g2, 4, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)
          else:
            self._chunk(g2, 4, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)
        elif cutlass.const_expr(self.nt_max > 2 and self.odd_bodies):
          if rem <= 24:
            self._chunk(g2, 3, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)
          elif rem <= 32:
            self._chunk(g2, 4, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)
          elif rem <= 48:
            self._chunk(g2, 6, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)
          else:
            self._chunk(g2, 8, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)
        elif cutlass.const_expr(self.nt_max > 2):
          if rem <= 32:
            self._chunk(g2, 4, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)
          else:
            self._chunk(g2, 8, e, j, n0, count, rwb, pw, psc, wsb, c_bits, cur, ctl, pipe, tmap)

  @cute.jit
  def _chunk(self, g2: cutlass.Constexpr, nt: cutlass.Constexpr, e: Int32, j: Int32, n0: Int32, count: Int32,
             rwb: Int64, pw: Int64, psc: Int64, wsb: Int64, c_bits: Int32, cur: Int32, ctl: Int32, pipe: Int32,
             tmap: Int64, single: cutlass.Constexpr = False, kpair: cutlass.Constexpr = False, pre=None,
             anyo: cutlass.Constexpr = 0):
    """One pass of up to 8 ``nt`` rows of the item (``single``: exactly one row, `_stage`'s plane-column body; a
    1-tile pass of two rows takes `_stage`'s two-row body at run time, one of three or four its four-row body).
    ``kpair`` (`RoleKernelsV2.kpair`): rows 64 j .. 64 j + 63 of a GEMM2 item with ``single`` (1 or 2) rows, K split
    between warps w and w + 4 (`_cpasync_mainloop`). ``pre``: `_item`'s. ``anyo`` (`kbany`, a GEMM2 pass of
    ``anyo`` = 1 or 2 rows that did not wait for its expert's GEMM1 items): `_any_mainloop`."""
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    warp, lane, g, t4 = _lanes()
    slots = 8 * nt
    n_rows = v.hidden if cutlass.const_expr(g2) else 2 * v.intermediate  # N of the weight tensor
    kb_n = (v.intermediate if cutlass.const_expr(g2) else v.hidden) // v1.K128
    nblk = self.nblk_i if cutlass.const_expr(g2) else self.nblk_h
    # GEMM1's B rows: x quantized by phase 0, or with the fused transport the rows role 1 received.
    x_planes, x_exp, x_sf, x_flag = ((ws.rxplanes, ws.rxexp, ws.rxsf, ws.rxflag) if self.fused else
                                     (ws.xplanes, ws.xexp, ws.xsf, ws.xflag))
    planes = wsb + (ws.aplanes if cutlass.const_expr(g2) else x_planes)
    # Per-block scale data staged with the B operand: exponent words (sm_90a) or UE8M0 bytes (sm_120a).
    if cutlass.const_expr(self.qmma):
      exps = wsb + (ws.asf if cutlass.const_expr(g2) else x_sf)
    else:
      exps = wsb + (ws.aexp if cutlass.const_expr(g2) else x_exp)
    flags = wsb + (ws.aflag if cutlass.const_expr(g2) else x_flag)
    st_bytes = stage_bytes(nt, self.token_stride, self.w_bytes)
    n_st = self._pass_stages(nt)
    pw_e, psc_e = self._expert_weights(e, pw, psc, n_rows, kb_n)
    row0 = j * TILE_M
    # (`tma_w`: the TensorMap, the tile's first row in it at kb = 0, and what a timed-out wait records)
    tw = (tmap, e * (kb_n * n_rows) + row0, wsb, cur) if cutlass.const_expr(self.tma_w and not kpair) else None
    if cutlass.const_expr(kpair):
      n_st = n_st - 1  # the last stage's room holds the warps' p (`_cpasync_mainloop`)
      row0 = j * (TILE_M // 2)

    # Slot table: the B operand's source row (token for GEMM1, assignment for GEMM2; -1 = padding); whether any
    # row of the chunk is flagged for the slow path.
    slow_row = Int32(0)
    if tid < slots:
      n = n0 + tid
      src = Int32(-1)
      asg = Int32(-1)
      rw = Int32(0)
      if n < count:
        scanned = Int32(0)  # (the CTA's own route lists, `_scan_routes`, or role 1's)
        if cutlass.const_expr(self.scan_tokens > 0):
          scanned = _lds(ctl + CTL_SCANNED)
        if scanned != 0:
          asg = _lds(ctl + self.scan_rows + (_lds(ctl + self.scan_first + e * 4) + n) * 4)
        else:
          asg = _ld_gpu(wsb + ws.rows + (Int64(e) * (self.rcap * v.top_k) + n) * v1.WORD_BYTES)
        src = asg
        if cutlass.const_expr(not g2):
          if cutlass.const_expr(not self.fused or self.cache):
            src = asg // v.top_k  # the token (local, or global with the pull cache): its row of x / rx
          if cutlass.const_expr(self.fused):  # role 1 gathered the received routes' weights
            rw = _ld_gpu(wsb + ws.grw + Int64(asg) * v1.WORD_BYTES)
          else:
            rw = v1._ld_nc(rwb + Int64(asg) * v1.WORD_BYTES)
        if cutlass.const_expr(not self.qmma and not anyo):  # (sm_120a: no slow path; `anyo`: per stage)
          slow_row = cutlass.select_(_ld_gpu(flags + Int64(src) * 4) == cur, Int32(1), Int32(0))
      _sts(ctl + CTL_SLOT_SRC + tid * 4, src)
      _sts(ctl + CTL_SLOT_ASG + tid * 4, asg)
      _sts(ctl + CTL_SLOT_RW + tid * 4, rw)
    if cutlass.const_expr(anyo):
      if tid == 0:  # nothing issued, done or stopped yet (`_any_mainloop`)
        for q in cutlass.range_constexpr(4):
          _sts(ctl + CTL_ANY + 4 * q, 0)
    # The TMA producer's barriers start each pass here, before the slot table's CTA barrier makes them visible.
    bars = ctl + CTL_BARS
    if cutlass.const_expr(self.tma or self.tma_w):
      if tid == 0:
        for s in cutlass.range_constexpr(n_st):
          if cutlass.const_expr(self.tma_w):
            _mbar_init(bars + 8 * s, 1)  # thread 0's arrive.expect_tx
          else:
            _mbar_init(bars + 8 * s, 1 + 32)  # the producer lane 0's arrive.expect_tx, its 32 lanes' cp.async
            _mbar_init(bars + 8 * (MAX_STAGES + s), THREADS)
        _fence_mbar_init()
        _sts(ctl + CTL_FAULT, -1)
      _fence_async_smem()  # the epilogue and the shared-expert path wrote this area through the generic proxy
    rows_fast = Int32(1)
    if cutlass.const_expr(self.qmma):
      cute.arch.sync_threads()  # the slot table is read by every thread
    else:
      rows_fast = 1 - _bar_or(slow_row)  # also the barrier after the slot table

    # ---- mainloop -------------------------------------------------------------------------------------------
    acc = cute.make_rmem_tensor(4 * nt, Int32)
    for i in cutlass.range_constexpr(4 * nt):
      acc[i] = Int32(0)
    if cutlass.const_expr(anyo):
      self._any_mainloop(anyo, e, pw_e, psc_e, row0, planes, exps, wsb, cur, ctl, pipe, acc)
      if cutlass.const_expr(anyo == 1):
        acc[2] = _shfl_xor(acc[0], 1)  # row g + 8 was summed by lane t4 = 1 (`_stage`)
      else:
        for c in cutlass.range_constexpr(1, 4):  # (slot c % 2, row g + 8 (c // 2)) was lane t4 = c's (`_stage`)
          acc[c] = _shfl_xor(acc[0], c)
    elif cutlass.const_expr(self.tma):
      self._tma_mainloop(nt, n_st, st_bytes, e, n0, count, psc_e, row0, n_rows, kb_n, nblk, planes, exps, wsb, cur,
                         ctl, pipe, tmap, rows_fast, acc)
    else:
      if cutlass.const_expr(self.single and nt == 1 and not single):
        # A pass of two, or three or four, rows in the 1-tile body's code (a pass body of its own cost ptxas 40-70 B
        # of spills).
        rows = count - n0
        pair = cutlass.select_(rows == 2, Int32(2), Int32(0))
        if cutlass.const_expr(self.four_row):
          pair = cutlass.select_((rows == 3) | (rows == 4), Int32(4), pair)
        self._cpasync_mainloop(nt, n_st, st_bytes, pw_e, psc_e, row0, n_rows, kb_n, nblk, planes, exps, ctl, pipe,
                               rows_fast, acc, single, pair, pre=pre, tw=tw)
        if pair == 2:
          for c in cutlass.range_constexpr(1, 4):  # (slot c % 2, row g + 8 (c // 2)) was lane t4 = c's (`_stage`)
            acc[c] = _shfl_xor(acc[0], c)
        if cutlass.const_expr(self.four_row):
          if pair == 4:
            # (slot 2 t4 + c % 2, row g + 8 (c // 2)) was lane 2 t4 + c % 2's accumulator c // 2 (`_stage`); lanes
            # t4 = 2, 3 gather padding slots, which the epilogue skips.
            even = (lane & ~3) | ((2 * t4) & 3)
            odd = even | 1
            moved = (_shfl_idx(acc[0], even), _shfl_idx(acc[0], odd), _shfl_idx(acc[1], even), _shfl_idx(acc[1], odd))
            for c in cutlass.range_constexpr(4):
              acc[c] = moved[c]
      elif cutlass.const_expr(self.bf16 and nt > SPLIT_DECODE_NT and not single and not kpair and tw is None):
        # (`bf16`) The BF16 body where every row is fast; a weight scale byte outside the fold (`BF16_BYTE_OK`) in
        # any stage sends the pass to the int8 body again, from its first stage.
        redo = 1 - rows_fast
        if rows_fast != 0:
          bad = cute.make_rmem_tensor(1, Int32)
          bad[0] = Int32(0)
          bf_planes = wsb + (ws.abf if cutlass.const_expr(g2) else ws.xbf)
          self._cpasync_mainloop(nt, n_st, st_bytes, pw_e, psc_e, row0, n_rows, kb_n, nblk, bf_planes, exps, ctl,
                                 pipe, rows_fast, acc, bf16=bad)
          redo = _bar_or(bad[0])
          if redo != 0:
            for i in cutlass.range_constexpr(4 * nt):
              acc[i] = Int32(0)
        if redo != 0:
          self._cpasync_mainloop(nt, n_st, st_bytes, pw_e, psc_e, row0, n_rows, kb_n, nblk, planes, exps, ctl, pipe,
                                 rows_fast, acc)
      else:
        self._cpasync_mainloop(nt, n_st, st_bytes, pw_e, psc_e, row0, n_rows, kb_n, nblk, planes, exps, ctl, pipe,
                               rows_fast, acc, single, kpair=kpair, pre=pre, tw=tw)
      if cutlass.const_expr(single == 1):
        acc[2] = _shfl_xor(acc[0], 1)  # row g + 8 was accumulated by lane t4 = 1 (`_stage`)
      elif cutlass.const_expr(single == 2):
        for c in cutlass.range_constexpr(1, 4):  # (slot c % 2, row g + 8 (c // 2)) was lane t4 = c's (`_stage`)
          acc[c] = _shfl_xor(acc[0], c)

    # ---- epilogue ---------------------------------------------------------------------------------------------
    if cutlass.const_expr(g2 and self.fused and not self.relay):
      self._return_rows(nt, n0, count, row0, acc, wsb, cur, ctl)
    elif cutlass.const_expr(g2):
      out = wsb + (ws.relay_arena if self.relay else ws.arena)  # relay: parked position-major for the copiers
      n_out = count
      if cutlass.const_expr(kpair):
        n_out = cutlass.select_(warp < WARPS // 2, count, Int32(0))  # (warps 4-7 handed their p to warps 0-3)
      for i in cutlass.range_constexpr(nt):
        for c in cutlass.range_constexpr(4):
          slot = 8 * i + 2 * t4 + c % 2
          if n0 + slot < n_out:
            asg = _lds(ctl + CTL_SLOT_ASG + slot * 4)
            h = row0 + 16 * warp + g + 8 * (c // 2)
            v1._st_bf16(out + (Int64(asg) * v.hidden + h) * v1.BF16_BYTES, v1._bf16_rne(acc[4 * i + c]))
    else:
      # SwiGLU of column 64 j + 8 warp + g (gate: c 0/1, up: c 2/3) -> BF16 sA[slot][64] in the pipeline area.
      neg_c = c_bits ^ v1.F32_SIGN
      col = 8 * warp + g
      for i in cutlass.range_constexpr(nt):
        for c in cutlass.range_constexpr(2):
          slot = 8 * i + 2 * t4 + c
          gb = v1._bf16_rne(acc[4 * i + c]) << v1.BF16_SHIFT
          ub = v1._bf16_rne(acc[4 * i + 2 + c]) << v1.BF16_SHIFT
          gb = v1._fmin_nan(gb, c_bits)
          ub = v1._fmin_nan(v1._fmax_nan(ub, neg_c), c_bits)
          silu = v1._ld_nc(wsb + ws.silu_table + Int64((gb >> v1.BF16_SHIFT) & v1.BF16_MASK) * v1.WORD_BYTES)
          act = v1._bf16_rne(v1._fmul(silu, ub)) << v1.BF16_SHIFT
          rw = _lds(ctl + CTL_SLOT_RW + slot * 4)
          _sts_u16(pipe + (slot * 64 + col) * 2, v1._bf16_rne(v1._fmul(rw, act)))
      cute.arch.sync_threads()
      # Requantize: a warp per (slot, K32 block 2 j + half), a lane per element.
      for qb in range(warp, 2 * slots, WARPS):
        slot = qb // 2
        half = qb % 2
        if n0 + slot < count:
          asg = _lds(ctl + CTL_SLOT_ASG + slot * 4)
          val = _lds_u16(pipe + (slot * 64 + 32 * half + lane) * 2) << v1.BF16_SHIFT
          blk = Int64(asg) * self.nblk_i + 2 * j + half
          self._quantize_lane(val, lane, wsb + ws.aplanes + blk * BLOCK_BYTES, wsb + ws.aexp + blk * 4,
                              wsb + ws.aflag + Int64(asg) * 4, wsb + ws.asf + blk, cur,
                              ctl + CTL_G1SLOW if cutlass.const_expr(self.kbany) else None,
                              bf_addr=wsb + ws.abf + blk * BF16_PLANE_BYTES if self.bf16 else None)
    cute.arch.sync_threads()  # the slot table and the pipeline area are rewritten by the next chunk

  @cute.jit
  def _return_rows(self, nt: cutlass.Constexpr, n0: Int32, count: Int32, row0: Int32, acc: cute.Tensor, wsb: Int64,
                   cur: Int32, ctl: Int32):
    """The fused transport's direct return path (paper §4.6): each GEMM2 output row goes straight into its owner's
    ``arena`` (global assignment g k + j of rank p = row p C k + t k + j there), then one release-add per owner
    counts this pass's rows into the owner's returns counter."""
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    warp, lane, g, t4 = _lanes()
    per_rank = v.capacity * v.top_k
    for i in cutlass.range_constexpr(nt):
      for c in cutlass.range_constexpr(4):
        slot = 8 * i + 2 * t4 + c % 2
        if n0 + slot < count:
          asg = _lds(ctl + CTL_SLOT_ASG + slot * 4)
          p = asg // per_rank
          h = row0 + 16 * warp + g + 8 * (c // 2)
          out = _peer(wsb, p) + ws.arena + (Int64(asg - p * per_rank) * v.hidden + h) * v1.BF16_BYTES
          v1._st_bf16(out, v1._bf16_rne(acc[4 * i + c]))
    _fence_sys()
    cute.arch.sync_threads()
    if tid < v.ranks:
      n = Int32(0)
      for slot in range(cutlass.min(count - n0, Int32(8 * nt))):
        if _lds(ctl + CTL_SLOT_ASG + slot * 4) // per_rank == tid:
          n = n + 1
      if n > 0:
        _red_release_sys(self._returns_counter(_peer(wsb, tid), cur), n)

  def _returns_counter(self, base: Int64, cur: Int32) -> Int64:
    """Address of call ``cur``'s returns counter (`abi.fused_counters`) in the workspace at ``base`` (this
    rank's or a peer's: the layout is the same on every rank)."""
    _, returns = abi.fused_counters(self.v.experts, self.v.capacity, self.v.shared)
    return self._counter(base, cur, returns)

  @cute.jit
  def _copier(self, b: Int32, n_relay: Int32, n_hit: Int32, table: Int32, wsb: Int64, cur: Int32, bid: Int32,
              counters: Int64, pipe: Int32):
    """Relay copier CTA ``b`` (paper §4.6): for the ranks p = b (mod n_relay), copies their GEMM2 rows from this
    rank's position-major ``relay_arena`` into their arenas, expert by expert as each expert's GEMM2 items complete
    and in completion order (a slow expert does not hold up rows that are ready), then counts them into each
    owner's returns counter (rows x H / 128, the direct path's unit). Bounded like every wait."""
    v, ws = self.v, self.ws
    tid, _, _ = cute.arch.thread_idx()
    warp, lane, _, _ = _lanes()
    per_rank = v.capacity * v.top_k
    row_bytes = v.hidden * v1.BF16_BYTES
    done = pipe  # u32 per hit expert: copied
    cnt = pipe + 4 * v.experts  # u32 per rank: rows of the current expert copied to it
    word = cnt + 4 * abi.MAX_RANKS  # broadcast word
    for h in range(tid, n_hit, THREADS):
      _sts(done + h * 4, 0)
    cute.arch.sync_threads()
    timeout = v1._ld(wsb + abi.HEADER["timeout_ns"], cutlass.Uint64)
    start = cute.arch.globaltimer()
    left = n_hit
    failed = Int32(0)
    while (left > 0) & (failed == 0):
      progressed = Int32(0)
      for h in range(n_hit):
        if _lds(done + h * 4) == 0:
          e = _lds(table + (v.experts + h) * 4)
          if tid == 0:
            seen = cute.arch.load(v1._gptr(counters + Int64(self.relay_base + e) * v1.WORD_BYTES), Int32,
                                  sem="acquire", scope="gpu")
            _sts(word, cutlass.select_(seen >= self.j2, Int32(1), Int32(0)))
          if tid < v.ranks:
            _sts(cnt + tid * 4, 0)
          cute.arch.sync_threads()
          if _lds(word) != 0:
            rows_e = wsb + ws.rows + Int64(e) * (self.rcap * v.top_k * v1.WORD_BYTES)
            for i in range(warp, _lds(table + e * 4), WARPS):
              asg = _ld_gpu(rows_e + Int64(i) * v1.WORD_BYTES)
              p = asg // per_rank
              if p - (p // n_relay) * n_relay == b:
                dst = _peer(wsb, p) + ws.arena + Int64(asg - p * per_rank) * row_bytes
                src = wsb + ws.relay_arena + Int64(asg) * row_bytes
                for c in range(lane, row_bytes // 16, 32):
                  _copy16(dst + c * 16, src + c * 16)
                if lane == 0:
                  cute.arch.inline_ptx("red.shared.add.u32 [{$r0}], 1;", read_only_args=[cnt + p * 4])
            _fence_sys()
            cute.arch.sync_threads()
            if tid < v.ranks:
              n = _lds(cnt + tid * 4)
              if n > 0:
                _red_release_sys(self._returns_counter(_peer(wsb, tid), cur), n * self.j2)
            if tid == 0:
              _sts(done + h * 4, 1)
            left = left - 1
            progressed = Int32(1)
          cute.arch.sync_threads()
      if progressed == 0:
        if tid == 0:
          fault = cute.arch.load(v1._gptr(wsb + abi.HEADER["error_flag"]), Int32, sem="relaxed", scope="gpu")
          expired = cutlass.Uint64(cute.arch.globaltimer() - start) > timeout
          if expired & (fault == 0):
            v1._record_fault(wsb, 2, bid, cur, Int32(abi.WAIT_RELAY), left)
          _sts(word, cutlass.select_(expired | (fault != 0), Int32(1), Int32(0)))
          cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(v1.SPIN_SLEEP_NS)])
        cute.arch.sync_threads()
        failed = _lds(word)
        cute.arch.sync_threads()

  @cute.jit
  def _await_role2(self, wsb: Int64, bid: Int32, cur: Int32) -> None:
    """Role 3 on one GPU, call ``cur``. Where the runtime put it beside role 2 (``HEADER["role2_grid"]`` set:
    `abi.FINALIZE_EARLY_TOKENS`), this CTA counts itself in (it read the epoch, which block 0 advances at its end),
    then waits until every role-2 CTA counted itself done; meanwhile a second thread of block 0 waits until every
    role-3 CTA counted itself in, so the epoch advances only after all of them read it. Both waits are bounded but
    go on through faults: role 2's CTAs run to their end either way, and none may outlive its call's epoch. Where
    role 3 runs after role 2 (a graph edge), nothing."""
    tid, _, _ = cute.arch.thread_idx()
    grid, _, _ = cute.arch.grid_dim()
    v = self.v
    grid2 = v1._ld(wsb + abi.HEADER["role2_grid"])
    word = self._counter(wsb, cur, abi.role2_done(v.experts, v.capacity, v.shared, v.ranks, v.relay))
    if grid2 != 0:
      if tid == 0:
        _red_release_add(word + v1.WORD_BYTES, 1)
        self._wait_geq(word, grid2, wsb, cur, bid, Int32(abi.WAIT_ROLE2), 3, "gpu", 2, False)
      if (bid == 0) & (tid == 32):
        self._wait_geq(word + v1.WORD_BYTES, Int32(grid), wsb, cur, bid, Int32(abi.WAIT_ROLE3), 3, "gpu", 2, False)
      cute.arch.sync_threads()

  @cute.jit
  def _await_returns(self, wsb: Int64, idb: Int64, n_tok: Int32, bid: Int32):
    """Role 3 of the fused transport: waits (bounded) until every GEMM2 row of this rank's valid routes came back
    (H / 128 per route, from whichever rank computed it); a timeout is recorded as role `abi.ROLE_TRANSPORT`."""
    v = self.v
    tid, _, _ = cute.arch.thread_idx()
    if tid < 32:
      n = Int32(0)
      for a in range(tid, n_tok * v.top_k, 32):
        gid = v1._ld_nc(idb + Int64(a) * v1.WORD_BYTES)
        n = n + cutlass.select_((gid >= 0) & (gid < v.experts * v.ranks), Int32(1), Int32(0))
      for off in cutlass.range_constexpr(5):
        n = n + _shfl_xor(n, 1 << off)
      if tid == 0:
        cur = v1._ld(wsb + abi.HEADER["epoch"]) + 1
        self._wait_geq(self._returns_counter(wsb, cur), n * self.j2, wsb, cur, bid, Int32(abi.WAIT_RETURNS),
                       abi.ROLE_TRANSPORT, "sys")
    cute.arch.sync_threads()

  @cute.jit
  def _tma_mainloop(self, nt: cutlass.Constexpr, n_st: cutlass.Constexpr, st_bytes: cutlass.Constexpr, e: Int32,
                    n0: Int32, count: Int32, psc_e: Int64, row0: Int32, n_rows: cutlass.Constexpr,
                    kb_n: cutlass.Constexpr, nblk: cutlass.Constexpr, planes: Int64, exps: Int64, wsb: Int64,
                    cur: Int32, ctl: Int32, pipe: Int32, tmap: Int64, rows_fast: Int32, acc: cute.Tensor):
    """The K loop with warp 0 as the producer (paper §4.4's TMA producer, folded into the first math warp: a ninth
    warp would cost the one-CTA variants their 255 registers and the two-CTA ones their second CTA). Stage ``kb``
    lives in slot ``kb % n_st``; ``full[slot]`` completes when its copies landed: the weight tile by TMA (one
    instruction, swizzled by the TensorMap), the B rows of the valid slots by bulk copies, the scale words by
    cp.async (4 B each, a line per instruction); ``empty[slot]`` when every thread has read it.
    Warp 0 waits for the readers of a slot before refilling it; the other warps wait only for data, so they run
    ahead of each other by up to the whole pipeline instead of meeting at a CTA barrier per stage."""
    tid, _, _ = cute.arch.thread_idx()
    warp, lane, g, t4 = _lanes()
    slots = 8 * nt
    bars = ctl + CTL_BARS
    if warp == 0:
      if lane == 0:
        prod = ctl + CTL_PROD
        _sts64(prod, psc_e + Int64(row0) * v1.WORD_BYTES)
        _sts64(prod + 8, planes)
        _sts64(prod + 16, exps)
        _sts(prod + 24, e * (kb_n * n_rows) + row0)  # the tile's first row in the TensorMap at kb = 0
        # The expected bytes of a stage: the weight tile and the valid slots' rows.
        _sts(prod + 28, self.w_bytes + cutlass.min(count - n0, Int32(slots)) *
             (4 * 32 if self.qmma else 4 * BLOCK_BYTES + 16))
      cute.arch.sync_warp()
      # The item's B rows were written by generic stores (phase 0, role 1, the GEMM1 epilogue) that its wait
      # acquired; the bulk copies read them through the async proxy.
      _fence_async_global()
      for s in cutlass.range_constexpr(n_st - 1):
        if s < kb_n:
          self._produce(s, pipe + s * st_bytes, bars + 8 * s, slots, tmap, n_rows, kb_n, nblk, ctl)
    for kb in range(kb_n):
      if warp == 0:
        # Refill the slot of stage kb - 1 with stage kb + n_st - 1 before computing stage kb (n_st - 1 stages in
        # flight, as with the per-thread pipeline), once every thread has read stage kb - 1.
        nk = kb + n_st - 1
        if nk < kb_n:
          ns = nk % n_st
          if nk >= n_st:
            empty = bars + 8 * (MAX_STAGES + ns)
            if _mbar_try(empty, (nk // n_st - 1) & 1) == 0:
              self._mbar_spin(empty, (nk // n_st - 1) & 1, wsb, ctl, nk)
          self._produce(nk, pipe + ns * st_bytes, bars + 8 * ns, slots, tmap, n_rows, kb_n, nblk, ctl)
      slot = kb % n_st
      full = bars + 8 * slot
      if _mbar_try(full, (kb // n_st) & 1) == 0:
        self._mbar_spin(full, (kb // n_st) & 1, wsb, ctl, kb)
      self._compute(nt, (pipe + slot * st_bytes,), rows_fast, acc)
      _mbar_arrive(bars + 8 * (MAX_STAGES + slot))
    cute.arch.sync_threads()  # every stage read: the pipeline area is the epilogue's, the barriers retire
    if tid == 0:
      stuck = _lds(ctl + CTL_FAULT)
      if stuck >= 0:
        bid, _, _ = cute.arch.block_idx()
        v1._record_fault(wsb, 2, bid, cur, Int32(abi.WAIT_PIPE), stuck)
      for s in cutlass.range_constexpr(n_st):
        _mbar_inval(bars + 8 * s)
        _mbar_inval(bars + 8 * (MAX_STAGES + s))

  @cute.jit
  def _produce(self, kb: Int32, sb: Int32, bar: Int32, slots: cutlass.Constexpr, tmap: Int64,
               n_rows: cutlass.Constexpr, kb_n: cutlass.Constexpr, nblk: cutlass.Constexpr, ctl: Int32):
    """Warp 0: the copies of K128 block ``kb`` into the stage at ``sb``, completing on ``bar`` (the pass's state at
    ``CTL_PROD``)."""
    lane = cute.arch.lane_idx()
    prod = ctl + CTL_PROD
    planes = _lds64(prod + 8)
    exps = _lds64(prod + 16)
    xe_off = self.w_bytes + SC_BYTES
    xp_off = xe_off + slots * 16
    # The tile's scale words: one 512-B run of the MN-major scales, a 128-B line per copy instruction.
    sc = _lds64(prod) + Int64(kb) * (n_rows * v1.WORD_BYTES) + lane * v1.WORD_BYTES
    for i in cutlass.range_constexpr(TILE_M // 32):
      _cp4(sb + self.w_bytes + (lane + 32 * i) * 4, sc + 32 * i * v1.WORD_BYTES)
    for h in cutlass.range_constexpr((slots + 31) // 32):
      slot = lane + 32 * h
      src = Int32(-1)
      if slot < slots:
        src = _lds(ctl + CTL_SLOT_SRC + slot * 4)
      if src >= 0:
        blk = Int64(src) * nblk + 4 * kb
        if cutlass.const_expr(self.qmma):
          # Plane 0 (the E4M3 codes) of the four blocks by bulk copies, the packed UE8M0 word (4 B) by cp.async.
          _cp4(sb + xe_off + slot * 16, exps + blk)
          for q in cutlass.range_constexpr(4):
            _bulk(sb + xp_off + slot * self.token_stride + 32 * q, planes + (blk + q) * BLOCK_BYTES, 32, bar)
        else:
          _bulk(sb + xp_off + slot * self.token_stride, planes + blk * BLOCK_BYTES, 4 * BLOCK_BYTES, bar)
          _bulk(sb + xe_off + slot * 16, exps + blk * 4, 16, bar)
    _cp_arrive(bar)
    if lane == 0:
      _tma_tile(sb, tmap, 0, _lds(prod + 24) + kb * n_rows, bar)
      _mbar_arrive_tx(bar, _lds(prod + 28))

  @cute.jit
  def _mbar_spin(self, bar: Int32, parity: Int32, wsb: Int64, ctl: Int32, kb: Int32):
    """A pipeline wait past its first try, bounded by ``header.timeout_ns``. A timeout leaves the K128 block at
    ``CTL_FAULT`` and the loop goes on; after the loop the CTA records (role 2, block, epoch, `abi.WAIT_PIPE`, the
    block) and role 3 sets the call's outputs to NaN (kept out of the loop: this code sits among the MMAs of the
    two-CTA variants, at their 128-register cap)."""
    # In units of 1024 ns, 32-bit (wraps after 73 minutes): the spin sits inside the MMA loop of two-CTA variants
    # at their 128-register cap, where 64-bit time values spilled.
    bound = Int32(v1._ld(wsb + abi.HEADER["timeout_ns"], cutlass.Uint64) >> 10)
    start = Int32(cute.arch.globaltimer() >> 10)
    ready = Int32(0)
    elapsed = Int32(0)
    while (ready == 0) & (elapsed <= bound):
      ready = _mbar_try(bar, parity)
      elapsed = Int32(cute.arch.globaltimer() >> 10) - start
    if ready == 0:
      _sts(ctl + CTL_FAULT, kb)

  @cute.jit
  def _cpasync_mainloop(self, nt: cutlass.Constexpr, n_st: cutlass.Constexpr, st_bytes: cutlass.Constexpr,
                        pw_e: Int64, psc_e: Int64, row0: Int32, n_rows: cutlass.Constexpr, kb_n: cutlass.Constexpr,
                        nblk: cutlass.Constexpr, planes: Int64, exps: Int64, ctl: Int32, pipe: Int32,
                        rows_fast: Int32, acc: cute.Tensor, single: cutlass.Constexpr = False, pair=None,
                        kpair: cutlass.Constexpr = False, pre=None, tw=None, bf16=None):
    """The K loop of the per-thread producer (sm_90a): every thread issues cp.async copies of the stages ahead and
    the CTA meets at a barrier per stage, or per two stages in narrow passes (``single``: a one-row pass, whose
    padding slots are never read, so only slot 0's B rows are copied; ``pair``: 2 for a pass of two rows, 4 for
    one of three or four, see `_stage`).

    ``kpair`` (`RoleKernelsV2.kpair`, a pass of ``single`` = 1 or 2 rows): a stage holds the item's 64 rows of two
    K128 tiles (`kpair_tile`, `_issue`), the first as rows 0-63 of the tile and B slots 0-3, the second as rows
    64-127 and slots 4-7; warps 0-3 accumulate theirs, warps 4-7 store each block's p to the room after the last
    stage, and after the next barrier warps 0-3 add those in block order (`_kpair_add`).

    ``pre`` (an Int32, `w_early`): 1 where `_w_ahead` copied the prologue's weights and scale words already.

    ``tw`` (`RoleKernelsV2.tma_w`: the TensorMap, the tile's first row in it, the workspace and the epoch): the
    weight tiles by TMA onto the slots' ``full`` mbarriers (`_issue`, `_weights_landed`).

    ``bf16`` (`RoleKernelsV2.bf16`, a wide pass; ``planes`` then the BF16 planes): the stages' B in wgmma's layout
    (`_issue_x_bf16`) and `_stage_bf16`, which ORs into ``bf16[0]`` where a stage's weight scales leave the fold."""
    slots = 8 * nt
    n_copy = 1 if cutlass.const_expr(single) else slots
    if cutlass.const_expr(kpair or (self.three_cta and single)):
      n_copy = single  # (`three_cta`: a two-row pass of its own copies both slots' B rows)
    n_kb = kb_n // 2 if cutlass.const_expr(kpair) else kb_n  # stages
    tabs = ctl if cutlass.const_expr(self.smem_tables) else None
    # Narrow passes meet at a barrier every TWO stages (`PAIRED_BARRIER_NT`): their stages are short (a one-row
    # stage is ~150 instructions per warp), and at GLM5.2 B = 1 the per-stage barrier was the largest stall reason
    # (19.5 % of role 2's samples, docs/kernels_v2.md). The copies run one stage less ahead for it, and n_st >= 6
    # keeps the wait below at n_st - 4 >= 2 stages in flight.
    per_bar = self._per_bar(nt, n_st, n_kb)
    assert bf16 is None or per_bar == 1  # (the paired steps' copies below issue int8 B only)
    kpair_bar = per_bar if cutlass.const_expr(kpair) else 0  # (`_issue`: stages of two half tiles)
    pbuf = pipe + n_st * st_bytes  # (`kpair`: the warps' p, two sets by barrier step)
    p_set = WARPS // 2 * per_bar * KPAIR_P_BYTES
    src = None
    if cutlass.const_expr(not kpair and self.ablation != "copyaddr"):
      src = self._copy_sources(pw_e, psc_e, row0, n_copy, ctl)
    bars = ctl + CTL_BARS
    if cutlass.const_expr(single == 1 and self.block_lanes):
      self._block_lane_zeros(pipe, n_st, st_bytes)
    for s in cutlass.range_constexpr(n_st - per_bar):
      if s < n_kb:
        self._issue(s, pipe + s * st_bytes, slots, pw_e, psc_e, row0, n_rows, kb_n, nblk, planes, exps, ctl, n_copy,
                    kpair_bar, None if cutlass.const_expr(pre is None) else 1 - pre, src,
                    tma=_slot_tma(tw, bars, s, n_st), bf16=bf16 is not None)
      _commit()
    for kq in range(n_kb // per_bar):
      kb = kq * per_bar
      _wait_group(n_st - 2 * per_bar)  # stages kb .. kb + per_bar - 1 have landed (this thread's copies)
      if cutlass.const_expr(bf16 is not None):
        _fence_async_smem()  # the copies wrote through the generic proxy; wgmma reads through the async one
      if cutlass.const_expr(tw is not None):
        for q in cutlass.range_constexpr(per_bar):
          self._weights_landed(kb + q, bars + 8 * ((kb + q) % n_st), tw, ctl, n_st)
      cute.arch.sync_threads()  # ... everyone's, and every warp is done with the stages the next copies overwrite
      if cutlass.const_expr(kpair):
        if kq > 0:
          self._kpair_add(acc, pbuf + ((kq - 1) % 2) * p_set, per_bar)
      # This step's scale words before its copies: the copies write SMEM, so ptxas keeps a load after them in program
      # order, and there it waited behind the MIO queue they fill (`GCMOE_ABLATION=scalelate`: the form before). Only
      # where the step's stages take one fast-path test (`pair_test`): in the shared-expert variants the words held
      # across the copies cost ptxas 92 B of spills at the two-CTA cap (GLM5.2 T8).
      scws = None
      if cutlass.const_expr(self.ablation != "scalelate" and per_bar % 2 == 0 and self.pair_test):
        scws = tuple(self._scale_words(pipe + ((kb + q) % n_st) * st_bytes) for q in range(per_bar))
      mid = None
      # (a step's stages all in range or all past the K loop: even depth and stage count; the mid copies take their
      # sources from `_copy_sources`, which `kpair` and `GCMOE_ABLATION=copyaddr` passes go without)
      whole_steps = per_bar > 1 and n_st % per_bar == 0 and n_kb % per_bar == 0
      if cutlass.const_expr(self.copy_mid and per_bar == 2 and whole_steps and src is not None):
        # The step's copies but the second stage's weights before its compute, those between its two stages
        # (`_stages`); the step's two commit groups are waited for together, so how its copies split between them
        # does not matter.
        nk = kb + n_st - per_bar
        live = nk < n_kb
        if live:
          self._issue(nk, pipe + (nk % n_st) * st_bytes, slots, pw_e, psc_e, row0, n_rows, kb_n, nblk, planes,
                      exps, ctl, n_copy, kpair_bar, src=src)
          self._issue(nk + 1, pipe + ((nk + 1) % n_st) * st_bytes, slots, pw_e, psc_e, row0, n_rows, kb_n, nblk,
                      planes, exps, ctl, n_copy, kpair_bar, src=src, parts="x")
        _commit()
        # (the slot's address again, not one value: held from here to the mid copies, ptxas spilled 24 B, not 12)
        mid = (nk + 1, pipe + ((nk + 1) % n_st) * st_bytes, pw_e, row0, n_rows, kb_n, src,
               cutlass.select_(live, Int32(16), Int32(0)))
      elif cutlass.const_expr(self.copy_block and whole_steps):
        # The step's stages are all in range or all past the K loop, so one test covers their copies, which then lie
        # in one basic block: ptxas builds the shared window's base once for them (S2R SR_CgaCtaId, one per stage
        # before) and the second stage's addresses in other registers than the first's.
        if kb + n_st - per_bar < n_kb:
          for q in cutlass.range_constexpr(per_bar):
            nk = kb + n_st - per_bar + q
            self._issue(nk, pipe + (nk % n_st) * st_bytes, slots, pw_e, psc_e, row0, n_rows, kb_n, nblk, planes,
                        exps, ctl, n_copy, kpair_bar, src=src, tma=_slot_tma(tw, bars, nk, n_st), bf16=bf16 is not None)
            _commit()
        else:
          for q in cutlass.range_constexpr(per_bar):
            _commit()
      else:
        for q in cutlass.range_constexpr(per_bar):
          nk = kb + n_st - per_bar + q
          if nk < n_kb:
            self._issue(nk, pipe + (nk % n_st) * st_bytes, slots, pw_e, psc_e, row0, n_rows, kb_n, nblk, planes,
                        exps, ctl, n_copy, kpair_bar, src=src, tma=_slot_tma(tw, bars, nk, n_st), bf16=bf16 is not None)
          _commit()
      p_out = pbuf + (kq % 2) * p_set if cutlass.const_expr(kpair) else None
      if cutlass.const_expr(bf16 is not None):
        for q in cutlass.range_constexpr(per_bar):
          self._stage_bf16(nt, pipe + ((kb + q) % n_st) * st_bytes, acc, bf16)
      elif cutlass.const_expr(per_bar % 2 == 0 and self.pair_test):
        for q2 in cutlass.range_constexpr(0, per_bar, 2):  # (`bar4`: two pairs between barriers)
          self._compute(nt, (pipe + ((kb + q2) % n_st) * st_bytes, pipe + ((kb + q2 + 1) % n_st) * st_bytes),
                        rows_fast, acc, single, tabs, pair, p_out, q2, per_bar,
                        None if cutlass.const_expr(scws is None) else scws[q2:q2 + 2], mid)
      else:
        for q in cutlass.range_constexpr(per_bar):
          self._compute(nt, (pipe + ((kb + q) % n_st) * st_bytes,), rows_fast, acc, single, tabs, pair, p_out, q,
                        per_bar, None if cutlass.const_expr(scws is None) else scws[q:q + 1])
    _wait_group(0)
    cute.arch.sync_threads()  # the pipeline area is free: the epilogue reuses it
    if cutlass.const_expr(tw is not None):
      tid, _, _ = cute.arch.thread_idx()
      if tid == 0:
        stuck = _lds(ctl + CTL_FAULT)
        if stuck >= 0:
          bid, _, _ = cute.arch.block_idx()
          v1._record_fault(tw[2], 2, bid, tw[3], Int32(abi.WAIT_PIPE), stuck)
        for s in cutlass.range_constexpr(n_st):
          _mbar_inval(bars + 8 * s)
    if cutlass.const_expr(kpair):
      self._kpair_add(acc, pbuf + ((n_kb // per_bar - 1) % 2) * p_set, per_bar)

  @cute.jit
  def _block_lane_zeros(self, pipe: Int32, n_st: cutlass.Constexpr, st_bytes: cutlass.Constexpr):
    """Zeros in the `BL_X` / `BL_Y` columns of every stage that no copy of a one-row pass writes (`block_lanes`). The
    previous pass's stages and epilogue are done (the barrier at the end of each chunk), no copy targets these
    bytes, and the K loop's first barrier orders these stores before any warp's loads."""
    tid, _, _ = cute.arch.thread_idx()
    c = tid % BL_CHUNKS
    if cutlass.select_(block_lane_kept(c), Int32(0), Int32(1)) != 0:
      for i in cutlass.range_constexpr((n_st * BL_CHUNKS + THREADS - 1) // THREADS):
        st = (tid + i * THREADS) // BL_CHUNKS
        if st < n_st:
          _sts4(pipe + st * st_bytes + W_BYTES + SC_BYTES + 8 * 16 + c * 16, 0, 0, 0, 0)

  @cute.jit
  def _any_mainloop(self, rows: cutlass.Constexpr, e: Int32, pw_e: Int64, psc_e: Int64, row0: Int32, planes: Int64,
                    exps: Int64, wsb: Int64, cur: Int32, ctl: Int32, pipe: Int32, acc: cute.Tensor):
    """The K loop of a `kbany` pass (a routed GEMM2 item of ``rows`` = 1 or 2 rows that did not wait for its
    expert's GEMM1 items): K128 stage kb needs only GEMM1 items 2 kb and 2 kb + 1 (``act`` blocks 4 kb .. 4 kb + 3),
    so each stage waits for those two alone. Each copy group of the per-thread pipeline (`_cpasync_mainloop`'s: a
    CTA barrier every two groups, ``n_st - 2`` groups in flight) holds one stage or none, chosen by warp 0 before the
    barrier that precedes its copies (`_any_pick`, which polls the items' tags, `abi.Workspace.g1tags`). A one-row
    pass takes its stages in the order they become ready: each block's exact product p goes to SMEM
    (`_any_compute`), and after the last stage lanes t4 = 0, 1 add their row's p in increasing K: ``fadd(acc, p)``
    in the order of `_stage`'s FMAs, so the bits are `_cpasync_mainloop`'s (the `kpair` argument: on the fast path
    the product is exact). A two-row pass, whose p would not fit beside the pipeline, takes them in K order into
    its accumulators as `_stage`'s two-row body does. A stage takes the fast path where its scale bytes allow and
    neither of its GEMM1 items flagged a block slow."""
    warp, lane, g, t4 = _lanes()
    kb_n = self.v.intermediate // v1.K128
    st = any_stage_bytes(rows)
    n_st = self._any_stages(rows)
    ahead = n_st - 2  # copy groups in flight
    pbuf = pipe + n_st * st
    tags = wsb + self.ws.g1tags + Int64(e) * (self.j1 * 8)
    if warp == 0:
      self._any_pick(rows, Int32(0), ahead, 0, tags, e, wsb, cur, ctl)
    cute.arch.sync_threads()
    for q in cutlass.range_constexpr(ahead):
      sig = _lds(ctl + CTL_ANY_SIG + 4 * q)
      if sig >= 0:
        self._issue(sig & 0xFF, pipe + q * st, 8, pw_e, psc_e, row0, self.v.hidden, kb_n, self.nblk_i, planes,
                    exps, ctl, rows)
      _commit()
    stop = _lds(ctl + CTL_ANY + 12)
    done = Int32(0)
    kb = Int32(0)  # the first copy group of this barrier step
    while (done < kb_n) & (stop == 0):
      _wait_group(ahead - 2)  # groups kb, kb + 1 have landed (this thread's copies)
      if warp == 0:
        self._any_pick(rows, kb + ahead, 2, ahead, tags, e, wsb, cur, ctl)
      cute.arch.sync_threads()  # everyone's copies of groups kb, kb + 1; the groups before them read
      stop = _lds(ctl + CTL_ANY + 12)
      for q in cutlass.range_constexpr(2):
        sig = _lds(ctl + CTL_ANY_SIG + 4 * ((kb + ahead + q) % ANY_SIG_RING))
        if sig >= 0:
          self._issue(sig & 0xFF, pipe + ((kb + ahead + q) % n_st) * st, 8, pw_e, psc_e, row0, self.v.hidden, kb_n,
                      self.nblk_i, planes, exps, ctl, rows)
        _commit()
      for q in cutlass.range_constexpr(2):
        sig = _lds(ctl + CTL_ANY_SIG + 4 * ((kb + q) % ANY_SIG_RING))
        if sig >= 0:
          self._any_compute(rows, pipe + ((kb + q) % n_st) * st, sig, pbuf, acc, ctl)
          done = done + 1
      kb = kb + 2
    _wait_group(0)
    cute.arch.sync_threads()  # every stage computed; the pipeline area is the epilogue's
    if cutlass.const_expr(rows == 1):
      total = Int32(0)
      if t4 < 2:
        for k in cutlass.range_constexpr(kb_n):
          p = _lds4(pbuf + (k * ANY_P_BYTES + warp * 256 + (2 * g + t4) * 16))
          for s in cutlass.range_constexpr(v1.SUBS):
            total = v1._fadd(total, p[s])
      acc[0] = total

  @cute.jit
  def _any_pick(self, rows: cutlass.Constexpr, g0: Int32, n: cutlass.Constexpr, span: cutlass.Constexpr, tags: Int64,
                e: Int32, wsb: Int64, cur: Int32, ctl: Int32):
    """Warp 0 of a `kbany` pass: the stages of copy groups g0 .. g0 + n - 1 (`CTL_ANY_SIG`: the stage, plus 256 where
    it takes the slow path; -1 for none): the lowest ready stages not yet issued, or with ``rows`` = 2 the next
    stages in K order while they are ready. Where none is left to issue and at most `any_poll_pending` stages are
    pending in the ``span`` groups in flight before g0, it polls the GEMM1 items' tags once, or, with none pending,
    until one is ready (bounded: a timeout records ``WAIT_GEMM1 + e`` with the stages ready, and stops the pass)."""
    lane = cute.arch.lane_idx()
    kb_n = self.v.intermediate // v1.K128
    issued = _lds(ctl + CTL_ANY)
    ready = _lds(ctl + CTL_ANY + 4)
    slow = _lds(ctl + CTL_ANY + 8)
    stop = Int32(0)
    next_ = ~issued & (issued + 1)  # the lowest stage not issued (1 << kb_n once all are)
    wanted = next_ if cutlass.const_expr(rows == 2) else ~issued
    if ((ready & wanted) == 0) & (next_ != (1 << kb_n)):
      pending = Int32(0)  # stages in the groups still to compute (counted only here: most steps have a stage)
      for q in cutlass.range_constexpr(span):
        pending = pending + cutlass.select_(_lds(ctl + CTL_ANY_SIG + 4 * ((g0 - span + q) % ANY_SIG_RING)) >= 0,
                                            Int32(1), Int32(0))
      if pending <= self.any_poll_pending:
        ready, slow, stop = self._any_poll(tags, wanted, pending, e, wsb, cur)
    for q in cutlass.range_constexpr(n):
      sig = Int32(-1)
      low = ready & ~issued
      if cutlass.const_expr(rows == 2):
        low = low & (issued + 1)  # the next stage in K order, if ready
      else:
        low = low & (0 - low)  # the lowest ready stage not issued
      if low != 0:
        kb = v1._popc(low - 1)
        sig = kb | (((slow >> kb) & 1) << 8)
        issued = issued | low
      if lane == 0:
        _sts(ctl + CTL_ANY_SIG + 4 * ((g0 + q) % ANY_SIG_RING), sig)
    if lane == 0:
      _sts(ctl + CTL_ANY, issued)
      _sts(ctl + CTL_ANY + 4, ready)
      _sts(ctl + CTL_ANY + 8, slow)
      _sts(ctl + CTL_ANY + 12, stop)

  @cute.jit
  def _any_poll(self, tags: Int64, wanted: Int32, pending: Int32, e: Int32, wsb: Int64, cur: Int32):
    """Warp 0: (the K128 stages whose two GEMM1 items are done, those of them with a slow block, 1 where the pass
    stops) from the tags (`_any_tags`); read once, or, where nothing is ``pending``, until a ``wanted`` stage is
    ready, another CTA faulted or the bound passed. The tags' acquire loads order the stages' copies, issued after
    the CTA barrier that follows, after the items' blocks (each tag is stored after a fence); a fence here, among
    the pipeline's copies in flight, might wait for them."""
    lane = cute.arch.lane_idx()
    ready, slow = self._any_tags(tags, cur)
    fault = Int32(0)
    if pending == 0:
      # In units of 1024 ns, 32-bit, as `_mbar_spin` (this sits among the MMA loop's values).
      bound = Int32(v1._ld(wsb + abi.HEADER["timeout_ns"], cutlass.Uint64) >> 10)
      start = Int32(cute.arch.globaltimer() >> 10)
      elapsed = Int32(0)
      while ((ready & wanted) == 0) & (fault == 0) & (elapsed <= bound):
        cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(v1.SPIN_SLEEP_NS)])
        ready, slow = self._any_tags(tags, cur)
        fault = cute.arch.load(v1._gptr(wsb + abi.HEADER["error_flag"]), Int32, sem="relaxed", scope="gpu")
        elapsed = Int32(cute.arch.globaltimer() >> 10) - start
    stop = Int32(0)
    if ((ready & wanted) == 0) & (pending == 0):
      stop = Int32(1)
      if (fault == 0) & (lane == 0):
        bid, _, _ = cute.arch.block_idx()
        v1._record_fault(wsb, 2, bid, cur, Int32(abi.WAIT_GEMM1) + e, ready)
    return ready, slow, stop

  @cute.jit
  def _any_tags(self, tags: Int64, cur: Int32):
    """Warp 0, lane kb reading stage kb's two tags: (the stages whose GEMM1 items are both done, those of them with
    a slow block), as bit masks."""
    lane = cute.arch.lane_idx()
    rd = Int32(0)
    sl = Int32(0)
    if lane < self.v.intermediate // v1.K128:
      d0, s0, d1, s1 = _ld_tags(tags + Int64(lane) * 16)
      rd = cutlass.select_((d0 == cur) & (d1 == cur), Int32(1), Int32(0))
      sl = rd & (s0 | s1)
    return v1._ballot(rd), v1._ballot(sl)

  @cute.jit
  def _any_compute(self, rows: cutlass.Constexpr, sb: Int32, sig: Int32, pbuf: Int32, acc: cute.Tensor, ctl: Int32):
    """One stage of a `kbany` pass (``sig``: the K128 stage, plus 256 for the slow path) in `_stage`'s one- or
    two-row body; one row: each block's p kept (``p_only``) and stored to SMEM by lanes t4 = 0, 1 (rows g, g + 8),
    16 B per lane; two rows: added to the accumulators, the stages coming in K order."""
    warp, lane, g, t4 = _lanes()
    scw = (_lds(sb + self.w_bytes + (16 * warp + g) * 4), _lds(sb + self.w_bytes + (16 * warp + g + 8) * 4))
    bits = (scw[0] ^ (scw[0] << 1)) & (scw[1] ^ (scw[1] << 1))
    fast = _warp_any((sig >= 256) | ((bits & SCALE_BYTE_BITS) != SCALE_BYTE_BITS)) == 0
    if cutlass.const_expr(rows == 1):
      pv = cute.make_rmem_tensor(v1.SUBS, Int32)
      if fast:
        self._stage(True, 1, sb, scw, acc, 1, ctl, pv, 0, True)
      else:
        self._stage(False, 1, sb, scw, acc, 1, ctl, pv, 0, True)
      if t4 < 2:
        _sts4(pbuf + ((sig & 0xFF) * ANY_P_BYTES + warp * 256 + (2 * g + t4) * 16), pv[0], pv[1], pv[2], pv[3])
    else:
      if fast:
        self._stage(True, 1, sb, scw, acc, 2, ctl)
      else:
        self._stage(False, 1, sb, scw, acc, 2, ctl)

  @cute.jit
  def _kpair_add(self, acc: cute.Tensor, pset: Int32, per_bar: cutlass.Constexpr):
    """Warps 0-3 of a `kpair` pass: ``acc[0] += p`` of the blocks warp w + 4 computed between the last two barriers,
    stage by stage and block by block (in increasing K: `kpair_tile`); the same lane held the same (row, slot)."""
    warp, lane, _, _ = _lanes()
    if warp < WARPS // 2:
      for r in cutlass.range_constexpr(per_bar):
        p = _lds4(_kpair_p(pset, warp, per_bar, r, lane))
        for s in cutlass.range_constexpr(v1.SUBS):
          acc[0] = v1._fadd(acc[0], p[s])

  def _scale_words(self, sb: Int32):
    """This thread's rows' (g and g + 8 of its warp's 16) scale words of the stage at ``sb``."""
    warp, _, g, _ = _lanes()
    return (_lds(sb + self.w_bytes + (16 * warp + g) * 4), _lds(sb + self.w_bytes + (16 * warp + g + 8) * 4))

  @cute.jit
  def _compute(self, nt: cutlass.Constexpr, sbs, rows_fast: Int32, acc: cute.Tensor,
               single: cutlass.Constexpr = False, ctl=None, pair=None, p_out=None, r0: cutlass.Constexpr = 0,
               per_bar: cutlass.Constexpr = 1, scws=None, mid=None):
    """The MMAs of the stages at ``sbs`` (one, or the two between paired barriers with `pair_test`): this thread's
    rows' scale words, then the fast or the slow path of `_stage` (``pair`` 2 or 4: its two- or four-row body), the
    fast one only where every thread of the warp may take it.
    Two stages take ONE fast-path test (fast where both stages' scale bytes allow it, else both slow: the same bits,
    `_stage`) and one choice of body, so that both bodies lie in one basic block and ptxas may overlap the second
    stage's loads, decode and MMAs with the first's epilogue.
    ``p_out`` (a `kpair` pass): the set of p of this barrier step, where warp w >= 4 stores its blocks' p of stage
    r0 + r of the step (`_kpair_p`). ``scws``: the stages' `_scale_words`, where the caller loaded them already.
    ``mid`` (`RoleKernelsV2.copy_mid`): copies that `_stages` issues between the two stages (`_issue_mid`)."""
    warp, lane, g, t4 = _lanes()
    if cutlass.const_expr(scws is None):
      scws = tuple(self._scale_words(sb) for sb in sbs)
    pv = None
    if cutlass.const_expr(p_out is not None):
      pv = cute.make_rmem_tensor(v1.SUBS * len(sbs), Int32)
    if cutlass.const_expr(self.ablation == "nomath"):
      for i in cutlass.range_constexpr(len(scws)):
        acc[0] = acc[0] + scws[i][0] + scws[i][1]  # keeps the scale loads; no decode, MMA or epilogue
    elif cutlass.const_expr(self.qmma):
      for i in cutlass.range_constexpr(len(sbs)):
        self._stage_qmma(nt, sbs[i], scws[i], acc)
    else:
      bits = (scws[0][0] ^ (scws[0][0] << 1)) & (scws[0][1] ^ (scws[0][1] << 1))
      for i in cutlass.range_constexpr(1, len(scws)):
        bits = bits & (scws[i][0] ^ (scws[i][0] << 1)) & (scws[i][1] ^ (scws[i][1] << 1))
      if _warp_any((rows_fast == 0) | ((bits & SCALE_BYTE_BITS) != SCALE_BYTE_BITS)) == 0:
        # (a warp's vote: each thread tests its own rows, and the bodies hold mma.sync.aligned, which the whole warp
        # must run together; the slow body gives the fast one's bits wherever both apply)
        self._stage_body(True, nt, sbs, scws, acc, single, ctl, pair, pv, mid)
      else:
        self._stage_body(False, nt, sbs, scws, acc, single, ctl, pair, pv, mid)
    if cutlass.const_expr(p_out is not None):
      if warp >= WARPS // 2:
        for r in cutlass.range_constexpr(len(sbs)):
          _sts4(_kpair_p(p_out, warp - WARPS // 2, per_bar, r0 + r, lane),
                *(pv[v1.SUBS * r + s] for s in range(v1.SUBS)))

  @cute.jit
  def _stage_body(self, fast: cutlass.Constexpr, nt: cutlass.Constexpr, sbs, scws, acc: cute.Tensor,
                  single: cutlass.Constexpr, ctl, pair, pv=None, mid=None):
    """`_stage` of each stage at ``sbs`` in its two-row body when ``pair`` (run time) is 2, its four-row body when
    4, else in the pass's own: one choice for all of them."""
    if cutlass.const_expr(pair is not None):
      if pair == 2:
        self._stages(fast, nt, sbs, scws, acc, 2, ctl, mid=mid)
      elif cutlass.const_expr(self.four_row):
        if pair == 4:
          self._stages(fast, nt, sbs, scws, acc, 4, ctl, mid=mid)
        else:
          self._stages(fast, nt, sbs, scws, acc, single, ctl, mid=mid)
      else:
        self._stages(fast, nt, sbs, scws, acc, single, ctl, mid=mid)
    else:
      self._stages(fast, nt, sbs, scws, acc, single, ctl, pv, mid)

  def _stages(self, fast: bool, nt: int, sbs, scws, acc: cute.Tensor, single: int, ctl, pv=None, mid=None) -> None:
    """`_stage` of each stage at ``sbs`` in turn, in one body (traced, so the calls are inlined in order); ``mid``:
    `_issue_mid`'s copies after the first."""
    for r, (sb, scw) in enumerate(zip(sbs, scws)):
      self._stage(fast, nt, sb, scw, acc, single, ctl, pv, v1.SUBS * r)  # (``pv``: stage r's p from pv[4 r])
      if mid is not None and r == 0:
        self._issue_mid(*mid)

  @cute.jit
  def _weights_landed(self, kb: Int32, full: Int32, tw, ctl: Int32, n_st: cutlass.Constexpr):
    """`RoleKernelsV2.tma_w`: this thread waits for block ``kb``'s weight tile (its slot's ``full`` phase), bounded."""
    par = (kb // n_st) & 1
    if _mbar_try(full, par) == 0:
      self._mbar_spin(full, par, tw[2], ctl, kb)

  @cute.jit
  def _issue_mid(self, kb: Int32, sb: Int32, pw_e: Int64, row0: Int32, n_rows: cutlass.Constexpr,
                 kb_n: cutlass.Constexpr, src, nbytes: Int32):
    """`RoleKernelsV2.copy_mid`: the weight chunks of block ``kb`` into the stage at ``sb`` and the commit of its
    copy group, without a branch (``nbytes`` 0 past the K loop: the copies then read nothing and zero-fill a slot
    whose stage every warp has consumed)."""
    self._issue_w(kb, sb, pw_e, Int64(0), row0, n_rows, 0, src[0], scales=False, nbytes=nbytes)
    _commit()

  @cute.jit
  def _stage(self, fast: cutlass.Constexpr, nt: cutlass.Constexpr, sb: Int32, scw, acc: cute.Tensor,
             single: cutlass.Constexpr = 0, ctl=None, pv=None, p0: cutlass.Constexpr = 0,
             p_only: cutlass.Constexpr = False):
    """The MMAs and the exact epilogue of one K128 stage: ``acc += f32(D_b) * 2**n_b`` for its four K32 blocks.

    D = S0 + 2**6 S1 + 2**12 S2 comes out of a chain of three MMAs: S1; T + MAGIC = A B0 + (64 S1 + MAGIC);
    S2 + MAGIC = A B2 + MAGIC. f32(T) and f32(S2) are exact float subtractions of the magic and f32(D) =
    RN(4096 f32(S2) + f32(T)) is one FMA (= cvt.rn of D). Fast path (``n + 127`` in [1, 226] everywhere, see
    `SCALE_BYTE_BITS`): ``acc = fma(f32(D), 2**n, acc)`` rounds like v1's mul + add because the product is exact
    and normal. Slow path: v1's two-step scaling, NaN blocks and add.

    ``single`` (a pass of one row, the usual one at decode batches: every expert of GLM5.2 at B = 1): the three
    digit planes of the row go in the columns of ONE n-tile, so a block takes one split-decode MMA pair instead of
    three and one B load instead of three, and the epilogue of a block is one row's per lane: lane t4 = 0 row g,
    lane t4 = 1 row g + 8 (S0, S1 in its own columns, S2 by one shuffle from lane t4 = 2 or 3): the same integers,
    the same float operations, the same bits, accumulated in ``acc[0]`` of those lanes (the pass moves row g + 8 to
    lane t4 = 0's ``acc[2]``, slot 0's, after the K loop); the other lanes' accumulators hold junk, which the
    epilogues never read (their slots are padding). ``single`` = 2: a pass of two rows in the same way, each lane
    of a quad one (slot, row) (`PLANE_COLUMNS`, `PAIR_SLOT_COLUMNS`). ``single`` = 4: a pass of three or four rows
    in two n-tiles' columns, lane t4 the two rows of slot t4 (`QUAD_SLOT_COLUMNS`). ``ctl``: the control area, whose
    `CTL_TABLES` the decode reads; None: the tables as immediates. ``pv`` (a `kpair` pass, ``single`` 1 or 2): each
    block's p also to ``pv[p0 + s]``, the B operand of warps 4-7 from slots 4-7 (`_cpasync_mainloop`); with
    ``p_only`` (a `kbany` pass, ``single`` = 1) only there, ``acc`` untouched, every warp's B from slot 0
    (`_any_compute`).
    """
    warp, lane, g, t4 = _lanes()
    slots = 8 * nt
    xe_off = W_BYTES + SC_BYTES
    xp_off = xe_off + slots * 16
    if cutlass.const_expr(pv is not None and not p_only):  # (`kpair`; a `kbany` pass's stage holds slot 0 alone)
      half = warp // (WARPS // 2)
      xe_off = xe_off + half * (4 * 16)
      xp_off = xp_off + half * (4 * TOKEN_STRIDE)
    magic4 = (Int32(MAGIC), Int32(MAGIC), Int32(MAGIC), Int32(MAGIC))
    zero4 = (Int32(0), Int32(0), Int32(0), Int32(0))
    # The one-, two- and four-row bodies' MMA pairs start at MAGIC in the even columns (plane 0's, and plane 2's
    # that the epilogue reads) and at 0 in the odd ones (plane 1's): S0 and S2 come out as the words MAGIC + S, and
    # MAGIC + T = 64 S1 + (MAGIC + S0) is one IMAD, the same int32 as before (no step of the chains wraps: |S| <
    # 2**15), so the same bits, two integer adds fewer per block (`GCMOE_ABLATION=unbiased`: the adds, for A/B).
    biased = self.ablation != "unbiased"
    c_row = (Int32(MAGIC), Int32(0), Int32(MAGIC), Int32(0)) if biased else zero4
    words = _weight_words(sb, warp, lane)
    tabs = DECODE_TABLES
    if cutlass.const_expr(ctl is not None):
      tabs = tuple(_lds(ctl + CTL_TABLES + 4 * q) for q in range(len(DECODE_TABLES)))

    def block(i, s, mma):
      """Block s of n-tile i: ``mma(b, c)`` = A B + C for this block's weights."""
      if cutlass.const_expr(self.smem_tables):
        wb = (_scale_byte(scw[0], s), _scale_byte(scw[1], s))
      else:
        wb = (((scw[0] >> (8 * s)) & 0xFF), ((scw[1] >> (8 * s)) & 0xFF))
      xp = sb + xp_off + (8 * i + g) * TOKEN_STRIDE + s * BLOCK_BYTES + 8 * t4
      b0 = _lds2(xp)
      b1 = _lds2(xp + 32)
      b2 = _lds2(xp + 64)

      def exps():
        """Exponent words of block s of this thread's two columns (slots 8 i + 2 t4 and + 1)."""
        return (_lds(sb + xe_off + (8 * i + 2 * t4) * 16 + 4 * s),
                _lds(sb + xe_off + (8 * i + 2 * t4 + 1) * 16 + 4 * s))

      if cutlass.const_expr(self.ablation == "twoplane" and nt > SPLIT_DECODE_NT):
        # Timing only (wrong results): the instruction mix of two FP16 digit planes (docs/kernels_v2.md "A candidate
        # against the epilogue bound"): 4 MMAs and B loads per block, f32(D) from the two sums by one FMA, then the
        # scaled add; the int8 MMAs stand in for m16n8k16 HMMA. Both chains start at MAGIC so their sums are normal
        # floats (MAGIC + S) and the FMA (p1 * -1 + p0 = S_a - S_b) cancels the offsets: finite values of the
        # digits' size, so no block falls to the NaN or exceptional-exponent paths, whose time would swamp the mix.
        b3 = _lds2(xp + 16)
        xe = exps()
        p0 = mma(b1, mma(b0, magic4))
        p1 = mma(b3, mma(b2, magic4))
        for c in cutlass.range_constexpr(4):
          df = _fma(p1[c], Int32(v1._f32_bits(-1.0)), p0[c])
          acc[4 * i + c] = _scaled_add(fast, df, xe[c % 2], wb[c // 2], acc[4 * i + c])
      else:
        # Plane 0's MMA accumulates onto 64 S1 + MAGIC, so it waits for plane 1's. Starting it from MAGIC and adding
        # 64 S1 by one IMAD (the same int32, so the same bits) was measured on the H200: bit-identical, mixed at
        # B <= 32, 0.6-3 % slower at every B >= 64 (docs/kernels_v2.md "Independent plane chains"): not kept.
        s1 = mma(b1, zero4)
        r0 = mma(b0, tuple(s1[c] * (1 << abi.DIGIT_BITS) + MAGIC for c in range(4)))
        r2 = mma(b2, magic4)
        xe = exps()
        for c in cutlass.range_constexpr(4):
          xw = xe[c % 2]
          tf = v1._fadd(r0[c], MAGIC_NEG)
          sf = v1._fadd(r2[c], MAGIC_NEG)
          df = _fma(sf, F32_4096, tf)  # f32(D), rounded once (= cvt.rn.f32.s32 of D)
          acc[4 * i + c] = _scaled_add(fast, df, xw, wb[c // 2], acc[4 * i + c])

    if cutlass.const_expr(single == 1 and self.block_lanes and pv is None):
      # `block_lanes`: B from the `BL_X` / `BL_Y` columns, zero but in block s's own, so the blocks' MMA pairs chain
      # into X (S1 in column 2 s) and Y (MAGIC + S0, MAGIC + S2 in columns 2 s, 2 s + 1) and lane t4 ends with block
      # t4's words of rows g (c 0, 1) and g + 8 (c 2, 3). ``bl_chains`` 2: blocks 0-1 and 2-3 in chains of their own
      # from zero, added after with the magic (each holds zeros in the other's columns; one IADD3 per Y word). Each
      # lane then runs one epilogue per row, and lane t4 = 0 (row g) and 1 (row g + 8) gather the four blocks' p
      # from their quad by three shuffles and add them in K order: the bits of the body below (on the fast path
      # fadd(acc, p) rounds as its FMA, p being exact and normal).
      xb = sb + xp_off + g * 32 + 8 * t4
      xs = [zero4] * self.bl_chains
      ys = [magic4] if cutlass.const_expr(self.bl_chains == 1) else [zero4] * self.bl_chains
      for s in cutlass.range_constexpr(v1.SUBS):
        a_pos, a_neg = _split_fragments(words, s, tabs)
        h = s * self.bl_chains // v1.SUBS
        xs[h] = _split_mma(a_pos, a_neg, _lds2(xb + BL_X + s * BL_BLOCK), xs[h])
        ys[h] = _split_mma(a_pos, a_neg, _lds2(xb + BL_Y + s * BL_BLOCK), ys[h])
      x, y = xs[0], ys[0]
      if cutlass.const_expr(self.bl_chains == 2):
        x = (x[0] + xs[1][0], None, x[2] + xs[1][2], None)
        y = tuple(y[c] + ys[1][c] + MAGIC for c in range(4))
      xw = _lds(sb + xe_off + 4 * t4)  # slot 0's exponent word of block t4
      pick = 0x4440 + t4  # (`_scale_byte` of byte t4)
      p = [_scaled_p(fast, _fma(v1._fadd(y[2 * r + 1], MAGIC_NEG), F32_4096,
                                v1._fadd(_digit_pair(y[2 * r], x[2 * r]), MAGIC_NEG)),
                     xw, _prmt(scw[r], 0, pick)) for r in range(2)]
      odd = (t4 & 1) != 0
      send = cutlass.select_(odd, p[0], p[1])
      own = cutlass.select_(odd, p[1], p[0])
      ra = _shfl_xor(send, 1)  # t4 = 0 <- block 1 of row g, t4 = 1 <- block 0 of row g + 8
      rb = _shfl_xor(own, 2)  # t4 = 0 <- block 2 of row g, t4 = 1 <- block 3 of row g + 8
      rc = _shfl_xor(send, 3)  # t4 = 0 <- block 3 of row g, t4 = 1 <- block 2 of row g + 8
      for v in (cutlass.select_(odd, ra, own), cutlass.select_(odd, own, ra), cutlass.select_(odd, rc, rb),
                cutlass.select_(odd, rb, rc)):
        acc[0] = v1._fadd(acc[0], v)
    elif cutlass.const_expr(single == 1):
      # Columns 0 and 2 hold plane 0, 1 and 3 plane 1, 4-7 plane 2 (lane g reads the plane of column g), so lane
      # t4 = 0 holds S0, S1 of row g and lane t4 = 1 those of row g + 8, and lanes t4 = 2, 3 hold S2 of both rows:
      # one shuffle brings each its S2, and lane t4 = 0 computes row g, lane t4 = 1 row g + 8 (in acc[0]; the pass
      # moves row g + 8 back to lane t4 = 0's acc[2] after the K loop).
      upper = t4 == 1
      scw_row = cutlass.select_(upper, scw[1], scw[0])
      plane = cutlass.select_(g >= 4, Int32(2), g & 1)
      for s in cutlass.range_constexpr(v1.SUBS):
        a_pos, a_neg = _split_fragments(words, s, tabs)
        b = _lds2(sb + xp_off + s * BLOCK_BYTES + plane * 32 + 8 * t4)
        r = _split_mma(a_pos, a_neg, b, c_row)
        xw = _lds(sb + xe_off + 4 * s)  # slot 0's exponent word of block s
        s2 = _shfl_xor(cutlass.select_(t4 == 3, r[2], r[0]), 2)  # t4 = 0 <- S2 (row g), t4 = 1 <- S2 (row g + 8)
        if cutlass.const_expr(biased):
          t = cutlass.select_(upper, _digit_pair(r[2], r[3]), _digit_pair(r[0], r[1]))
        else:
          t = _digit_pair(cutlass.select_(upper, r[2], r[0]), cutlass.select_(upper, r[3], r[1])) + MAGIC
          s2 = s2 + MAGIC
        acc[0] = _row_update(fast, t, s2, xw, scw_row, s, acc[0], pv, p0 + s, p_only)
    elif cutlass.const_expr(single == 2):
      # Columns 0, 1 hold planes 0, 1 of slot 0, columns 2, 3 those of slot 1, 4-5 plane 2 of slot 0 and 6-7 that of
      # slot 1. Each lane of a quad takes one (slot, row): t4 = 0 (0, g), 1 (1, g), 2 (0, g + 8), 3 (1, g + 8); two
      # shuffles bring each the planes it lacks (lanes t4 and t4 ^ 2 trade S0 of row g + 8 for S2 of row g in one).
      # The pass moves the four back to lane t4 = 0 after the K loop.
      lo = t4 < 2
      scw_row = cutlass.select_(lo, scw[0], scw[1])
      col_slot = (g >> 1) & 1
      plane = cutlass.select_(g >= 4, Int32(2), g & 1)
      for s in cutlass.range_constexpr(v1.SUBS):
        a_pos, a_neg = _split_fragments(words, s, tabs)
        b = _lds2(sb + xp_off + col_slot * TOKEN_STRIDE + s * BLOCK_BYTES + plane * 32 + 8 * t4)
        r = _split_mma(a_pos, a_neg, b, c_row)
        xw = _lds(sb + xe_off + (t4 & 1) * 16 + 4 * s)  # this lane's slot's exponent word of block s
        x = _shfl_xor(cutlass.select_(lo, r[2], r[0]), 2)  # t4 < 2 <- S2 (row g); t4 >= 2 <- S0 (row g + 8)
        y = _shfl_xor(r[3], 2)  # t4 >= 2 <- S1 (row g + 8)
        s2 = cutlass.select_(lo, x, r[2])
        if cutlass.const_expr(biased):
          t = cutlass.select_(lo, _digit_pair(r[0], r[1]), _digit_pair(x, y))
        else:
          t = _digit_pair(cutlass.select_(lo, r[0], x), cutlass.select_(lo, r[1], y)) + MAGIC
          s2 = s2 + MAGIC
        acc[0] = _row_update(fast, t, s2, xw, scw_row, s, acc[0], pv, p0 + s)
    elif cutlass.const_expr(single == 4):
      # Slots 0-3 (`QUAD_SLOT_COLUMNS`): per block a split-decode MMA pair on X (planes 0, 1) and one on Y (plane 2),
      # after which lane t4 runs the epilogue of (slot t4, row g) into acc[0] and (slot t4, row g + 8) into acc[1]:
      # two per lane where the 1-tile body runs four, two thirds of its MMAs and B loads. The pass moves them to
      # the 1-tile layout after the K loop. (X's slot-0 plane-1 and slot-1 plane-0 columns share banks: a 2-way
      # conflict in one of the two loads.)
      bx = sb + xp_off + (g >> 1) * TOKEN_STRIDE + 8 * t4
      for s in cutlass.range_constexpr(v1.SUBS):
        a_pos, a_neg = _split_fragments(words, s, tabs)
        b = _lds2(bx + s * BLOCK_BYTES + (g & 1) * 32)
        x = _split_mma(a_pos, a_neg, b, c_row)
        b = _lds2(bx + s * BLOCK_BYTES + 64)
        y = _split_mma(a_pos, a_neg, b, c_row)  # (planes 2 in every column; the even ones', from MAGIC, are read)
        xw = _lds(sb + xe_off + t4 * 16 + 4 * s)  # slot t4's exponent word of block s
        for h in cutlass.range_constexpr(2):
          t = _digit_pair(x[2 * h], x[2 * h + 1])
          s2 = y[2 * h]
          if cutlass.const_expr(not biased):
            t, s2 = t + MAGIC, s2 + MAGIC
          acc[h] = _row_update(fast, t, s2, xw, scw[h], s, acc[h])
    elif cutlass.const_expr(self.split_decode and nt <= SPLIT_DECODE_NT):
      # Narrow passes, where the decode dominates: the split decode, block by block (8 registers), and twice the
      # MMAs (the tensor pipe is ~10 % busy there). Every accumulator still takes its blocks in increasing K.
      for s in cutlass.range_constexpr(v1.SUBS):
        a_pos, a_neg = _split_fragments(words, s, tabs)
        for i in cutlass.range_constexpr(nt):
          block(i, s, lambda b, c: _mma_s8(a_neg, b, _mma_s8(a_pos, b, c)))
    else:
      # Wide passes: the weight fragments decoded once per stage (16 registers) and reused by every n-tile.
      a_all = tuple((_dec4(words[2 * s], tabs), _dec4(words[2 * s + 1], tabs), _dec4(words[2 * s] >> 16, tabs),
                     _dec4(words[2 * s + 1] >> 16, tabs)) for s in range(v1.SUBS))
      for i in cutlass.range_constexpr(nt):
        for s in cutlass.range_constexpr(v1.SUBS):
          block(i, s, lambda b, c: _mma_s8(a_all[s], b, c))

  @cute.jit
  def _stage_qmma(self, nt: cutlass.Constexpr, sb: Int32, scw, acc: cute.Tensor):
    """The sm_120a seam for one K128 stage: four block-scaled QMMAs per n-tile, the K32 block picked by the
    byte-id immediate from the packed scale words (A: this thread's row, g or g + 8 by lane parity; B: the slot's
    word staged in place of the exponent words). The weight fragments are the sm_90a ones, expanded into 8-bit
    containers instead of decoded to integers; the activation fragments are plane 0 (E4M3 codes)."""
    warp, lane, g, t4 = _lanes()
    slots = 8 * nt
    xe_off = self.w_bytes + SC_BYTES
    xp_off = xe_off + slots * 16
    if cutlass.const_expr(self.compact):
      # Compact: the raw nibbles by ldmatrix.b16 (words of 8 codes) and the prmt expansion; the fragment's K order
      # is (8 t4 .. 8 t4 + 3 | 8 t4 + 4 .. 8 t4 + 7), so B is loaded as the 8 bytes at 8 t4.
      words = _weight_words(sb, warp, lane)
      a_all = tuple((_exp4(words[2 * s]), _exp4(words[2 * s + 1]), _exp4(words[2 * s] >> 16),
                     _exp4(words[2 * s + 1] >> 16)) for s in range(v1.SUBS))
    else:
      # Expanded: unpacked by ldmatrix in the MMA's K order (4 t4 .. 4 t4 + 3 | 16 + 4 t4 ..).
      a_all = tuple(_expanded_fragment(sb, warp, lane, s) for s in range(v1.SUBS))
    sfa = cutlass.select_(t4 == 1, scw[1], scw[0])
    for i in cutlass.range_constexpr(nt):
      sfb = _lds(sb + xe_off + (8 * i + g) * 16)
      for s in cutlass.range_constexpr(v1.SUBS):
        xp = sb + xp_off + (8 * i + g) * self.token_stride + s * 32
        if cutlass.const_expr(self.compact):
          b = _lds2(xp + 8 * t4)
        else:
          b = (_lds(xp + 4 * t4), _lds(xp + 16 + 4 * t4))
        d = _qmma(a_all[s], b, (acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]), sfa, sfb, s)
        for c in cutlass.range_constexpr(4):
          acc[4 * i + c] = d[c]

  @cute.jit
  def _issue(self, kb: Int32, sb: Int32, slots: cutlass.Constexpr, pw_e: Int64, psc_e: Int64, row0: Int32,
             n_rows: cutlass.Constexpr, kb_n: cutlass.Constexpr, nblk: cutlass.Constexpr, planes: Int64,
             exps: Int64, ctl: Int32, n_copy: cutlass.Constexpr = -1, per_bar: cutlass.Constexpr = 0, w_on=None,
             src=None, parts: cutlass.Constexpr = "all", tma=None, bf16: cutlass.Constexpr = False):
    """cp.async of K128 block ``kb`` into the stage at ``sb``: weights (swizzled), scales, B planes, exponents (of the
    first ``n_copy`` slots of the stage's ``slots``; -1: all). ``src``: this thread's sources from
    `_copy_sources`, taken once per pass. ``parts`` "x" (`RoleKernelsV2.copy_mid`): all but the weights. ``tma``
    (`RoleKernelsV2.tma_w`: the pass's TensorMap data and the slot's ``full`` mbarrier, `_slot_tma`): the weights by
    one TMA copy from thread 0 onto that mbarrier instead. ``bf16`` (a `RoleKernelsV2.bf16` pass): the B side from
    the BF16 planes at ``planes`` (`_issue_x_bf16`).

    ``per_bar`` > 0 (a `kpair` pass, its stages meeting at a barrier every ``per_bar``): ``kb`` is a stage of two
    half tiles, rows row0 .. row0 + 63 of K128 tile `kpair_tile` (kb, 0) as the stage's rows 0-63 and B slots 0 ..
    n_copy - 1, of tile (kb, 1) as rows 64-127 and slots 4 .. 3 + n_copy. ``w_on`` (an Int32, `w_early`): 0 leaves
    the weights and scales out, `_issue_w` copied them before the item's wait."""
    w_src, x_rows = (None, None) if cutlass.const_expr(src is None) else src
    if cutlass.const_expr(parts == "x" or tma is not None):
      assert w_on is None and w_src is not None and not per_bar
      self._issue_scales(kb, sb, psc_e, row0, n_rows, per_bar, w_src)
    elif cutlass.const_expr(w_on is None):
      self._issue_w(kb, sb, pw_e, psc_e, row0, n_rows, per_bar, w_src)
    else:
      if w_on != 0:
        self._issue_w(kb, sb, pw_e, psc_e, row0, n_rows, per_bar, w_src)
    if cutlass.const_expr(bf16):
      self._issue_x_bf16(kb, sb, slots, nblk, planes, ctl)
    else:
      self._issue_x(kb, sb, slots, nblk, planes, exps, ctl, n_copy, per_bar, x_rows)
    if cutlass.const_expr(tma is not None):
      tid, _, _ = cute.arch.thread_idx()
      if tid == 0:
        (tmap, tile_row, _, _), full = tma
        _tma_tile(sb, tmap, 0, tile_row + kb * n_rows, full)
        _mbar_arrive_tx(full, W_BYTES)

  @cute.jit
  def _copy_sources(self, pw_e: Int64, psc_e: Int64, row0: Int32, n_copy: cutlass.Constexpr, ctl: Int32):
    """This thread's copy sources for a pass's stages (`_issue`, a pass that is not `kpair`'s), as (`_issue_w`'s,
    `_issue_x`'s): ((the global addresses of its weight chunks, of its scale word) at K128 block 0, to which a stage
    adds kb times their stride), and the B rows of the slots whose exponent chunk and plane chunk it copies (None
    where a stage's plane chunks take more than one per thread). The stage loop otherwise rebuilt each 64-bit
    address from the pass's row offsets and read the slot's row back from SMEM behind the stage's weight copies
    (LDGSTS write SMEM, so the read waits for them in order): Nsight Compute put 22 % of the one-row GEMM1 loop's
    samples on those B copies (docs/kernels_v2.md)."""
    tid, _, _ = cute.arch.thread_idx()
    w = []
    for i in cutlass.range_constexpr(W_BYTES // 16 // THREADS):
      c = tid + i * THREADS
      w.append(pw_e + Int64(row0 + c // 4) * v1.FP4_TILE_BYTES + (c % 4) * 16)
    sc = psc_e + Int64(row0 + cutlass.min(tid, TILE_M - 1)) * v1.WORD_BYTES
    x_rows = None
    per_slot = 8 if self.qmma else 4 * BLOCK_BYTES // 16
    if cutlass.const_expr(n_copy * per_slot <= THREADS):
      # (clamped slot indices: a thread past the copies reads a valid word it never uses, without a branch)
      x_rows = (_lds(ctl + CTL_SLOT_SRC + cutlass.min(tid, n_copy - 1) * 4),
                _lds(ctl + CTL_SLOT_SRC + cutlass.min(tid // per_slot, n_copy - 1) * 4))
      if cutlass.const_expr(self.block_lanes and n_copy == 1):
        x_rows = (*x_rows, block_lane_dst(tid))  # (`BL_X`: a one-row pass's plane chunk, placed once per pass)
    return (tuple(w), sc), x_rows

  @cute.jit
  def _issue_w(self, kb: Int32, sb: Int32, pw_e: Int64, psc_e: Int64, row0: Int32, n_rows: cutlass.Constexpr,
               per_bar: cutlass.Constexpr = 0, w_src=None, scales: cutlass.Constexpr = True, nbytes=None):
    """`_issue`'s weights and scale words: what a stage holds that the call's activations do not decide. ``w_src``:
    (the chunks' addresses, the scale word's) at block 0 (`_copy_sources`). ``scales`` False: the weights only
    (`_issue_mid`); ``nbytes`` (an Int32): the weight copies' source bytes, 16 or 0 there."""
    tid, _, _ = cute.arch.thread_idx()
    halves = 2 if cutlass.const_expr(per_bar) else 1
    rows = TILE_M // halves
    assert not (per_bar and self.qmma)
    assert w_src is None or not per_bar
    for i in cutlass.range_constexpr(W_BYTES // 16 // THREADS):
      c = tid + i * THREADS
      row = c // 4
      col = c % 4
      # (row // rows == i: THREADS / 4 rows per pass of this loop)
      src_row = row % rows if cutlass.const_expr(per_bar) else row
      if cutlass.const_expr(w_src is not None):
        src = w_src[0][i] + Int64(kb) * (n_rows * v1.FP4_TILE_BYTES)
      else:
        src = pw_e + (Int64(_stage_tile(kb, i, per_bar)) * n_rows + row0 + src_row) * v1.FP4_TILE_BYTES + col * 16
      if cutlass.const_expr(self.l2ahead):
        _cp16_first(sb + row * 64 + ((col ^ ((row // 2) % 4)) << 4), src, Int32(16) if nbytes is None else nbytes)
      else:
        _cp16(sb + row * 64 + ((col ^ ((row // 2) % 4)) << 4), src, Int32(16) if nbytes is None else nbytes)
    if cutlass.const_expr(scales):
      self._issue_scales(kb, sb, psc_e, row0, n_rows, per_bar, w_src)

  @cute.jit
  def _issue_scales(self, kb: Int32, sb: Int32, psc_e: Int64, row0: Int32, n_rows: cutlass.Constexpr,
                    per_bar: cutlass.Constexpr, w_src):
    """`_issue_w`'s scale words: the stage's `TILE_M` rows' words of its K128 block are one 512-B run of the MN-major
    scales (two runs of 256 B in a `kpair` stage of two half tiles), so each warp's 4-B copies are one 128-B line.
    (16-B copies by one warp would take the same four line requests in fewer instructions, but cost ptxas 44 B more
    spills in the shared-expert variants at the two-CTA cap: GLM5.2 T8 88 B against 44.)"""
    tid, _, _ = cute.arch.thread_idx()
    rows = TILE_M // (2 if cutlass.const_expr(per_bar) else 1)
    if tid < TILE_M:
      if cutlass.const_expr(per_bar):
        src = psc_e + (Int64(_stage_tile(kb, tid // rows, per_bar)) * n_rows + row0 + tid % rows) * v1.WORD_BYTES
      elif cutlass.const_expr(w_src is not None):
        src = w_src[1] + Int64(kb) * (n_rows * v1.WORD_BYTES)
      else:
        src = psc_e + (Int64(kb) * n_rows + row0 + tid) * v1.WORD_BYTES
      _cp4(sb + W_BYTES + tid * 4, src)

  @cute.jit
  def _issue_x_bf16(self, kb: Int32, sb: Int32, slots: cutlass.Constexpr, nblk: cutlass.Constexpr, planes: Int64,
                    ctl: Int32):
    """`_issue`'s B side in a `bf16` pass: K128 block ``kb`` of the slots' BF16 planes, 16-B chunk (block b, k8
    group c) of a slot into wgmma's core matrix (c, slot // 8), row slot % 8 (`BF16_B_BLOCK_BYTES`); padding slots
    zero-filled. Consecutive threads take a slot's 256 consecutive bytes."""
    tid, _, _ = cute.arch.thread_idx()
    nt = slots // 8
    chunks = slots * 16
    for i in cutlass.range_constexpr((chunks + THREADS - 1) // THREADS):
      c = tid + i * THREADS
      if c < chunks:
        slot = c // 16
        q = c % 16
        src_row = _lds(ctl + CTL_SLOT_SRC + slot * 4)
        dst = sb + W_BYTES + SC_BYTES + bf16_b_chunk(slot, q, nt)
        src = planes + (Int64(cutlass.max(src_row, 0)) * nblk + 4 * kb) * BF16_PLANE_BYTES + q * 16
        _cp16(dst, src, cutlass.select_(src_row >= 0, Int32(16), Int32(0)))

  @cute.jit
  def _stage_bf16(self, nt: cutlass.Constexpr, sb: Int32, acc: cute.Tensor, bad: cute.Tensor):
    """One K128 stage of a `bf16` pass: per K32 block s the weights of rows g and g + 8 (the int8 bodies' words,
    `_weight_words`) decoded with the block scale folded in (`_bf16_decode`, `_fold_mult`), two BF16 wgmma from
    zero over the stage's B (`_issue_x_bf16`), and the block's sum added to ``acc`` in K order while the next
    block's wgmma runs; every wgmma of the stage is done at its end (the next copies overwrite it). ``acc[4 i + 2 h
    + p]`` is row 16 warp + g + 8 h, slot 8 i + 2 t4 + p, as in the int8 bodies. ``bad[0]``: nonzero where a scale
    byte of this thread's rows leaves `BF16_BYTE_OK` (the pass then runs its int8 body)."""
    warp, lane, _, _ = _lanes()
    scw = self._scale_words(sb)
    bad[0] = bad[0] | ((scw[0] & BF16_BYTE_MASK) ^ BF16_BYTE_OK) | ((scw[1] & BF16_BYTE_MASK) ^ BF16_BYTE_OK)
    words = _weight_words(sb, warp, lane)
    base = sb + W_BYTES + SC_BYTES
    lbo = nt * 128  # between k8 groups; n8 groups 128 apart
    sums = [None, None]
    for s in cutlass.range_constexpr(v1.SUBS):
      mult = (_fold_mult(scw[0], s), _fold_mult(scw[1], s))
      a = [_bf16_decode(words[2 * s + h], r, mult[h]) for r in range(4) for h in range(2)]
      blk = base + s * (nt * BF16_B_BLOCK_BYTES)
      sums[s % 2] = _wgmma_bf16_block(nt, a, _smem_desc(blk, lbo, 128), _smem_desc(blk + 2 * lbo, lbo, 128))
      if cutlass.const_expr(self.bf16_sets == 1):
        _wgmma_wait_add(nt, 0, acc, sums[s % 2])
      elif cutlass.const_expr(s > 0):
        _wgmma_wait_add(nt, 1, acc, sums[(s - 1) % 2])
    if cutlass.const_expr(self.bf16_sets == 2):
      _wgmma_wait_add(nt, 0, acc, sums[(v1.SUBS - 1) % 2])

  @cute.jit
  def _issue_x(self, kb: Int32, sb: Int32, slots: cutlass.Constexpr, nblk: cutlass.Constexpr, planes: Int64,
               exps: Int64, ctl: Int32, n_copy: cutlass.Constexpr = -1, per_bar: cutlass.Constexpr = 0, x_rows=None):
    """`_issue`'s B side: the exponent chunks and the digit planes of the slots' rows (``x_rows``: this thread's
    exponent and plane chunks' rows, `_copy_sources`; None: read from the slot table here)."""
    tid, _, _ = cute.arch.thread_idx()
    n_copy = slots if cutlass.const_expr(n_copy < 0) else n_copy
    halves = 2 if cutlass.const_expr(per_bar) else 1
    xe_off = W_BYTES + SC_BYTES
    xp_off = xe_off + slots * 16
    if tid < halves * n_copy:
      half, slot, at = 0, tid, tid  # (half, slot) of this thread's exponent chunk, and its place in the stage
      if cutlass.const_expr(per_bar):
        half, slot = tid // n_copy, tid % n_copy
        at = 4 * half + slot
      src_row = _lds(ctl + CTL_SLOT_SRC + slot * 4) if cutlass.const_expr(x_rows is None) else x_rows[0]
      if cutlass.const_expr(self.qmma):
        # One packed UE8M0 word per slot (a padding slot's is never read: its accumulators are dropped).
        if src_row >= 0:
          _cp4(sb + xe_off + at * 16, exps + Int64(src_row) * nblk + 4 * kb)
      else:
        kt = _stage_tile(kb, half, per_bar)
        _cp16(sb + xe_off + at * 16, exps + (Int64(cutlass.max(src_row, 0)) * nblk + 4 * kt) * 4,
              cutlass.select_(src_row >= 0, Int32(16), Int32(0)))
    # The B operand, 16 B chunks: every plane of the stage's four blocks, or (sm_120a) plane 0 only, chunks 0 and 1
    # of each block's six.
    per_slot = 8 if self.qmma else 4 * BLOCK_BYTES // 16
    chunks = halves * n_copy * per_slot
    for i in cutlass.range_constexpr((chunks + THREADS - 1) // THREADS):
      c = tid + i * THREADS
      if c < chunks:
        slot = c // per_slot
        qq = c - slot * per_slot
        half, at = 0, slot
        if cutlass.const_expr(per_bar):
          half, slot = slot // n_copy, slot % n_copy
          at = 4 * half + slot
        src_row = _lds(ctl + CTL_SLOT_SRC + slot * 4) if cutlass.const_expr(x_rows is None) else x_rows[1]
        dst = sb + xp_off + at * self.token_stride + qq * 16
        if cutlass.const_expr(x_rows is not None and len(x_rows) == 3):
          dst = sb + xp_off + x_rows[2]  # (`block_lanes`: a one-row pass, `BL_X`)
        if cutlass.const_expr(self.qmma):
          src = planes + (Int64(cutlass.max(src_row, 0)) * nblk + 4 * kb + qq // 2) * BLOCK_BYTES + (qq % 2) * 16
        else:
          kt = _stage_tile(kb, half, per_bar)
          src = planes + (Int64(cutlass.max(src_row, 0)) * nblk + 4 * kt) * BLOCK_BYTES + qq * 16
        _cp16(dst, src, cutlass.select_(src_row >= 0, Int32(16), Int32(0)))


RoleKernelsV2.role2_tc.set_name_prefix("gcmoe_role2_compute_v2", remove_cutlass_symbol=True, keep_mangled_name=False)
RoleKernelsV2.role1_fused.set_name_prefix("gcmoe_role1_dispatch_fused", remove_cutlass_symbol=True,
                                          keep_mangled_name=False)
