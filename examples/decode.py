"""A small MoE transformer decoding greedily in one jit-compiled loop, its MoE layers on `gcmoe_jax.nn.MoE`.

    python examples/decode.py                         # 2 layers, 32 steps, batch 4 (seconds on 2 CPU cores)
    python examples/decode.py --steps 128 --layers 4 --backend reference

The model: token + position embedding, then per layer RMSNorm -> causal multi-head attention over a KV cache ->
residual, RMSNorm -> MoE (router, top-k of E MXFP4 experts, shared MXFP8 expert) -> residual; a final RMSNorm and an
output head. The whole decode (prompt feeding and N greedy steps) is one `jax.lax.fori_loop` inside one `jax.jit`,
compiled ahead of time, so the timed call measures decoding only. It runs on the default JAX device: the CPU, or the
GPU when one is present.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

try:
  import gcmoe_jax as gm
except ModuleNotFoundError:  # run from a source checkout without `pip install`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import gcmoe_jax as gm
from gcmoe_jax import nn as gnn


class RMSNorm(nnx.Module):
  def __init__(self, dim: int):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * self.scale[...]
    return y.astype(jnp.bfloat16)


class Attention(nnx.Module):
  """Causal multi-head attention for one new token per sequence against a KV cache ``[B, S_max, heads, head_dim]``."""

  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.heads, self.head_dim = heads, dim // heads
    init = nnx.initializers.normal(1.0 / math.sqrt(dim))
    self.wqkv = nnx.Param(init(rngs.params(), (dim, 3 * dim), jnp.bfloat16))
    self.wo = nnx.Param(init(rngs.params(), (dim, dim), jnp.bfloat16))

  def __call__(self, x: jax.Array, cache: tuple[jax.Array, jax.Array], pos: jax.Array):
    b = x.shape[0]
    q, k, v = jnp.split(x @ self.wqkv[...], 3, axis=-1)
    q, k, v = (a.reshape(b, self.heads, self.head_dim) for a in (q, k, v))
    kc = jax.lax.dynamic_update_slice_in_dim(cache[0], k[:, None], pos, axis=1)
    vc = jax.lax.dynamic_update_slice_in_dim(cache[1], v[:, None], pos, axis=1)
    s = jnp.einsum("bhd,bshd->bhs", q, kc, preferred_element_type=jnp.float32) / math.sqrt(self.head_dim)
    s = jnp.where(jnp.arange(kc.shape[1]) <= pos, s, -jnp.inf)  # causal: only positions written so far
    p = jax.nn.softmax(s, axis=-1).astype(jnp.bfloat16)
    o = jnp.einsum("bhs,bshd->bhd", p, vc).reshape(b, -1)
    return o @ self.wo[...], (kc, vc)


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, moe: gnn.MoE, *, rngs: nnx.Rngs):
    self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
    self.attn = Attention(dim, heads, rngs=rngs)
    self.moe = moe

  def __call__(self, x, cache, pos):
    a, cache = self.attn(self.norm1(x), cache, pos)
    x = x + a
    return x + self.moe(self.norm2(x)), cache


class MoETransformer(nnx.Module):
  def __init__(self, *, vocab: int, dim: int, heads: int, layers: int, max_len: int, experts: int,
               intermediate: int, top_k: int, backend: str, rngs: nnx.Rngs):
    self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), jnp.bfloat16))
    self.pos_embed = nnx.Param((0.1 * jax.random.normal(rngs.params(), (max_len, dim))).astype(jnp.bfloat16))
    # nnx.List marks the layers as data for flax >= 0.12; older flax takes a plain list.
    layer_list = getattr(nnx, "List", list)
    self.blocks = layer_list([
      Block(dim, heads, gnn.MoE(dim, intermediate, experts, top_k, rngs=rngs, shared_intermediate=intermediate,
                                score="sigmoid", routed_scaling_factor=1.0, clamp=10.0, backend=backend), rngs=rngs)
      for _ in range(layers)])
    self.norm = RMSNorm(dim)
    # Untied: with a random tied head, every token's best next token is itself and greedy decoding stalls at once.
    self.head = nnx.Param(jax.random.normal(rngs.params(), (dim, vocab), jnp.bfloat16) / math.sqrt(dim))

  def __call__(self, tokens: jax.Array, caches, pos: jax.Array):
    """One step: tokens int32 ``[B]`` at position ``pos`` -> logits float32 ``[B, vocab]``, updated caches."""
    x = self.embed[...][tokens] + self.pos_embed[...][pos]
    new_caches = []
    for block, cache in zip(self.blocks, caches):
      x, cache = block(x, cache, pos)
      new_caches.append(cache)
    logits = jnp.dot(self.norm(x), self.head[...], preferred_element_type=jnp.float32)
    return logits, tuple(new_caches)


def generate(graphdef, state, prompt: jax.Array, *, steps: int, caches) -> jax.Array:
  """Greedy decode: feeds ``prompt`` [B, P] then ``steps`` argmax tokens; returns int32 ``[B, P + steps]``."""
  model = nnx.merge(graphdef, state)
  b, p = prompt.shape
  seq = jnp.zeros((b, p + steps), jnp.int32).at[:, :p].set(prompt)

  def step(i, carry):
    seq, caches = carry
    logits, caches = model(seq[:, i], caches, i)
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # While the prompt is being fed, its next token is kept; after it, the model's choice is written.
    keep = seq[:, i + 1]
    seq = seq.at[:, i + 1].set(jnp.where(i + 1 < p, keep, nxt))
    return seq, caches

  seq, _ = jax.lax.fori_loop(0, p + steps - 1, step, (seq, caches))
  return seq


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=32, help="tokens generated per sequence (default 32)")
  ap.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
  ap.add_argument("--batch", type=int, default=4, help="sequences decoded together = tokens per MoE call (default 4)")
  ap.add_argument("--prompt", type=int, default=4, help="prompt length (random tokens, default 4)")
  ap.add_argument("--backend", default="auto", choices=gm.BACKENDS, help="gcmoe_jax.moe backend (default auto)")
  ap.add_argument("--ep", type=int, default=1,
                  help="expert-parallel ranks: split the experts and the batch over an N-device mesh axis 'ep' "
                       "(on CPU, N host devices are created); --batch must be divisible by N")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.ep < 1 or args.batch % args.ep:
    print(f"decode.py: --ep must be >= 1 and divide --batch = {args.batch}, got {args.ep}", file=sys.stderr)
    return 2
  if args.ep > 1:
    # Before any backend starts: lets a CPU-only machine run an N-device mesh (no effect on GPU platforms).
    jax.config.update("jax_num_cpu_devices", max(args.ep, 1))
  for name in ("steps", "layers", "batch", "prompt"):
    if getattr(args, name) < 1:
      print(f"decode.py: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
      return 2
  explanation = gm.explain(args.backend)
  if explanation.backend is None:  # a named backend that cannot run here says why
    print(f"decode.py: backend {args.backend!r} cannot run here: {dict(explanation.reasons)[args.backend].reason}",
          file=sys.stderr)
    return 2

  dim, heads, vocab, experts, intermediate, top_k = 512, 4, 512, 8, 256, 2
  max_len = args.prompt + args.steps
  t0 = time.perf_counter()
  model = MoETransformer(vocab=vocab, dim=dim, heads=heads, layers=args.layers, max_len=max_len, experts=experts,
                         intermediate=intermediate, top_k=top_k, backend=args.backend, rngs=nnx.Rngs(args.seed))
  if args.ep > 1:
    if len(jax.devices()) < args.ep:
      print(f"decode.py: --ep {args.ep} needs {args.ep} devices, got {len(jax.devices())}", file=sys.stderr)
      return 2
    mesh = jax.make_mesh((args.ep,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:args.ep])
    for block in model.blocks:
      block.moe.shard(mesh)  # experts split over 'ep'; tokens follow inside gm.moe(..., ep_axis='ep')
  graphdef, state = nnx.split(model)
  shape = (args.batch, max_len, heads, dim // heads)
  caches = tuple((jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)) for _ in range(args.layers))
  prompt = jax.random.randint(jax.random.key(args.seed + 1), (args.batch, args.prompt), 0, vocab, jnp.int32)
  decode = jax.jit(functools.partial(generate, graphdef, steps=args.steps))
  compiled = decode.lower(state, prompt, caches=caches).compile()
  t_compile = time.perf_counter() - t0

  t0 = time.perf_counter()
  seq = compiled(state, prompt, caches=caches).block_until_ready()
  elapsed = time.perf_counter() - t0

  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  print(explanation)
  print(f"model: {args.layers} layers, d={dim}, {heads} heads, vocab {vocab}; MoE E={experts} top-{top_k} "
        f"I={intermediate} + shared expert, sigmoid routing"
        + (f"; expert parallel over {args.ep} devices ({experts // args.ep} experts each)" if args.ep > 1 else ""))
  print(f"build + compile: {t_compile:.1f} s")
  print(f"first sequence: {seq[0].tolist()}")
  print(f"decoded {args.steps} steps x batch {args.batch} in {elapsed:.3f} s (prompt {args.prompt} fed in the same "
        f"loop): {args.batch * args.steps / elapsed:.1f} tokens/s, backend {explanation.backend}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
