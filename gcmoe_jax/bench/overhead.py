"""The CUDA runtime's own cost: the same 3-node green-context graph with trivial role bodies (issue 5).

The trivial cubins (csrc/kernels/trivial_roles.cu: empty roles 1 and 2, role 3 advances the epoch) take the real
kernel parameters, so the measured time is the runtime's: parameter updates, graph replay on two green contexts
and the finalize node, and the header mirror. Usage on a GPU machine:

  python -m gcmoe_jax.bench.overhead --cubins DIR   # DIR holds trivial_role{1,2,3}.cubin
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np


def measure(cubin_dir: pathlib.Path, calls: int = 200) -> dict[str, float]:
  from gcmoe_jax import formats, reference
  from gcmoe_jax.ffi import _cuda, _moe
  from gcmoe_jax.kernels import abi

  h, i, e, k, t = 512, 256, 8, 4, 8
  ws = abi.workspace_layout(e, t, k, h, False)
  # Grids: 1, one CTA per compute SM, one per token (0 = the runtime's choice).
  _cuda.register_raw("trivial", (t, 6, 10**9, ws.total, ws.silu_table), (1, 32, 0, 0, 32, 0, 0, 32, 0),
                     [(cubin_dir / f"trivial_role{r}.cubin").read_bytes() for r in (1, 2, 3)], reference.silu_table())
  rng = np.random.default_rng(0)
  w = formats.quantize_experts(rng.standard_normal((e, h, 2 * i)).astype(np.float32),
                               rng.standard_normal((e, i, h)).astype(np.float32))
  ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
  rw = jnp.ones((t, k), jnp.float32)
  attrs = _moe.MoeAttrs.from_weights(w, k, None, variant="trivial")
  shared = _moe.no_shared_operands()

  def layer(x):
    return _moe.moe_ffi(x, w.w13, w.w13_scale, w.w2, w.w2_scale, ids, rw, *shared, attrs=attrs)

  # A straight chain of `calls` layers in one jit (no loop: XLA drives a while loop around a custom call from the
  # host, one synchronisation per iteration, which would be measured instead of the runtime).
  def chain(body):
    def run(x):
      for _ in range(calls):
        x = body(x)
      return x
    return jax.jit(run)

  x = jnp.ones((t, h), jnp.bfloat16)
  out = {}
  for name, body in (("graph", layer), ("xla_op", lambda x: x * jnp.bfloat16(1) + jnp.bfloat16(0))):
    f = chain(body)
    f(x).block_until_ready()
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      f(x).block_until_ready()
      times.append((time.perf_counter() - t0) / calls * 1e6)
    out[name] = float(np.median(times))
  return out


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cubins", type=pathlib.Path, required=True)
  p.add_argument("--calls", type=int, default=200)
  args = p.parse_args(argv)
  r = measure(args.cubins, args.calls)
  print(f"runtime cost per layer (3-node green-context graph, trivial bodies, a chain of {args.calls} calls in "
        f"one jit): {r['graph']:.2f} us; a plain XLA op in the same loop: {r['xla_op']:.2f} us; "
        f"difference {r['graph'] - r['xla_op']:.2f} us")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
