"""`python -m gcmoe_jax bench`: latency of `gcmoe_jax.moe` against BF16 JAX MoEs and the weight-streaming floor.

Examples:
  python -m gcmoe_jax bench                                   # demo layer, B = 1, 8 (about a minute on 2 CPU cores)
  python -m gcmoe_jax bench --model glm5.2 --shared --out bench-glm          # per-rank GLM5.2, B = 1 .. 256
  python -m gcmoe_jax bench --model dsv4.1-flash --batch 1,16,256 --impl ragged_dot,gcmoe:cuda --iters 50
  python -m gcmoe_jax bench --model custom --experts 16 --hidden 2048 --intermediate 1024 --topk 4 --batch 1,4
  python -m gcmoe_jax bench --model glm5.2 --batch 16,64 --impl gcmoe:cuda --bandwidth 2800 \\
    --ab GCMOE_GRAPH_CONTEXT=green --ab GCMOE_GRAPH_CONTEXT=stream --rounds 2      # A/B in one machine session

Writes ``bench_<model>.csv`` and ``bench_<model>.png`` to ``--out`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

_CUSTOM_FLAGS = ("experts", "hidden", "intermediate", "topk")


def _ints(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(part) for part in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be an int or a comma list of ints, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
  return tuple(part.strip() for part in text.split(",") if part.strip())


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds the `bench` command to the CLI's subparsers."""
  from gcmoe_jax import geometry
  from gcmoe_jax.bench import sweep

  p = subparsers.add_parser(
    "bench", help="latency sweep against BF16 baselines and the weight-streaming floor (CSV, PNG, table)",
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="demo", choices=["demo", *geometry.MODELS, "custom"],
                 help="demo (a reduced layer, the default), a paper preset per rank, or custom")
  p.add_argument("--ranks", type=int, default=sweep.DEFAULT_RANKS,
                 help="expert-parallel ranks R of a preset: E / R experts are local (default 8)")
  p.add_argument("--batch", type=_ints, default=None,
                 help="tokens per call B, a comma list (default: 1,8 for demo/custom, 1,2,4,...,256 for presets)")
  p.add_argument("--shared", action="store_true", help="add the shared expert (MXFP8; BF16 in the baselines)")
  p.add_argument("--impl", type=_names, default=None,
                 help=f"comma list from {','.join(sweep.IMPLS)} (default: the baselines, emulated, and gcmoe:<b> "
                      "for every backend available here)")
  p.add_argument("--iters", type=int, default=10,
                 help="timed pairs of runs per point; the median is reported (default 10)")
  p.add_argument("--warmup", type=int, default=2,
                 help="untimed pairs of runs before timing, the first compiles (default 2)")
  p.add_argument("--clamp", type=float, default=None, help="SwiGLU clamp (default: none)")
  p.add_argument("--seed", type=int, default=0, help="weights and routes seed")
  p.add_argument("--max-gather-gib", type=float, default=sweep.DEFAULT_MAX_GATHER_BYTES / 2**30,
                 help="skip dense_gather when one slot's gathered BF16 weights exceed this (default 8)")
  p.add_argument("--bandwidth", type=float, default=None,
                 help="memory bandwidth in GB/s for the floor, instead of measuring it")
  p.add_argument("--bandwidth-mib", type=int, default=None,
                 help="buffer of the bandwidth probe in MiB (default 64 on CPU, 1024 on accelerators)")
  p.add_argument("--fp8-tflops", type=float, default=None,
                 help="dense FP8 GEMM rate in TFLOP/s for the compute floor, instead of measuring it")
  p.add_argument("--chain", type=int, default=sweep.DEFAULT_CHAIN,
                 help=f"layers chained in one timed program (default {sweep.DEFAULT_CHAIN}; see the module docs)")
  p.add_argument("--back-to-back", type=int, default=sweep.DEFAULT_BACK_TO_BACK,
                 help=f"programs dispatched back to back in the shorter run of each timed pair, each on the "
                      f"previous one's output, so the host's dispatch overlaps the device's work; the longer run "
                      f"dispatches twice as many, and their difference is the latency without what a run pays once "
                      f"(default {sweep.DEFAULT_BACK_TO_BACK})")
  p.add_argument("--out", default="bench-results", help="directory for the CSV and PNG (default bench-results)")
  p.add_argument("--ab", action="append", default=[], metavar="SETTING",
                 help="run the sweep once per --ab, each in its own process with SETTING's space-separated "
                      "NAME=VALUE variables set ('' for the environment as it is), alternating for --rounds, and "
                      "report each point's latency per setting and its change against the first "
                      "(gcmoe_jax/bench/ab.py); repeat it, at least twice")
  p.add_argument("--rounds", type=int, default=None,
                 help="with --ab: rounds of the settings, alternating (default 2)")
  custom = p.add_argument_group("custom shape (--model custom)")
  custom.add_argument("--experts", type=int, help="local experts E")
  custom.add_argument("--hidden", type=int, help="hidden size H")
  custom.add_argument("--intermediate", type=int, help="expert intermediate size I")
  custom.add_argument("--topk", type=int, help="routing fan-out k")
  custom.add_argument("--shared-intermediate", type=int, help="shared expert intermediate size (default I)")
  p.set_defaults(func=run)


