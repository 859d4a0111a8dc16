"""`python -m gcmoe_jax plan`: print the launch geometry (the paper's §4.4 decision chain) of a shape.

Examples:
  python -m gcmoe_jax plan --model glm5.2 --ranks 8 --batch 256
  python -m gcmoe_jax plan --model dsv4.1-flash --ranks 8 --batch 1,2,4,8,16,32,64,128,256 --shared --markdown
  python -m gcmoe_jax plan --model custom --experts 64 --topk 4 --hidden 4096 --intermediate 1024 --batch 32 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from gcmoe_jax import geometry

_CUSTOM_FLAGS = (("experts", "E"), ("topk", "k"), ("hidden", "H"), ("intermediate", "I"))


def _batches(text: str) -> tuple[int, ...]:
  try:
    values = tuple(int(part) for part in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"--batch must be an int or a comma list of ints, got {text!r}") from None
  return values


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds the `plan` command to the CLI's subparsers."""
  p = subparsers.add_parser(
    "plan", help="launch geometry of a shape (paper §4.4)",
    description="Print the launch geometry the GC-MoE decision chain chooses for a shape (paper §4.2-§4.5, §5.1).")
  p.add_argument("--model", required=True, choices=[*geometry.MODELS, "custom"],
                 help="a preset of the paper's Table 4, or custom (then give --experts/--topk/--hidden/--intermediate)")
  p.add_argument("--ranks", type=int, default=8, help="expert-parallel ranks R (default 8)")
  p.add_argument("--batch", type=_batches, required=True,
                 help="tokens per rank B; a comma list (1,2,4) plans each")
  p.add_argument("--shared", action="store_true", help="fuse one shared expert (§4.7)")
  p.add_argument("--device", choices=list(geometry.DEVICES), default="rtx-pro-5000", help="device preset")
  p.add_argument("--dispatch-sms", type=int, default=None,
                 help="dispatch SMs requested (default: the device's, 6); eq. 5 may round it up")
  p.add_argument("--capacity", type=int, default=None, help="per-rank token capacity B_cap (default max(B, 256))")
  custom = p.add_argument_group("custom shape (--model custom)")
  custom.add_argument("--experts", type=int, help="routed experts E")
  custom.add_argument("--topk", type=int, help="routing fan-out k")
  custom.add_argument("--hidden", type=int, help="hidden size H")
  custom.add_argument("--intermediate", type=int, help="expert intermediate size I")
  custom.add_argument("--shared-intermediate", type=int, help="shared expert intermediate size (default I)")
  out = p.add_mutually_exclusive_group()
  out.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
  out.add_argument("--markdown", action="store_true", help="print one Markdown table row per batch")
  p.set_defaults(func=run)


def _problems(args: argparse.Namespace) -> list[geometry.Problem]:
  given = [f"--{flag}" for flag, _ in _CUSTOM_FLAGS if getattr(args, flag) is not None]
  if args.shared_intermediate is not None:
    given.append("--shared-intermediate")
  if args.model != "custom":
    if given:
      verb = "applies" if len(given) == 1 else "apply"
      raise ValueError(f"plan: {', '.join(given)} {verb} only to --model custom, got --model {args.model}")
    return [geometry.Problem.for_model(args.model, R=args.ranks, B=b, shared=args.shared, capacity=args.capacity)
            for b in args.batch]
  missing = [f"--{flag}" for flag, _ in _CUSTOM_FLAGS if getattr(args, flag) is None]
  if missing:
    raise ValueError(f"plan: --model custom requires --experts, --topk, --hidden and --intermediate, "
                     f"got no {', '.join(missing)}")
  if args.shared_intermediate is not None and not args.shared:
    raise ValueError("plan: --shared-intermediate requires --shared, got it without --shared")
  shape = {field: getattr(args, flag) for flag, field in _CUSTOM_FLAGS}
  shared_i = (args.shared_intermediate or args.intermediate) if args.shared else None
  return [geometry.Problem(R=args.ranks, B=b, shared=args.shared, shared_I=shared_i, capacity=args.capacity, **shape)
          for b in args.batch]


def run(args: argparse.Namespace) -> int:
  """Prints the plan(s); returns 0, 1 when a shape is rejected, 2 for unusable arguments."""
  try:
    problems = _problems(args)
  except (TypeError, ValueError) as e:
    print(e, file=sys.stderr)
    return 2
  device = geometry.DEVICES[args.device]
  plans = []
  for problem in problems:
    try:
      plans.append(geometry.plan(problem, device=device, dispatch_sms=args.dispatch_sms))
    except geometry.GeometryError as e:
      print(f"B={problem.B}: {e}", file=sys.stderr)
      return 1
  if args.json:
    dicts = [q.to_dict() for q in plans]
    print(json.dumps(dicts[0] if len(dicts) == 1 else dicts, indent=2))
  elif args.markdown:
    first = plans[0]
    print(f"{first.problem.model}, R={first.problem.R}, "
          f"{'fused shared expert' if first.problem.shared else 'routed'}, {first.device.name}:\n")
    print(geometry.markdown_table(plans))
  else:
    print("\n\n".join(str(q) for q in plans))
  return 0
