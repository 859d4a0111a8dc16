"""Would BF16 tensor cores with the block scales folded into the operands meet issue 6's numerics bar (cosine
>= 0.9999999 to reference.moe_emulated) where FP8 wgmma does not (docs/kernels_v2.md "Why int8 MMAs")?

Every MX value times its block's power of two is exact in BF16 (E2M1 and E4M3 carry 1 and 3 mantissa bits, BF16 7,
and BF16 has FP32's exponent range), and so is every product of two of them in FP32. So a GEMM can run on BF16
``wgmma`` with FP32 accumulation and no per-K32 epilogue at all: the only departure from the oracle is the tensor
core's summation (its alignment and truncation) in place of "round each K32 block's dot to FP32, add in K order".
Three accumulation granularities are measured, each a different kernel cost:

- ``chain``: one accumulator over all of K (``acc = dot(a, b, acc)``): no epilogue instruction per block;
- ``k128``: a fresh tensor-core sum per K128 stage, added to the FP32 accumulator by one FADD per element and stage;
- ``k32``: a fresh sum per K32 block and one FADD per element and block (the oracle's structure, hardware sums).

The candidate layer mirrors moe_emulated step for step (MXFP8 activations, SwiGLU in BF16, requant, BF16 o_j,
ordered combine, the shared expert's MXFP8 GEMMs); only the GEMMs change.

CPU: `python docs/probes/bf16_fold_numerics.py check`: the harness with exact block dots (numpy, the oracle's split
of FP8 x FP8 included) is bit-exact to reference.moe_emulated, routed and with the shared expert.
GPU (torch + triton): `python docs/probes/bf16_fold_numerics.py gpu` prints, per case, the cosine of each mode to
the oracle, the share of outputs that differ, and both layers' cosine to the dense BF16 layer. A probe, not part of
the package: it uses the reference's private helpers.
"""
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import formats
from gcmoe_jax import reference as ref

from fp8_wgmma_numerics import cos  # noqa: E402 (docs/probes is the script's directory)


def operands(w):
  """Folded weights ``[K, N]`` per GEMM (float32, exact MX values) and the raw (values, exponents) per K32 block."""
  w13 = formats._dequantize_routed(w.w13, w.w13_scale)  # [E, H, 2I], stored gate/up interleave
  w2 = formats._dequantize_routed(w.w2, w.w2_scale)  # [E, I, H]
  sh = None
  if w.shared is not None:
    s = w.shared
    sh = (formats._dequantize_shared(s.s13, s.s13_scale, s.group),
          formats._dequantize_shared(s.s2, s.s2_scale, s.group))
  return w13, w2, sh


