"""``python -m gcmoe_jax demo``: one decode step of a reduced GLM5.2-like MoE layer."""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np


def register(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("demo", help="run one jit-compiled decode step of a reduced GLM5.2-like MoE layer",
                     description=__doc__)
  p.add_argument("--backend", default="auto", choices=("auto", "cuda", "cpu", "reference"))
  p.add_argument("--tokens", type=int, default=None, help="decode tokens (default: the demo shape's 8)")
  p.add_argument("--iters", type=int, default=20, help="timed calls after warm-up")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  import gcmoe_jax as gm
  from gcmoe_jax.bench import accuracy
  from gcmoe_jax.bench.problems import DEMO_SHAPE, make_problem

  shape = DEMO_SHAPE if args.tokens is None else dataclasses.replace(DEMO_SHAPE, tokens=args.tokens)
  s = shape
  print(f"gcmoe_jax {gm.__version__} on jax {jax.__version__}, device: {jax.devices()[0].device_kind}")
  print(f"layer: E={s.experts} H={s.hidden} I={s.intermediate} top-{s.top_k} shared Is={s.shared_intermediate} "
        f"(group {s.shared_group}), clamp={s.clamp}, T={s.tokens} decode tokens  "
        f"(GLM5.2 reduced: E 256, H 6144, I 2048, top-8)")
  p = make_problem("default", shape, seed=0)
  x, w, routes = _inputs(gm, p)
  print(gm.explain(args.backend))
  step = jax.jit(lambda x, w, r: gm.moe(x, w, r, clamp=s.clamp, backend=args.backend))
  y = step(x, w, routes).block_until_ready()
  times = []
  for _ in range(args.iters):
    t0 = time.perf_counter()
    step(x, w, routes).block_until_ready()
    times.append(time.perf_counter() - t0)
  y_ref = accuracy.bf16_reference(p)
  print(f"cosine to the dense BF16 MoE: {accuracy.cosine(np.asarray(y, np.float32), y_ref):.6f} "
        f"(paper bar: >= 0.99 with the shared expert)")
  print(f"time per call: median {1e3 * float(np.median(times)):.3f} ms over {args.iters} calls "
        f"(backend {gm.explain(args.backend).backend!r})")
  return 0


def _inputs(gm, p):
  import jax.numpy as jnp
  w = gm.quantize_experts(p.w13, p.w2, shared=p.shared, shared_group=p.shape.shared_group)
  return jnp.asarray(p.x, jnp.bfloat16), w, gm.Routes(jnp.asarray(p.ids), jnp.asarray(p.weights))
