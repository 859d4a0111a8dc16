"""``python -m gcmoe_jax accuracy``: cosine to the dense BF16 MoE over the paper's case families."""

from __future__ import annotations

import argparse
import dataclasses


def register(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("accuracy", help="cosine of the operator to the dense BF16 MoE over the case families",
                     description=__doc__)
  p.add_argument("--backend", default="auto", choices=("auto", "cuda", "cpu", "reference"))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tokens", type=int, default=None, help="tokens per case (default: the demo shape's)")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  from gcmoe_jax.bench import accuracy
  from gcmoe_jax.bench.problems import DEMO_SHAPE

  shape = DEMO_SHAPE if args.tokens is None else dataclasses.replace(DEMO_SHAPE, tokens=args.tokens)
  print(f"shape: E={shape.experts} H={shape.hidden} I={shape.intermediate} k={shape.top_k} T={shape.tokens} "
        f"clamp={shape.clamp}, shared Is={shape.shared_intermediate or shape.intermediate} group "
        f"{shape.shared_group}, backend {args.backend}, seed {args.seed}")
  ok = True
  for normalize, title in ((False, "router weights: the chosen experts' softmax probabilities over all E experts"),
                           (True, "router weights: renormalised over the k chosen experts (sum 1)")):
    results = accuracy.run(shape, backend=args.backend, seed=args.seed, normalize=normalize)
    print(f"\n{title}\n")
    print(accuracy.to_markdown(results))
    ok = ok and all(r.ok for r in results if not (normalize and r.variant == "shared" and r.top_k == 1))
  return 0 if ok else 1