def fold_x(rows):
  """MXFP8 of ``rows`` as folded float32 values (E4M3 value x block scale, exact) and the oracle's NaN flags."""
  xi, xn, xe = ref.mxfp8(rows)
  m, k = xi.shape
  v = formats._scale_by_pow2((xi.astype(jnp.float32) / 512).reshape(m, k // 32, 32), xe[..., None])
  v = jnp.where(xn[..., None], jnp.nan, v)
  return v.reshape(m, k)


def candidate(x, w, ids, rw, clamp, gemm):
  """The layer of moe_emulated with ``gemm(rows [M, K], groups, which) -> f32 [M, N]`` for every GEMM (``rows``:
  BF16 values in float32 before MXFP8; ``groups``: (expert, row indices) pairs, or None for the shared expert's
  GEMMs ``which`` = s13, s2; w13 and w2 are the routed ones)."""
  t, k = ids.shape
  h = w.hidden
  x = ref._bf16(x).astype(jnp.float32)
  rows = jnp.repeat(x, k, axis=0)
  flat = np.asarray(ids).reshape(-1)
  groups = [(int(ex), np.nonzero(flat == ex)[0]) for ex in np.unique(flat[flat >= 0])]
  hid = gemm(rows, groups, "w13")
  a = ref._round_bf16(jnp.asarray(rw, jnp.float32).reshape(-1)[:, None] * ref._swiglu(hid, clamp))
  o = ref._round_bf16(gemm(a, groups, "w2"))
  o = jnp.where(jnp.asarray(flat >= 0)[:, None], o, 0.0).reshape(t, k, h)
  acc = jnp.zeros((t, h), jnp.float32)
  for j in range(k):
    acc = acc + o[:, j]
  if w.shared is not None:
    hs = ref._swiglu(gemm(x, None, "s13"), clamp)
    acc = acc + ref._round_bf16(gemm(hs, None, "s2"))
  return ref._round_bf16(acc).astype(jnp.bfloat16)


def exact_gemm(w):
  """The oracle's own block dots (reference._gemm) on the quantized layout: the harness check."""
  h, i = w.hidden, w.intermediate
  n_k = {"w13": (2 * i, h, False), "w2": (h, i, False)}
  if w.shared is not None:
    n_k.update(s13=(2 * w.shared.intermediate, h, True), s2=(h, w.shared.intermediate, True))

  def one(rows, which, ex):
    xi, xn, xe = ref.mxfp8(rows)
    n, k, fp8 = n_k[which]
    if fp8:
      s = w.shared
      payload, scales = (s.s13, s.s13_scale) if which == "s13" else (s.s2, s.s2_scale)
      fetch = ref._shared_block(payload, scales, s.group)
    else:
      payload, scales = (w.w13, w.w13_scale) if which == "w13" else (w.w2, w.w2_scale)
      fetch = ref._routed_block(payload, scales, jnp.full((rows.shape[0],), ex, jnp.int32))
    return ref._gemm(xi, xn, xe, fetch, k // 32, n, fp8)

  def gemm(rows, groups, which):
    if groups is None:
      return one(rows, which, -1)
    out = jnp.zeros((rows.shape[0], n_k[which][0]), jnp.float32)
    for ex, idx in groups:
      out = out.at[idx].set(one(rows[idx], which, ex))
    return out

  return gemm


def problem(e, h, i, k, t, seed, family="default", shared_group=None):
  from gcmoe_jax.bench import problems
  key = jax.random.PRNGKey(seed)
  k1, k2, k3, k4, k5 = jax.random.split(key, 5)
  w13 = jax.random.normal(k1, (e, h, 2 * i), jnp.float32) / np.sqrt(h)
  w2 = jax.random.normal(k2, (e, i, h), jnp.float32) / np.sqrt(i)
  x = jax.random.normal(k3, (t, h), jnp.float32)
  shared = None
  if shared_group:
    shared = (jax.random.normal(k4, (h, 2 * i), jnp.float32) / np.sqrt(h),
              jax.random.normal(k5, (i, h), jnp.float32) / np.sqrt(i))
  ids, rw = problems.make_routes(np.random.default_rng(seed), family, t, e, k)
  w = formats.quantize_experts(w13, w2, shared=shared, shared_group=shared_group or 128)
  return x, w, w13, w2, shared, jnp.asarray(ids), jnp.asarray(rw)


def outliers(x, seed):
  """LLM-like hidden states: 1 % of the channels 64x larger (each K32 block's scale follows its largest value)."""
  cols = np.random.default_rng(seed).choice(x.shape[1], max(1, x.shape[1] // 100), replace=False)
  return x.at[:, cols].multiply(64.0)


def cases(full):
  small = [("test default", (8, 512, 256, 4, 16), "default", None), ("test k 8", (8, 512, 256, 8, 16), "default", None),
           ("test zipf", (8, 512, 256, 4, 16), "zipf", None), ("test skewed", (8, 512, 256, 4, 16), "skewed", None),
           ("test padding", (8, 512, 256, 4, 16), "padding", None),
           ("test shared g32", (8, 512, 256, 4, 16), "default", 32),
           ("test shared g128 outliers", (8, 512, 256, 4, 16), "outliers", 128)]
  if not full:
    return small
  glm, dsv = (32, 6144, 2048, 8), (48, 5120, 2304, 6)
  # The paper shapes first (the long K is what the tensor cores' summation differs on), the largest batches and the
  # outlier activations earliest: a call that runs out of time has printed the telling cases.
  out = [("GLM5.2+shared B=64 outliers", glm + (64,), "outliers", 128),
         ("DSV4.1+shared B=64 outliers", dsv + (64,), "outliers", 32)]
  for b in (256, 8, 1):
    out += [(f"GLM5.2+shared B={b}", glm + (b,), "default", 128), (f"DSV4.1+shared B={b}", dsv + (b,), "default", 32)]
  return out + small + [("GLM5.2 B=64", glm + (64,), "default", None), ("DSV4.1 B=64", dsv + (64,), "default", None)]


def build(name, shape, family, group, seed=7):
  e, h, i, k, t = shape
  x, w, w13, w2, shared, ids, rw = problem(e, h, i, k, t, seed, "default" if family == "outliers" else family, group)
  if family == "outliers":
    x = outliers(x, seed)
  return x.astype(jnp.bfloat16), w, w13, w2, shared, ids, rw


def check():
  emu = jax.jit(ref.moe_emulated, static_argnames=("clamp",))
  for name, shape, family, group in cases(False):
    xb, w, _, _, _, ids, rw = build(name, shape, family, group)
    yref = emu(xb, w, ids, rw, clamp=10.0)
    yc = candidate(xb, w, ids, rw, 10.0, exact_gemm(w))
    same = np.array_equal(np.asarray(yref).view(np.uint16), np.asarray(yc).view(np.uint16))
    print(f"harness {name}: bit-exact {same} cos {cos(yref, yc):.12f}", flush=True)
    assert same, name


def gpu():
  import torch
  import triton
  import triton.language as tl

  @triton.jit
  def gemm_kernel(a_ptr, b_ptr, c_ptr, one_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  CHAIN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    one = tl.load(one_ptr)  # 1.0 from memory: keeps `acc + dot * one` from being folded into the dot's C
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
      a = tl.load(a_ptr + rm[:, None] * K + k0 + rk[None, :], mask=rm[:, None] < M, other=0.0)
      b = tl.load(b_ptr + (k0 + rk)[:, None] * N + rn[None, :], mask=rn[None, :] < N, other=0.0)
      if CHAIN:
        acc = tl.dot(a, b, acc)
      else:
        acc = acc + tl.dot(a, b) * one
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

  one = torch.ones(1, dtype=torch.float32, device="cuda")
  modes = {"chain": (True, 64), "k128": (False, 128), "k32": (False, 32)}
  printed = set()

  def to_torch_bf16(v):
    """float32 jax array of exact folded values -> torch bf16 on the GPU (asserting the cast is exact)."""
    vb = v.astype(jnp.bfloat16)
    same = jnp.where(jnp.isnan(v), True, vb.astype(jnp.float32) == v)
    assert bool(same.all()), "a folded value is not exact in BF16"
    bits = np.asarray(jax.lax.bitcast_convert_type(vb, jnp.int16))
    return torch.from_numpy(bits).cuda().view(torch.bfloat16).contiguous()

  def folded_gemm(ops, mode):
    chain, bk = modes[mode]

    def gemm(rows, groups, which):
      a = to_torch_bf16(fold_x(rows))  # [M, K]
      wt = ops[which]  # [E, K, N] or [K, N]
      m, kk = a.shape
      n = wt.shape[-1]
      c = torch.zeros((m, n), dtype=torch.float32, device="cuda")
      for ex, idx in groups if groups is not None else [(None, None)]:
        b = wt if ex is None else wt[ex]
        ai = a if idx is None else a[torch.from_numpy(idx).cuda()].contiguous()
        ci = torch.empty((ai.shape[0], n), dtype=torch.float32, device="cuda")
        grid = (triton.cdiv(ai.shape[0], 64), triton.cdiv(n, 128))
        kern = gemm_kernel[grid](ai, b, ci, one, ai.shape[0], n, kk, BM=64, BN=128, BK=bk, CHAIN=chain, num_warps=4)
        if mode not in printed:
          ptx = kern.asm["ptx"]
          print(f"{mode}: MMA instructions", sorted({ln.split()[0] for ln in ptx.splitlines()
                                                    if "mma" in ln and not ln.strip().startswith("//")}), flush=True)
          printed.add(mode)
        if idx is None:
          c = ci
        else:
          c[torch.from_numpy(idx).cuda()] = ci
      return jnp.asarray(c.cpu().numpy())

    return gemm

  emu = jax.jit(ref.moe_emulated, static_argnames=("clamp",))
  worst = {m: 1.0 for m in modes}
  for name, shape, family, group in cases(True):
    t0 = time.time()
    xb, w, w13, w2, shared, ids, rw = build(name, shape, family, group)
    y_ref = emu(xb, w, ids, rw, clamp=10.0)
    y_bf = ref.moe_bf16(xb, w13, w2, ids, rw, shared=shared, clamp=10.0)
    line = [f"{name}: cos(emulated, bf16 dense) {cos(y_ref, y_bf):.8f}"]
    w13f, w2f, shf = operands(w)
    ops = {"w13": to_torch_bf16(w13f), "w2": to_torch_bf16(w2f)}
    if shf is not None:
      ops.update(s13=to_torch_bf16(shf[0]), s2=to_torch_bf16(shf[1]))
    del w13f, w2f, shf
    for mode in modes:
      y = candidate(xb, w, ids, rw, 10.0, folded_gemm(ops, mode))
      c = cos(y, y_ref)
      worst[mode] = min(worst[mode], c)
      ne = np.asarray(y_ref).view(np.uint16) != np.asarray(y).view(np.uint16)
      line.append(f"{mode} {c:.10f} ({ne.mean() * 100:.2f} % differ, cos to dense {cos(y, y_bf):.8f})")
    print("; ".join(line) + f"  [{time.time() - t0:.1f} s]", flush=True)
  print("worst cosine to the oracle per mode:", {m: f"{c:.10f}" for m, c in worst.items()}, "(bar 0.9999999)")


if __name__ == "__main__":
  {"check": check, "gpu": gpu}[sys.argv[1]]()
