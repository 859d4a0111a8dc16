"""Every environment variable gcmoe_jax reads, declared once with its type, default and help (a leaf module).

Read them through `get`; `python -m gcmoe_jax doctor` lists them all, with their values, and names any set
``GCMOE_*``/``GC_MOE_*`` variable that is not one of them (a misspelt setting is otherwise ignored without a word).
Variables that change kernels or geometry enter the kernel variant key and the plan. Two are read by the C++
runtime itself (`GCMOE_DEBUG_TRACE`, `GCMOE_DEBUG_PRIMARY_CTX`, `GCMOE_DEBUG_WHOLE_GREEN`: only the value 1 turns them
on there), so they are declared here for doctor and the docs, and checked to be exactly 0 or 1.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Var:
  name: str
  parse: Callable[[str], Any]
  default: Any
  help: str


_ABLATIONS = ("nomath", "nogemm2", "widedecode", "tma", "static", "evenbodies", "timeline", "nosingle", "twoplane",
              "stagebar", "sharedfirst", "routedfirst", "regpull", "onecta", "nofourrow", "stagetest", "kpair",
              "l2ahead", "wearly", "wearly1", "wearlyl2", "shallow", "spin", "bar4", "kbany", "kbany1",
              "kbanyeager", "trips", "shfree", "unbiased", "copyaddr",
              "scalelate", "copystep", "copyburst", "copymid", "tmaw", "blocklanes", "blocklanes1", "threecta",
              "shnodecode", "lanetab", "smempad", "int8wide", "bf16one", "bf16two", "shbf16")


def _ablation(text: str) -> str:
  # "timeline+NAME": the timeline's stamps in the NAME build (`kernel_ablation`, `timeline_build`).
  name = text[len("timeline+"):] if text.startswith("timeline+") else text
  if name not in ("", *_ABLATIONS) or (name in ("", "timeline") and name != text):
    raise ValueError(f"expected {', '.join(_ABLATIONS)}, timeline+ one of the others, or empty")
  return text


def _wait_ms(text: str) -> int:
  value = int(text)
  if not 0 <= value <= 1_800_000:  # role 2's pipeline waits count the bound in 1024 ns units, in 32 bits
    raise ValueError("expected milliseconds in [0, 1800000] (30 minutes)")
  return value


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise ValueError("expected a positive integer")
  return value


def _one_of(first: str, second: str) -> Callable[[str], str]:
  """A parser of a setting that is one of two words, named by them (`get`'s error: "must be <first> or <second>")."""
  def parse(text: str) -> str:
    if text not in (first, second):
      raise ValueError(f"expected {first} or {second}")
    return text
  parse.__name__ = f"{first} or {second}"
  return parse


_kernels = _one_of("v1", "v2")
_solo_sms = _one_of("compute", "all")
_graph_context = _one_of("green", "stream")
_test_level = _one_of("quick", "full")


def _zero_one(text: str) -> bool:
  if text not in ("0", "1"):  # the C++ runtime reads exactly "1"; "true" there would silently mean off
    raise ValueError("expected 0 or 1")
  return text == "1"


def _bool(text: str) -> bool:
  if text.lower() in ("1", "true", "yes", "on"):
    return True
  if text.lower() in ("0", "false", "no", "off", ""):
    return False
  raise ValueError(f"expected one of 1/0/true/false/yes/no/on/off, got {text!r}")


# `get`'s error says "<NAME> must be <parser name>": each parser's name is what it accepts.
_positive_int.__name__ = "a positive int"
_wait_ms.__name__ = "a number of milliseconds"
_ablation.__name__ = "an ablation name or empty"
_bool.__name__ = "a boolean"
_zero_one.__name__ = "0 or 1"

VARS = {v.name: v for v in (
  Var("GCMOE_FFI_LIBRARY", str, "", "path of libgcmoe_jax_ffi.so to load instead of the installed one"),
  Var("GCMOE_CUBIN_DIR", str, "", "directory of prebuilt role-kernel cubins (python -m gcmoe_jax build-kernels)"),
  Var("GC_MOE_SM120_DISPATCH_SMS", _positive_int, None,
      "SMs requested for the dispatch green context (eq. 5); the compute partition is the aligned rest of the "
      "device. Unset: 2 for a call without peers (its role 1 is one CTA: 128 compute / 4 dispatch SMs on "
      "H100/H200, 104 / 6 on SM120), the paper's 6 for the fused transport (geometry.dispatch_request)"),
  Var("GCMOE_KERNELS", _kernels, "v2", "role-kernel generation: v2 (int8 tensor-core GEMMs, docs/kernels_v2.md) or v1 "
                                       "(the SIMT reference kernels); part of the cubin key"),
  Var("GCMOE_ABLATION", _ablation, "", "benchmarking only, results are WRONG: build role 2 (v2) with one part left "
                                       "out to attribute its time (nomath: no weight decode, MMA or epilogue math "
                                       "per stage; nogemm2: no GEMM2 items; widedecode: the one-plane E2M1 decode "
                                       "in narrow passes too, results exact, for A/B timing; tma: the TMA "
                                       "producer of sm_120a on sm_90a too, results exact, for A/B timing; static: "
                                       "role 2's items by round-robin instead of the item queue, results exact, "
                                       "for A/B timing; evenbodies: no pass bodies of 3 and 6 n-tiles, results "
                                       "exact, for A/B timing; timeline: %globaltimer stamps per role and role-2 "
                                       "item after the workspace, results exact, read by python -m "
                                       "gcmoe_jax.bench.timeline (timeline+NAME: the same stamps in the build of "
                                       "ablation NAME); nosingle: one- and two-row passes as 1-tile passes, "
                                       "results exact, for A/B timing; twoplane: the wide passes' instruction mix "
                                       "of two FP16 digit planes (4 MMAs, a 3-instruction epilogue), results "
                                       "wrong, timing only; stagebar: a CTA barrier per K128 stage in narrow "
                                       "passes too, results exact, for A/B timing; sharedfirst / routedfirst: "
                                       "role 2's queue with the shared expert's items before the routed ones "
                                       "(GEMM1, then GEMM2) / after them in every variant (by default: shared "
                                       "first up to 32 tokens), results exact, for A/B timing; regpull: the "
                                       "fused transport's role 1 pulls by register batches instead of its pull "
                                       "engine, results exact, for A/B timing; onecta: role 2's pass width and "
                                       "CTAs per SM by the rule before session 27 (two CTAs up to capacity 32, "
                                       "else one), results exact, for A/B timing; nofourrow: passes of 3 or 4 "
                                       "rows in the 1-tile body instead of the four-row body, results exact, for "
                                       "A/B timing; stagetest: one fast-path test per K128 stage where two "
                                       "stages share a CTA barrier, results exact, for A/B timing; kpair: "
                                       "GEMM2 items of 64 rows with K split between warp pairs at calls of up to "
                                       "2 tokens, results exact, 5-13 % slower at B = 1-8 on the H200 (session "
                                       "38), for A/B timing; l2ahead: at calls of up to 2 tokens each routed "
                                       "GEMM1 item prefetches the W2 rows of one of the last GEMM2 items into L2 "
                                       "(24 MiB in all) and each GEMM2 item its own before its wait, the routed "
                                       "weight copies marked L2 evict-first, routed variants of up to 8 tokens, "
                                       "results exact, 7-11 % slower at B = 1-2 on the H100 (session 40), for A/B "
                                       "timing; wearly: a routed GEMM2 item of one pass of up to 8 rows copies "
                                       "its first stages' weights into SMEM before it waits for its expert's "
                                       "GEMM1 items; wearly1: also a CTA's first GEMM1 item before the wait for "
                                       "phase 0; wearlyl2: wearly, and the item's other stages prefetched into "
                                       "L2 (the three exact, none faster at B = 1-8 on the H100, up to 8 % "
                                       "slower at B = 4-8, session 41, for A/B timing); shallow: one-tile passes "
                                       "keep 6 pipeline stages, 4 in flight (exact, 1-5 % slower at B = 2-8 on "
                                       "the H100, session 41, for A/B timing); spin: roles 2 and 3 poll with "
                                       "relaxed loads and no nanosleep (exact, within the runs' spread at B = "
                                       "1-8, session 41, for A/B timing); bar4: one-tile passes whose K128 "
                                       "stages come in fours meet at a CTA barrier every four stages, results "
                                       "exact, for A/B timing; kbany: a routed GEMM2 item of one or two rows "
                                       "waits per K128 block for the two GEMM1 items producing it, one of one row "
                                       "taking its stages in the order they become ready and adding the blocks' "
                                       "exact products in K order at the end, routed variants of up to 8 tokens, "
                                       "results exact, 2-13 % slower at B = 1-8 on the H100 (session 44), for "
                                       "A/B timing; kbany1: kbany for "
                                       "one-row items only; kbanyeager: kbany polling at every step that has no "
                                       "stage to issue; trips: the bounded waits load the error flag "
                                       "before the counter's acquire load (one round trip per poll instead of two) "
                                       "and role 2 loads the routes it lists before phase 0, results exact, "
                                       "within 2 % at B = 1-8 on the H100 (sessions 43-44), for A/B timing; "
                                       "shfree: the shared expert's F x F "
                                       "MMA chains of token groups of 8 and 16 start at a constant and drop the "
                                       "Shh and Sll ends after them (MMA chains of two, not four), results "
                                       "exact, within 1 % at B = 4-16 on the H100 (session 44), for A/B "
                                       "timing; unbiased: the one-, two- and four-row bodies' MMA pairs start "
                                       "at zero and the epilogue adds the magic to each block's digit sums (the "
                                       "form before session 46), results exact, for A/B timing; copyaddr: "
                                       "the per-thread producer reads each stage's B-row slots from SMEM and "
                                       "rebuilds its 64-bit copy addresses (the form before session 47), "
                                       "results exact, 1.8-4.2 % slower at B = 1-8 on the H100, for A/B "
                                       "timing; scalelate: the paired stages' scale words loaded after the "
                                       "step's copies (the form before session 47), results exact, for A/B "
                                       "timing; copystep: each stage of a paired step of a routed variant tests "
                                       "its own range before its copies (the form before session 48), results "
                                       "exact, 0.0-3.0 % slower at B = 1-32 on the H100, for A/B timing; "
                                       "copyburst: a paired step's copies all before its compute (routed "
                                       "variants; the form before session 49), results exact, for A/B timing; "
                                       "copymid: a paired step's second-stage weights between its stages in every "
                                       "routed variant (the default only at capacity <= 8), results exact, "
                                       "within the noise at B = 16-64 on the H100, for A/B timing; "
                                       "tmaw: the per-thread producer's weight tiles by TMA onto an mbarrier "
                                       "per slot, results exact, 3.5-11 % slower at B = 1-8 on the H100, for "
                                       "A/B timing; blocklanes: one-row passes with a K32 block per lane of a "
                                       "quad (B rows in zero-padded columns, the four blocks' MMAs accumulating "
                                       "in two chains per operand, one epilogue per lane and stage, the blocks' "
                                       "products gathered in K order by three shuffles), results exact, 3-12 % "
                                       "slower at B = 1-8 on the H100 (session 51), for A/B timing; "
                                       "blocklanes1: the same with one chain per operand, exact, 4-9 % slower; "
                                       "threecta: three role-2 CTAs per SM at 80 registers in the routed one-GPU "
                                       "variants, every pass of one or two rows, results exact, 18-42 % slower at "
                                       "B = 1-2 on the H100 (session 52), for A/B timing; lanetab: the shared "
                                       "expert's E4M3 decode table with a copy per lane (no SMEM bank "
                                       "conflicts), results exact, 0-6 % slower at B = 1-16 "
                                       "with the shared expert on the H100 (session 57), for A/B timing; "
                                       "smempad: the shared variants' role 2 with lanetab's 32 KB more SMEM "
                                       "and the single table, results exact, for A/B timing; int8wide: the routed "
                                       "one-GPU wide passes (17+ rows) on the int8 bodies instead of BF16 wgmma "
                                       "(the default before session 60; the BF16 passes took 6-34 % off the "
                                       "latency at B = 64-256 on the H100), for A/B timing; bf16one / bf16two: "
                                       "the BF16 wide passes with one / two block sums in flight per warpgroup "
                                       "at every CTA count (by default two at one CTA per SM, one at two), for "
                                       "A/B timing; shbf16: the shared expert's token groups of 8 and 16 on "
                                       "BF16 wgmma (the weight scale applied to each block's sum; within the "
                                       "numerics bar, not bit-exact), for A/B timing); "
                                       "part of the cubin key"),
  Var("GCMOE_WAIT_TIMEOUT_MS", _wait_ms, 2000, "bound of every device spin-wait; expiry becomes a Python exception"),
  Var("GCMOE_FIRST_WAIT_TIMEOUT_MS", _wait_ms, 120_000, "bound of the spin-waits of the first call of the fused "
                                                   "transport across processes (a peer process may still be "
                                                   "compiling); never below GCMOE_WAIT_TIMEOUT_MS"),
  Var("GCMOE_SOLO", _bool, True, "one GPU, up to kernels.abi.scan_tokens tokens (8 where k <= 8): the graph holds "
                                 "role 2 alone, which then also checks the ids and combines y (docs/kernels_v2.md "
                                 "\"Role 2 alone at B <= 8\"); 0: roles 1 and 3 run too (A/B timing, debugging)"),
  Var("GCMOE_SOLO_SMS", _solo_sms, "all", "where role 2 alone runs (GCMOE_SOLO): all (the default: the stream's own "
                                           "context over every SM of the device, the item grid scaled to them; "
                                           "3.9-9.1 % faster than compute at B = 1-8 on the H200, session 38) or "
                                           "compute (the compute green context, its item grid sized by that "
                                           "partition: A/B timing)"),
  Var("GCMOE_GRAPH_CONTEXT", _graph_context, "stream", "where roles 1-3 run when the graph holds all three (one "
                                                     "GPU, more tokens than GCMOE_SOLO covers): stream (the default "
                                                     "since session 40: the stream's own context, no green-context "
                                                     "switch; role 2's grid stays the compute partition's and the "
                                                     "runtime checks that role 1 fits beside it; about 2-4 % "
                                                     "faster at B = 16-128 on the H100) or green (the dispatch and "
                                                     "compute green contexts; docs/cuda_runtime.md \"Graph\")"),
  Var("GCMOE_SYNC_CHECK", _bool, False, "synchronise after each CUDA call and raise a device fault at once, also "
                                        "under XLA command buffers, which then leave the call out (tests, "
                                        "debugging); otherwise it is raised by the next call that runs the handler"),
  Var("GCMOE_DEBUG_TRACE", _zero_one, False, "debugging, read by the C++ runtime before the process's first CUDA "
                                             "call: record every graph launch outside a capture "
                                             "(gcmoe_jax.ffi._cuda.debug_trace, docs/cuda_runtime.md \"Debug "
                                             "switches\")"),
  Var("GCMOE_DEBUG_PRIMARY_CTX", _zero_one, False, "debugging, read once by the C++ runtime: every role on the "
                                                   "primary context instead of its green context, the grids still "
                                                   "sized by the partition (docs/cuda_runtime.md \"Debug switches\")"),
  Var("GCMOE_DEBUG_WHOLE_GREEN", _zero_one, False, "debugging, read once by the C++ runtime: the nodes it puts on "
                                                   "the stream's own context (role 2 alone over every SM, "
                                                   "GCMOE_GRAPH_CONTEXT=stream) go on a green context of every SM "
                                                   "instead, to tell the context switch from the SM count "
                                                   "(docs/cuda_runtime.md \"Debug switches\")"),
  Var("GCMOE_TEST_LEVEL", _test_level, "quick", "tests only: quick (the default) or full (adds the long CPU "
                                                "sweeps of the test suite)"),
)}


def get(name: str) -> Any:
  """The value of a declared variable (its default when unset); a malformed value raises naming the variable."""
  var = VARS[name]
  text = os.environ.get(name)
  if text is None or text == "":
    return var.default
  try:
    return var.parse(text)
  except ValueError as e:
    raise ValueError(f"gcmoe_jax: environment variable {name} must be {var.parse.__name__}, got {text!r}: {e}") \
      from None


def timeline_build() -> bool:
  """Whether ``GCMOE_ABLATION=timeline`` or ``timeline+NAME`` (the kernels stamp %globaltimer into a region after the
  workspace)."""
  ablation = get("GCMOE_ABLATION")
  return ablation == "timeline" or ablation.startswith("timeline+")


def kernel_ablation() -> str:
  """The ablation the role kernels build: ``GCMOE_ABLATION``, or NAME of ``timeline+NAME`` (whose stamps
  `timeline_build` adds)."""
  ablation = get("GCMOE_ABLATION")
  return ablation[len("timeline+"):] if ablation.startswith("timeline+") else ablation


PREFIXES = ("GCMOE_", "GC_MOE_")


def snapshot() -> dict[str, dict[str, Any]]:
  """``name -> {value, set, error, help}`` for every declared variable (for doctor): ``value`` is what `get` returns,
  or None with the message in ``error`` where the variable's text is malformed (doctor reports it, not raises)."""
  out = {}
  for name, var in VARS.items():
    try:
      value, error = get(name), None
    except ValueError as e:
      value, error = None, str(e)
    out[name] = {"value": value, "set": bool(os.environ.get(name)), "error": error, "help": var.help}
  return out


def unknown() -> dict[str, str]:
  """The set ``GCMOE_*``/``GC_MOE_*`` environment variables that gcmoe_jax does not read (misspelt settings)."""
  return {k: v for k, v in sorted(os.environ.items()) if k.startswith(PREFIXES) and k not in VARS}