def _shape(args: argparse.Namespace):
  from gcmoe_jax import geometry
  from gcmoe_jax.bench import sweep

  given = [f"--{flag}" for flag in _CUSTOM_FLAGS if getattr(args, flag) is not None]
  if args.shared_intermediate is not None:
    given.append("--shared-intermediate")
  if args.model != "custom":
    if given:
      raise ValueError(f"bench: {', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to --model "
                       f"custom, got --model {args.model}")
    shape = sweep.model_shape(args.model, ranks=args.ranks, shared=args.shared, clamp=args.clamp)
    batches = args.batch or ((1, 8) if args.model == "demo" else geometry.DECODE_BATCHES)
    return shape, batches
  missing = [f"--{flag}" for flag in _CUSTOM_FLAGS if getattr(args, flag) is None]
  if missing:
    raise ValueError(f"bench: --model custom requires --experts, --hidden, --intermediate and --topk, got no "
                     f"{', '.join(missing)}")
  if args.shared_intermediate is not None and not args.shared:
    raise ValueError("bench: --shared-intermediate requires --shared, got it without --shared")
  shared_i = (args.shared_intermediate or args.intermediate) if args.shared else None
  shape = sweep.BenchShape("custom", args.experts, args.hidden, args.intermediate, args.topk, shared_i,
                           clamp=args.clamp)
  return shape, args.batch or (1, 8)


def _child_argv(args: argparse.Namespace) -> list[str]:
  """The arguments of one sweep of an A/B run: every option the parent was given, but --ab, --rounds and --out."""
  argv = ["--model", args.model, "--ranks", str(args.ranks), "--iters", str(args.iters), "--warmup",
          str(args.warmup), "--seed", str(args.seed), "--max-gather-gib", repr(args.max_gather_gib), "--chain",
          str(args.chain), "--back-to-back", str(args.back_to_back)]
  if args.batch is not None:
    argv += ["--batch", ",".join(map(str, args.batch))]
  if args.impl is not None:
    argv += ["--impl", ",".join(args.impl)]
  if args.shared:
    argv.append("--shared")
  for flag in ("clamp", "bandwidth", "bandwidth_mib", "fp8_tflops", *_CUSTOM_FLAGS, "shared_intermediate"):
    value = getattr(args, flag)
    if value is not None:
      argv += ["--" + flag.replace("_", "-"), repr(value) if isinstance(value, float) else str(value)]
  return argv


