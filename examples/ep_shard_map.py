"""Expert parallelism on 8 CPU devices: both entry points against the single-device oracle.

    python examples/ep_shard_map.py

Splits 16 experts over a mesh axis ``ep`` of 8 devices (2 experts per device, global expert g on device g // 2),
splits 16 tokens the same way (2 per device), and runs one MoE layer (top-4 routing, a shared expert) twice:
inside `jax.shard_map` with `moe_shard_map_body`, and under `jax.jit` on sharded global arrays with
`moe_partitioned`. Both print their max abs difference to `reference.moe_emulated` on one device (0.0: the
expert-parallel result is bit-identical).
"""

import os
import sys

import jax

# Eight CPU devices; this must run before JAX initialises a backend.
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout without installing
from gcmoe_jax import formats, reference, sharding
from gcmoe_jax.bench.problems import Shape, make_problem

R = 8
CLAMP = 10.0


def main() -> None:
  shape = Shape(experts=16, hidden=512, intermediate=256, top_k=4, tokens=2 * R, shared_intermediate=256)
  p = make_problem("zipf", shape, seed=0)  # skewed expert popularity: uneven load across devices
  w = jax.jit(formats.quantize_experts)(p.w13, p.w2, shared=p.shared)
  x, ids, weights = jnp.asarray(p.x, jnp.bfloat16), jnp.asarray(p.ids), jnp.asarray(p.weights)
  want = np.asarray(jax.jit(reference.moe_emulated, static_argnames="clamp")(x, w, ids, weights, clamp=CLAMP),
                    np.float32)

  mesh = jax.make_mesh((R,), ("ep",), axis_types=(AxisType.Explicit,))
  tokens = NamedSharding(mesh, P("ep"))
  x_s, ids_s, weights_s = jax.device_put((x, ids, weights), tokens)
  w_s = jax.device_put(w, sharding.expert_shardings(w, mesh))  # routed experts split, shared expert replicated

  # 1. Inside shard_map. The weights enter as their arrays and are rebuilt per device with L = E/R experts:
  # ExpertWeights checks its shapes when rebuilt from per-device arrays. check_vma=False because the reference
  # op's scan carry is not typed as varying over "ep".
  def body(x, ids, weights, routed, shared):
    w_local = formats.ExpertWeights(*routed, shared, routed[0].shape[0], w.hidden, w.intermediate)
    return sharding.moe_shard_map_body_with_stats(x, w_local, ids, weights, axis_name="ep",
                                                  local_fn=reference.moe_emulated, clamp=CLAMP)

  specs = (P("ep"), P("ep"), P("ep"), (P("ep"),) * 4, sharding.expert_specs(w).shared)
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("ep"), P()), check_vma=False))
  y, stats = step(x_s, ids_s, weights_s, (w_s.w13, w_s.w13_scale, w_s.w2, w_s.w2_scale), w_s.shared)
  print(f"shard_map   R={R}: max |y - oracle| = {np.abs(np.asarray(y, np.float32) - want).max()}  "
        f"(overflow {int(stats.overflow)}, busiest peer {int(stats.max_load)} rows)")

  # 2. Sharded global arrays under jit: the op's partitioning rule runs the same body per device.
  moe = jax.jit(lambda x, w, ids, weights: sharding.moe_partitioned(x, w, ids, weights,
                                                                     local_fn=reference.moe_emulated, clamp=CLAMP))
  y = moe(x_s, w_s, ids_s, weights_s)
  print(f"partitioned R={R}: max |y - oracle| = {np.abs(np.asarray(y, np.float32) - want).max()}  "
        f"(y sharding {y.sharding.spec})")


if __name__ == "__main__":
  main()
