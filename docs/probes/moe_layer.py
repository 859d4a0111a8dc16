"""One GLM5.2 (default) or DSV4.1-Flash (`dsv`) per-rank layer, routed or with its shared expert (`shared`: MXFP8,
the model's paper size and K-group, `geometry.MODELS`: the shapes of the bench and of `--preset paper`), at batch B
through gm.moe (CUDA), run three times: the workload of docs/probes/ncu_role2.sh. Usage: python
docs/probes/moe_layer.py B [glm|dsv] [shared]"""
import sys
import jax
import jax.numpy as jnp
import numpy as np
import gcmoe_jax as gm
from gcmoe_jax import geometry
from gcmoe_jax.bench import problems

b = int(sys.argv[1])
model = sys.argv[2] if len(sys.argv) > 2 else "glm"
m = geometry.MODELS["glm5.2" if model == "glm" else "dsv4.1-flash"]
e, h, i, k = m.E // 8, m.H, m.I, m.k  # one rank of eight (32 and 48 experts)
key = jax.random.PRNGKey(0)
k1, k2, k3 = jax.random.split(key, 3)
w13 = jax.random.normal(k1, (e, h, 2 * i), jnp.float32) / np.sqrt(h)
w2 = jax.random.normal(k2, (e, i, h), jnp.float32) / np.sqrt(i)
shared = None
if len(sys.argv) > 3 and sys.argv[3] == "shared":
  k4, k5 = jax.random.split(k3)
  si = m.shared_I
  shared = (jax.random.normal(k4, (h, 2 * si), jnp.float32) / np.sqrt(h),
            jax.random.normal(k5, (si, h), jnp.float32) / np.sqrt(si))
w = gm.quantize_experts(w13, w2, shared=shared, shared_group=m.shared_group)
del w13, w2, shared
x = jax.random.normal(k3, (b, h), jnp.float32).astype(jnp.bfloat16)
ids, rw = problems.make_routes(np.random.default_rng(0), "default", b, e, k)
routes = gm.Routes(jnp.asarray(ids), jnp.asarray(rw))
f = jax.jit(lambda x, w, r: gm.moe(x, w, r, backend="cuda"))
for _ in range(3):
  y = f(x, w, routes).block_until_ready()
print("B", b, "ok", float(jnp.abs(y.astype(jnp.float32)).mean()))