def _run_ab(args: argparse.Namespace) -> int:
  from gcmoe_jax.bench import ab

  try:
    settings = [ab.parse_setting(text) for text in args.ab]
    _shape(args)  # the sweep's own argument errors, before any child runs
    rounds = 2 if args.rounds is None else args.rounds
    results = ab.run(_child_argv(args), settings, rounds, args.out, args.model)
  except ValueError as e:
    print(e, file=sys.stderr)
    return 2
  except RuntimeError as e:
    print(e, file=sys.stderr)
    return 1
  print(f"\nlatency per layer, us: the mean over {rounds} round(s), each round's median in brackets; the change "
        f"against setting 0's mean\n")
  print(ab.to_markdown(results, settings))
  path = os.path.join(args.out, f"ab_{args.model}.csv")
  ab.write_csv(results, settings, path)
  print(f"\nwrote {path} (each sweep's CSV and PNG under {os.path.join(args.out, 'ab')})")
  return 0


def run(args: argparse.Namespace) -> int:
  """Runs the sweep (with --ab: one per setting, in child processes) and writes the reports; returns 0, 2 for
  unusable arguments, or 1 where a sweep of an A/B failed."""
  if args.ab:
    return _run_ab(args)
  if args.rounds is not None:
    print(f"bench: --rounds applies only with --ab, got --rounds {args.rounds} without it", file=sys.stderr)
    return 2
  import jax

  import gcmoe_jax as gm
  from gcmoe_jax.bench import sweep

  try:
    shape, batches = _shape(args)
    impls = args.impl or sweep.default_impls()
    sweep.check_impls(impls)
    sweep.check_counts(batches, iters=args.iters, chain=args.chain, back_to_back=args.back_to_back)
  except (TypeError, ValueError, RuntimeError) as e:
    print(e, file=sys.stderr)
    return 2
  device = jax.devices()[0]
  print(f"gcmoe_jax {gm.__version__} on jax {jax.__version__}, device: {device.device_kind} "
        f"({jax.default_backend()}, {os.cpu_count()} host CPUs)")
  print(shape.describe())
  print(f"B = {','.join(map(str, batches))}; impls = {','.join(impls)}; latency per layer: median over "
        f"{args.iters} pairs of runs of {args.back_to_back} and {2 * args.back_to_back} back-to-back "
        f"{args.chain}-layer programs (the difference), after {args.warmup} warm-up pairs")
  probes = {}
  if args.bandwidth is None:  # measured here, not in `sweep.run`, so that every probe's reading is printed
    print("measuring the memory bandwidth", file=sys.stderr)
    probes = sweep.bandwidth_probes(None if args.bandwidth_mib is None else args.bandwidth_mib << 20)
  try:
    rows = sweep.run(shape, batches, impls, iters=args.iters, warmup=args.warmup, seed=args.seed,
                     bandwidth=max(probes.values()) if probes else args.bandwidth * 1e9,
                     fp8_rate=None if args.fp8_tflops is None else args.fp8_tflops * 1e12, chain=args.chain,
                     back_to_back=args.back_to_back, max_gather_bytes=int(args.max_gather_gib * 2**30))
  except (TypeError, ValueError) as e:
    print(e, file=sys.stderr)
    return 2
  bw = rows[0].bandwidth if rows else float("nan")
  rate = rows[0].fp8_rate if rows else float("nan")
  how = "given" if args.bandwidth is not None else "measured"
  how_rate = "given" if args.fp8_tflops is not None else "measured"
  print(f"\n{how} memory bandwidth: {bw / 1e9:.1f} GB/s; {how_rate} dense FP8 GEMM rate: {rate / 1e12:.1f} TFLOP/s "
        f"(floor = max(weight bytes touched / bandwidth, 6 H I per assignment / FP8 rate))")
  if probes:
    print("bandwidth probes, GB/s (the fastest is the floor's): "
          + ", ".join(f"{name} {v / 1e9:.1f}" for name, v in probes.items()))
  print()
  print(sweep.to_markdown(rows))
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f"bench_{args.model}")
  sweep.write_csv(rows, stem + ".csv")
  written = [stem + ".csv"]
  try:
    sweep.plot(rows, stem + ".png", title=f"{shape.describe()}\n{device.device_kind}, {bw / 1e9:.0f} GB/s")
    written.append(stem + ".png")
  except ImportError:
    print("matplotlib is not installed: no plot (pip install 'gcmoe_jax[bench]')", file=sys.stderr)
  print(f"\nwrote {', '.join(written)}")
  return 0
