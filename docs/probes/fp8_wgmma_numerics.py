"""Would Hopper's FP8 tensor cores (one e4m3 x e4m3 wgmma per K32 block, FP32 promotion of each block's result
with its two scales) meet issue 6's numerics bar (cosine >= 0.9999999 to reference.moe_emulated)?

The candidate layer mirrors moe_emulated step for step (same MXFP8, SwiGLU in BF16, requant, BF16 o_j, ordered
combine); only the GEMM block dot changes: ``blockgemm(xv, xe, wv, we)`` gets the activation E4M3 values, their
block exponents, the weight E2M1 values (exact in E4M3) and exponents, and returns acc[m, n] =
sum over blocks in increasing K of dot(x_b, w_b) * 2**(ex + ew).

CPU: `python docs/probes/fp8_wgmma_numerics.py check`: the harness with exact numpy block dots is bit-exact.
GPU (needs torch and triton, as on the H200 machine): `python docs/probes/fp8_wgmma_numerics.py gpu` runs Triton's
tl.dot on float8e4nv (wgmma on sm_90) per K32 block and prints the cosines of docs/kernels_v2.md. A probe, not part
of the package: it uses the reference's private helpers.
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import formats
from gcmoe_jax import reference as ref


def routed(payload, scales):
  codes = formats._unpack_fp4_payload(payload)  # [E, N, K]
  k = codes.shape[-1]
  vals = formats.decode_e2m1(codes)
  exps = formats.unpack_scales(scales, k // 32).astype(jnp.int32) - formats.UE8M0_BIAS
  return vals, exps


def moe_candidate(x, w, ids, rw, clamp, blockgemm):
  e, h, i = w.num_experts, w.hidden, w.intermediate
  t, k = ids.shape
  w13v, w13e = routed(w.w13, w.w13_scale)
  w2v, w2e = routed(w.w2, w.w2_scale)
  x = ref._bf16(x).astype(jnp.float32)
  rows = jnp.repeat(x, k, axis=0)
  flat = np.asarray(ids).reshape(-1)
  xi, _, xe = ref.mxfp8(rows)
  xv = xi.astype(jnp.float32) / 512
  hid = jnp.zeros((t * k, 2 * i), jnp.float32)
  groups = [(ex, np.nonzero(flat == ex)[0]) for ex in np.unique(flat[flat >= 0])]
  for ex, idx in groups:
    hid = hid.at[idx].set(blockgemm(xv[idx], xe[idx], w13v[ex], w13e[ex]))
  a = ref._round_bf16(jnp.asarray(rw).reshape(-1)[:, None] * ref._swiglu(hid, clamp))
  ai, _, ae = ref.mxfp8(a)
  av = ai.astype(jnp.float32) / 512
  o = jnp.zeros((t * k, h), jnp.float32)
  for ex, idx in groups:
    o = o.at[idx].set(blockgemm(av[idx], ae[idx], w2v[ex], w2e[ex]))
  o = ref._round_bf16(o)
  o = jnp.where(jnp.asarray(flat >= 0)[:, None], o, 0.0).reshape(t, k, h)
  acc = jnp.zeros((t, h), jnp.float32)
  for j in range(k):
    acc = acc + o[:, j]
  return ref._round_bf16(acc).astype(jnp.bfloat16)


def exact_blockgemm(xv, xe, wv, we):
  xv, xe, wv, we = (np.asarray(a) for a in (xv, xe, wv, we))
  m, kk = xv.shape
  nb = kk // 32
  xi = (xv * 512).astype(np.int64).reshape(m, nb, 32)
  wi = (wv * 2).astype(np.int64).reshape(-1, nb, 32)
  acc = np.zeros((m, wi.shape[0]), np.float32)
  for b in range(nb):
    d = (xi[:, None, b, :] * wi[None, :, b, :]).sum(-1).astype(np.float32)
    acc = acc + np.ldexp(d, (xe[:, b, None] + we[None, :, b] - 10)).astype(np.float32)
  return jnp.asarray(acc)


def cos(a, b):
  a = np.asarray(a, np.float64).ravel()
  b = np.asarray(b, np.float64).ravel()
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def problem(e, h, i, k, t, seed, family="default"):
  from gcmoe_jax.bench import problems
  key = jax.random.PRNGKey(seed)
  k1, k2, k3 = jax.random.split(key, 3)
  w13 = jax.random.normal(k1, (e, h, 2 * i), jnp.float32) / np.sqrt(h)
  w2 = jax.random.normal(k2, (e, i, h), jnp.float32) / np.sqrt(i)
  x = jax.random.normal(k3, (t, h), jnp.float32)
  rng = np.random.default_rng(seed)
  ids, rw = problems.make_routes(rng, family, t, e, k)
  w = formats.quantize_experts(w13, w2)
  return x, w, w13, w2, jnp.asarray(ids), jnp.asarray(rw)


def check():
  for fam, (e, h, i, k, t) in [("default", (8, 512, 256, 4, 16)), ("zipf", (8, 512, 256, 4, 8)),
                               ("padding", (8, 512, 256, 4, 8))]:
    x, w, _, _, ids, rw = problem(e, h, i, k, t, 0, fam)
    yref = ref.moe_emulated(x.astype(jnp.bfloat16), w, ids, rw, clamp=10.0)
    yc = moe_candidate(x.astype(jnp.bfloat16), w, ids, rw, 10.0, exact_blockgemm)
    same = np.array_equal(np.asarray(yref).view(np.uint16), np.asarray(yc).view(np.uint16))
    print(f"harness {fam} E{e} H{h} I{i} k{k} T{t}: bit-exact {same} cos {cos(yref, yc):.12f}", flush=True)


def gpu():
  import torch
  import triton
  import triton.language as tl

  @triton.jit
  def blockgemm_kernel(a_ptr, ae_ptr, b_ptr, be_ptr, c_ptr, M, N, NB, BM: tl.constexpr, BN: tl.constexpr,
                       FP8: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, 32)
    kk = NB * 32
    acc = tl.zeros((BM, BN), tl.float32)
    for b in range(NB):
      a = tl.load(a_ptr + rm[:, None] * kk + b * 32 + rk[None, :], mask=rm[:, None] < M, other=0.0)
      w = tl.load(b_ptr + rn[None, :] * kk + b * 32 + rk[:, None], mask=rn[None, :] < N, other=0.0)
      if FP8:
        d = tl.dot(a, w, out_dtype=tl.float32)
      else:
        d = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
      ea = tl.load(ae_ptr + rm * NB + b, mask=rm < M, other=0)
      eb = tl.load(be_ptr + rn * NB + b, mask=rn < N, other=0)
      s = ((ea[:, None] + eb[None, :] + 127) << 23).to(tl.float32, bitcast=True)
      acc = acc + d * s
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

  def to_t(a, dt):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a))).cuda().to(dt)

  asm_checked = []

  def make(fp8):
    def bg(xv, xe, wv, we):
      m, kk = xv.shape
      n = wv.shape[0]
      a = to_t(np.asarray(xv, np.float32), torch.float32).to(torch.float8_e4m3fn)
      b = to_t(np.asarray(wv, np.float32), torch.float32).to(torch.float8_e4m3fn)
      ae = to_t(np.asarray(xe, np.int32), torch.int32)
      be = to_t(np.asarray(we, np.int32), torch.int32)
      c = torch.empty((m, n), dtype=torch.float32, device="cuda")
      grid = (triton.cdiv(m, 64), triton.cdiv(n, 128))
      kern = blockgemm_kernel[grid](a, ae, b, be, c, m, n, kk // 32, BM=64, BN=128, FP8=fp8, num_warps=4)
      if not asm_checked and fp8:
        ptx = kern.asm["ptx"]
        lines = sorted({ln.split()[0] for ln in ptx.splitlines() if "mma" in ln and not ln.strip().startswith("//")})
        print("fp8 kernel MMA instructions:", lines, flush=True)
        asm_checked.append(1)
      return jnp.asarray(c.cpu().numpy())
    return bg

  hw, ieee = make(True), make(False)

  # Per-block statistics of the FP8 dot against the exact one, on real operands (GEMM1 of a GLM-like row).
  x, w, _, _, _, _ = problem(4, 6144, 2048, 1, 64, 1)
  xi, _, xe = ref.mxfp8(x)
  xv = np.asarray(xi, np.float32) / 512
  wv, we = routed(w.w13, w.w13_scale)
  wv = np.asarray(wv[0, :512])
  zero_e = np.zeros((64, 1), np.int32)
  diffs, rels = 0, []
  for b in range(0, 192, 8):
    d_hw = np.asarray(hw(xv[:, b * 32:(b + 1) * 32], zero_e, wv[:, b * 32:(b + 1) * 32], np.zeros((512, 1), np.int32)))
    d_ex = (xv[:, None, b * 32:(b + 1) * 32].astype(np.float64) * wv[None, :, b * 32:(b + 1) * 32]).sum(-1)
    diffs += int((d_hw != d_ex.astype(np.float32)).sum())
    nz = d_ex != 0
    rels.append(np.abs(d_hw[nz] - d_ex[nz]) / np.abs(d_ex[nz]))
  rels = np.concatenate(rels)
  print(f"block dots: {diffs} of {rels.size} differ from exact; rel err max {rels.max():.3e} "
        f"p99 {np.quantile(rels, 0.99):.3e} mean {rels.mean():.3e}", flush=True)

  emu = jax.jit(ref.moe_emulated, static_argnames=("clamp",))
  cases = [("test default", (8, 512, 256, 4, 16), "default"), ("test k_max", (8, 512, 256, 8, 16), "default"),
           ("test zipf", (8, 512, 256, 4, 16), "zipf"), ("test skewed", (8, 512, 256, 4, 16), "skewed")]
  for b in (1, 8, 64, 256):
    cases.append((f"GLM5.2 B={b}", (32, 6144, 2048, 8, b), "default"))
    cases.append((f"DSV4.1 B={b}", (48, 5120, 2304, 6, b), "default"))
  for name, (e, h, i, k, t), fam in cases:
    t0 = time.time()
    x, w, w13, w2, ids, rw = problem(e, h, i, k, t, 7, fam)
    xb = x.astype(jnp.bfloat16)
    y_ref = emu(xb, w, ids, rw, clamp=10.0)
    y_hw = moe_candidate(xb, w, ids, rw, 10.0, hw)
    y_ie = moe_candidate(xb, w, ids, rw, 10.0, ieee)
    w13d, w2d, _ = formats.dequantize_experts(w)
    y_bf = ref.moe_bf16(xb, w13, w2, ids, rw, clamp=10.0)
    ne = np.asarray(y_ref).view(np.uint16) != np.asarray(y_hw).view(np.uint16)
    print(f"{name}: cos(fp8 wgmma, emulated) {cos(y_hw, y_ref):.10f} ({ne.mean() * 100:.3f} % of outputs differ); "
          f"cos(ieee fp32 dot, emulated) {cos(y_ie, y_ref):.10f}; cos(emulated, bf16) {cos(y_ref, y_bf):.8f}; "
          f"cos(fp8 wgmma, bf16) {cos(y_hw, y_bf):.8f}  [{time.time() - t0:.1f} s]", flush=True)


if __name__ == "__main__":
  {"check": check, "gpu": gpu}[sys.argv[1]]()
