"""`python -m gcmoe_jax build-kernels`: compile the role kernels of some variants to cubins (no GPU needed).

Examples:
  python -m gcmoe_jax build-kernels --arch sm_90a --out .cubins --variant 512,256,8,4,16
  python -m gcmoe_jax build-kernels --arch sm_90a,sm_120a --out .cubins --variant 6144,2048,32,8,64,2048,128
  python -m gcmoe_jax build-kernels --arch sm_90a --out .cubins --preset tests

Each variant lands in ``OUT/<key>/`` (cubins, PTX, ``meta.json``; see docs/kernels.md); ``OUT/index.json`` lists the
builds. Point ``GCMOE_CUBIN_DIR`` at OUT on the GPU machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import sys
import time

from gcmoe_jax import geometry
from gcmoe_jax.bench import sweep

# The GPU check set (docs/kernels.md): the small test shape (top-1, 4, 8) with and without a shared expert (group
# 128 and 32), and the paper's per-rank shapes GLM5.2 (H 6144, I 2048, E 32, k 8) and DSV4.1-Flash (H 5120,
# I 2304, E 48, k 6) at every token capacity, with and without a shared expert (Is = I, group 128).
_SMALL = (512, 256, 8, 4, 16)
# (H, I, L, k) of the per-rank shapes `bench --model M` runs (`sweep.model_shape`: L = E / its default --ranks).
_PAPER = {name: (s.hidden, s.intermediate, s.experts, s.top_k)
          for name, s in ((n, sweep.model_shape(n)) for n in geometry.MODELS)}
_PAPER_CAPACITIES = (8, 16, 32, 64, 128, 256)
_SHARED_GROUP = 128


def _preset_tests() -> list[tuple[int, ...]]:
  out = []
  for k in (1, 4, 8):  # the small shape at capacities 8 and 16, routed and with a shared expert (groups 128, 32)
    for cap in (8, 16):
      small = (*_SMALL[:3], k, cap)
      out += [small, (*small, 256, 128), (*small, 256, 32)]
  out += [(*_SMALL[:3], k, 256) for k in (1, 4)]  # T > 256 in chunks of 256 (test_cuda.py)
  # Passes of 3-8 n-tiles at capacities 64 (two CTAs per SM) and 256 (one) on every case family (k = 1, 4, 8:
  # test_cuda.py's wide passes).
  out += [(*_SMALL[:3], k, 64) for k in (1, 4, 8)] + [(*_SMALL[:3], 8, 256)]
  out.append((*_SMALL[:3], 4, 16, 384, 128))  # a shared GEMM2 of an odd number of K128 tiles (Is = 384)
  out.append((640, *_SMALL[1:3], 4, 8, 256, 32))  # a one-token half's last K step of one K128 tile of four (H = 640)
  # The shared expert's token groups in 32-row-pass variants (groups of 8, capacity 64) and in one-CTA ones (groups
  # of 16, two n-tiles per weight decode, capacity 256).
  out += [(*_SMALL[:3], 4, cap, 256, g) for cap in (64, 256) for g in (128, 32)]
  for h, i, e, k in _PAPER.values():
    for cap in _PAPER_CAPACITIES:
      out += [(h, i, e, k, cap), (h, i, e, k, cap, i, _SHARED_GROUP)]
  return out


def _preset_paper() -> list[tuple[int, ...]]:
  """The paper's 18 decode points of both models, routed and with the shared expert, as `python -m gcmoe_jax bench
  --model M [--shared]` runs them: the token capacities 8, 16, 32, 64, 128 and 256 hold B = 1..256, and the shared
  expert has the model's own K-group (`geometry.MODELS`: DSV4.1-Flash's is 32)."""
  return [v for name, (h, i, e, k) in _PAPER.items() for cap in _PAPER_CAPACITIES
          for v in ((h, i, e, k, cap), (h, i, e, k, cap, i, geometry.MODELS[name].shared_group))]


def _preset_multigpu() -> list[tuple[int, ...]]:
  """tests/test_multigpu.py and `python -m gcmoe_jax.bench.ep` on 2, 4 and 8 GPUs: the collective transport's local
  op runs k = 1 over R * B * k rows (small shape: E/R = 8, B = 4, k = 1..4: 8 to 128 rows; the paper models at
  L = E / R, B = 1..16: up to 256 rows at R = 2), the owner's shared expert over B rows, and the fused transport's
  variants of the small shape."""
  small = [(512, 256, 8, 1, cap) for cap in _PAPER_CAPACITIES] + [(512, 256, 8, 1, 8, 256, 128)]
  # The fused transport across the GPUs (test_fused_transport_over_all_gpus_equals_the_oracle): L = 8, k = 4, B = 4.
  fused = [(512, 256, 8, 4, 8, None, None, r) for r in (2, 4, 8)]
  return small + fused + [(m.H, m.I, m.E // r, 1, cap) for m in geometry.MODELS.values() for r in (2, 4, 8)
                          for cap in _PAPER_CAPACITIES[1:]]


def _preset_fused() -> list[tuple[int, ...]]:
  """tests/test_fused.py's virtual ranks (the fused transport on one GPU, issue 9): the small shape's E = 8 global
  experts over R = 2 and 4 ranks (L = 4, 2) at k = 1, 4, 8 (the case families' k), 16 tokens per rank, direct and
  relay returns, with a shared expert at R = 2; the ep_worker's shape over two processes (L = 8, k = 4, 4 tokens
  per rank); H = 640, where role 1 pulls without its engine (`roles_v2.RoleKernelsV2.engine`); and both paper
  models' per-rank shapes (L = E / 8: 32 and 48 local experts) at R = 2, i.e. the models scaled to 2 L global
  experts, direct and relay."""
  small = [(512, 256, 8 // r, k, 16, None, None, r, relay) for r in (2, 4) for k in (1, 4, 8)
           for relay in (False, True)]
  small.append((512, 256, 4, 4, 16, 256, 128, 2))
  small.append((512, 256, 8, 4, 8, None, None, 2))  # two processes on one GPU (tests/ep_worker.py, CUDA IPC)
  small.append((640, 256, 4, 4, 16, None, None, 2))  # H = 640: role 1's register-batched pulls (no pull engine)
  paper = [(m.H, m.I, m.E // 8, m.k, 16, None, None, 2, relay) for m in geometry.MODELS.values()
           for relay in (False, True)]
  return small + paper


def _preset_fused_paper() -> list[tuple[int, ...]]:
  """`python -m gcmoe_jax.bench.ep --transport fused` on 2, 4 and 8 GPUs (issue 11): both paper models per rank (L =
  E / R local experts, top-k of the model) at every token capacity, routed, each with the return path the geometry
  picks at B = capacity (as `ffi._cuda.prepare` does)."""
  out = []
  for m in geometry.MODELS.values():
    for r in (2, 4, 8):
      for cap in _PAPER_CAPACITIES:
        relay = geometry.relay_staging(r, cap, cap, m.k, m.E // r, m.H, False)[0]
        out.append((m.H, m.I, m.E // r, m.k, cap, None, None, r, relay))
  return out


PRESETS = {"tests": _preset_tests, "paper": _preset_paper, "multigpu": _preset_multigpu, "fused": _preset_fused,
           "fused-paper": _preset_fused_paper}


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds the `build-kernels` command to the CLI's subparsers."""
  p = subparsers.add_parser(
    "build-kernels", help="compile the role kernels to cubins (CuTe DSL, no GPU needed)",
    description="Compile the three role kernels (of the generation GCMOE_KERNELS selects: v2 by default) of each "
                "variant to cubins with CuTe DSL, into OUT/<key>/ with a meta.json manifest; then set "
                "GCMOE_CUBIN_DIR=OUT on the GPU host.")
  p.add_argument("--arch", default="sm_90a",
                 help="target architecture(s): sm_90a, sm_120a, sm_121a, or a comma list (default sm_90a)")
  p.add_argument("--out", required=True, type=pathlib.Path, help="output directory (a cubin cache; reused)")
  p.add_argument("--variant", action="append", default=[], metavar="H,I,E,k,TCAP[,Is,group][,rR[relay]]",
                 help="one variant: hidden, intermediate, local experts, top-k, token capacity, optionally the "
                      "shared expert's intermediate size and scale group (32 or 128), and optionally rR: R ranks of "
                      "the fused transport (rRrelay: with the relay return path); repeatable")
  p.add_argument("--preset", choices=sorted(PRESETS), action="append", default=[],
                 help="a named set of variants (tests: the GPU check set of docs/kernels.md)")
  p.add_argument("--force", action="store_true", help="rebuild even when OUT holds a matching build")
  p.add_argument("--jobs", type=int, default=1,
                 help="variants compiled at once in worker processes (default 1; 0: one per CPU core)")
  p.add_argument("--json", action="store_true", help="print the manifests' summaries as JSON")
  p.add_argument("--report", type=pathlib.Path, default=None, metavar="FILE",
                 help="write a markdown table of the builds' ptxas resources (registers, SMEM, spills, CTAs per SM) "
                      "and, for sm_120a/sm_121a, whether role 2 fits the RTX PRO 5000's SMEM (docs/sm120.md)")
  p.set_defaults(func=run)


def _variants(args: argparse.Namespace) -> list:
  from gcmoe_jax.kernels.build import Variant

  out = [Variant.parse(text) for text in args.variant]
  for name in args.preset:
    out += [Variant(*fields) for fields in PRESETS[name]()]
  unique = list(dict.fromkeys(out))
  if not unique:
    raise ValueError("build-kernels requires at least one --variant or --preset, got none")
  return unique


def _write_index(out: pathlib.Path, entries: list[dict]) -> None:
  path = out / "index.json"
  try:
    index = {e["key"]: e for e in json.loads(path.read_text())}
  except (OSError, ValueError):
    index = {}
  index.update({e["key"]: e for e in entries})
  tmp = out / f".index.json.{os.getpid()}"
  tmp.write_text(json.dumps(sorted(index.values(), key=lambda e: e["key"]), indent=1) + "\n")
  os.replace(tmp, path)


def _build_one(job: tuple) -> tuple[dict | None, str | None, float]:
  """(manifest, None, seconds) or (None, the build error, seconds) of one (arch, variant, out, force)."""
  from gcmoe_jax.kernels import build

  arch, v, out, force = job
  t = time.perf_counter()
  try:
    return build.compile_variant(arch, v, cache_dir=out, force=force), None, time.perf_counter() - t
  except build.BuildError as e:
    return None, str(e), time.perf_counter() - t


def _summary(meta: dict, arch: str, v, seconds: float, quiet: bool) -> dict:
  sizes = [r["cubin_bytes"] for r in meta["roles"]]
  summary = {"key": meta["key"], "arch": arch, "variant": v.to_dict(), "cubin_bytes": sizes,
             "registers": [r["registers"] for r in meta["roles"]],
             "static_smem": [r["static_smem"] for r in meta["roles"]],
             "dynamic_smem": [r["dynamic_smem"] for r in meta["roles"]],
             "local_bytes": [r["local_bytes"] for r in meta["roles"]],
             # ptxas's spill stores where the build assembled the role (older manifests: the whole frame)
             "spill_bytes": [r.get("spill_bytes", r["local_bytes"]) for r in meta["roles"]],
             "ctas_per_sm": [r.get("ctas_per_sm", 1) for r in meta["roles"]],
             "fp4_weights": meta["roles"][1].get("fp4_weights", "-"),
             "entries": [r["entry"] for r in meta["roles"]], "seconds": round(seconds, 2)}
  if not quiet:
    print(f"{meta['key']:<58} cubins {sum(sizes) / 1024:8.1f} KiB  regs {summary['registers']}  role 2: SMEM "
          f"{summary['dynamic_smem'][1]}+{summary['static_smem'][1]} B, local {summary['local_bytes'][1]} B, "
          f"{summary['ctas_per_sm'][1]} CTA/SM  {summary['seconds']:6.1f} s", flush=True)
  return summary


def _report_rows(summaries: list[dict]) -> list[str]:
  """Markdown rows of `--report`: one per build."""
  dev = geometry.RTX_PRO_5000
  head = ("| variant | arch | registers (roles 1/2/3) | role 2 SMEM (dynamic + static) | local bytes (roles 1/2/3) "
          "| spilled bytes (roles 1/2/3) | CTAs/SM built | FP4 weights (tile_n at B = capacity) "
          "| fits 100 KB/SM at that c | paper eq. 9 S_role2 at B = capacity (c) | within eq. 9 |")
  rows = [head, "| " + " | ".join(["---"] * 11) + " |"]
  for s in sorted(summaries, key=lambda s: (s["arch"], s["key"])):
    v = s["variant"]
    smem = s["dynamic_smem"][1] + s["static_smem"][1]
    c = s["ctas_per_sm"][1]
    fits = "-"
    model = "-"
    within = "-"
    tile_n = geometry.select_tile_n(geometry.rows_per_expert(v["capacity"], v["top_k"], v["experts"]))[0]
    fp4 = f"{s.get('fp4_weights', '-')} ({tile_n})" if s["arch"].startswith("sm_12") else s.get("fp4_weights", "-")
    if s["arch"].startswith("sm_12"):
      fits = "yes" if geometry.ctas_per_sm(smem, 256, dev) >= c else "**no**"
      p = geometry.Problem(R=1, E=v["experts"], k=v["top_k"], B=v["capacity"], H=v["hidden"], I=v["intermediate"],
                           shared=v["shared_intermediate"] is not None, shared_I=v["shared_intermediate"])
      pl = geometry.plan(p, device=dev)
      model = f"{pl.smem.role2} B ({pl.launch.ctas_per_sm})"
      # Whether the kernel's dynamic SMEM stays inside the paper's role-2 model for the same point (eqs. 9-12).
      within = "yes" if s["dynamic_smem"][1] <= pl.smem.role2 else f"no (+{s['dynamic_smem'][1] - pl.smem.role2} B)"
    shared = f" + shared Is{v['shared_intermediate']} g{v['shared_group']}" if v["shared_intermediate"] else ""
    ranks = v.get("ranks", 1)
    fused = f", R {ranks}{' relay' if v.get('relay') else ''}" if ranks > 1 else ""
    name = f"H{v['hidden']} I{v['intermediate']} E{v['experts']} k{v['top_k']} T{v['capacity']}{shared}{fused}"
    rows.append(f"| {name} | {s['arch']} | {' / '.join(map(str, s['registers']))} | {s['dynamic_smem'][1]} + "
                f"{s['static_smem'][1]} | {' / '.join(map(str, s['local_bytes']))} | "
                f"{' / '.join(map(str, s['spill_bytes']))} | {c} | {fp4} | {fits} | {model} | {within} |")
  return rows


def run(args: argparse.Namespace) -> int:
  from gcmoe_jax.kernels import build

  try:
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in build.ARCHS]
    if bad or not archs:
      raise ValueError(f"build-kernels: --arch must name some of {build.ARCHS}, got {args.arch!r}")
    variants = _variants(args)
  except ValueError as e:
    print(f"build-kernels: {e}", file=sys.stderr)
    return 2
  try:
    import cutlass  # noqa: F401
  except ImportError as e:
    print(f"build-kernels: CuTe DSL is not importable ({e}); `pip install nvidia-cutlass-dsl` (no GPU needed)",
          file=sys.stderr)
    return 1
  if args.jobs < 0:
    print(f"build-kernels: --jobs must be >= 0, got {args.jobs}", file=sys.stderr)
    return 2
  t0 = time.perf_counter()
  summaries = []
  jobs = [(arch, v) for arch in archs for v in variants]
  workers = min(len(jobs), args.jobs or os.cpu_count() or 1)
  if workers > 1:
    # Each worker compiles whole variants; builds land by atomic rename, so concurrent builds cannot collide.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
      results = pool.map(_build_one, [(arch, v, args.out, args.force) for arch, v in jobs])
      for (arch, v), (meta, error, seconds) in zip(jobs, results):
        if error:
          print(f"build-kernels: {error}", file=sys.stderr)
          return 1
        summaries.append(_summary(meta, arch, v, seconds, args.json))
  else:
    for arch, v in jobs:
      meta, error, seconds = _build_one((arch, v, args.out, args.force))
      if error:
        print(f"build-kernels: {error}", file=sys.stderr)
        return 1
      summaries.append(_summary(meta, arch, v, seconds, args.json))
  _write_index(args.out, summaries)
  if args.report is not None:
    args.report.write_text("\n".join(_report_rows(summaries)) + "\n")
  total_bytes = sum(sum(s["cubin_bytes"]) for s in summaries)
  total_s = time.perf_counter() - t0
  if args.json:
    print(json.dumps({"builds": summaries, "cubin_bytes": total_bytes, "seconds": round(total_s, 2)}, indent=1))
  else:
    print(f"{len(summaries)} builds in {args.out}: cubins {total_bytes / 2**20:.2f} MiB, {total_s:.1f} s")
  return 0
