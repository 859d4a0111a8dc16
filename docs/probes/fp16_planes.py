"""Could role 2 on Hopper use TWO FP16 digit planes instead of three int8 ones, and keep its bit-exact numerics?

The exact semantics round each K32 block dot D = sum (512 x) (2 w) once to FP32 (docs/semantics.md). The int8 path
(docs/kernels_v2.md) splits 512 x into three signed 6-bit digits, so D = S0 + 2**6 S1 + 2**12 S2 comes out as three
int32 sums, and f32(D) costs two magic-number conversions, an FMA and an integer add per (row, token, block) before
the scaled accumulate: 6 instructions, ~70 % of a wide stage. With FP16 operands that hold integers, two digits of
base 512 cover 512 x (d0 in [-256, 255], d1 in [-448, 448], both exact in FP16), and if the tensor cores sum such
products exactly (every partial sum is an integer below 2**18, far inside FP32's 24 bits), they return S0 and S1 as
exact FP32 values: f32(D) = fma(S1, 512, S0) is then ONE correctly rounded operation, and the epilogue is 3
instructions (that FMA, the bits of 2**n, the scaled FMA) instead of 6. The same would hold for FP16 wgmma, whose
asynchronous MMAs also take the B loads off the issue slots.

What this probe measures, on the GPU (needs torch, triton and cuda-bindings, as on the H200 machine):

1. mma.sync m16n8k16 .f32.f16.f16.f32 (`fp16_planes.cu`, two chained per K32 block) on integer-valued FP16
   operands: the weights' 2 w (every E2M1 code) against the digit planes of 512 x from `reference.mxfp8` of random
   rows, plus adversarial blocks (every product at its largest magnitude, one sign or alternating, cancellations to
   a small residual): every output compared with the exact int64 dot.
2. The same blocks through Triton's ``tl.dot`` of FP16 tiles with FP32 output (wgmma on sm_90; the PTX is checked
   for ``wgmma``).
3. Issue rates of mma.sync m16n8k16 f16 and m16n8k32 s8 (8 independent MMAs per warp in a loop, every SM):
   instructions per SM per clock (the FP16 path needs 4 MMAs per block and n-tile where int8 needs 3).

``python docs/probes/fp16_planes.py check`` (CPU): the data's sanity (the plane split round-trips, both plane sums
below 2**18, D past 2**24), no GPU. fma(S1, 512, S0) = RN(D) needs no test: S1 * 512 + S0 = D exactly, and an FMA
rounds its exact result once.
``python docs/probes/fp16_planes.py gpu [cubin]``: the three measurements (the cubin is built from the .cu with
``nvcc -arch=sm_90a -cubin -O3``; by default next to this file, else compiled with the nvcc on PATH).
"""
import os
import pathlib
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
E2M1_2W = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)  # 2 w per code


def planes(xi):
  """The two base-512 digits of 512 x (``xi``, integers |xi| <= 229,376): d0 in [-256, 255], d1 in [-448, 448]."""
  d0 = (xi + 256) % 512 - 256
  d1 = (xi - d0) // 512
  assert np.all(np.abs(d1) <= 448) and np.all(d0 + 512 * d1 == xi)
  return d0, d1


def blocks(rng, n, m=16, t=8):
  """``n`` blocks of (A [m, 32] of 2 w, xi [t, 32] of 512 x): realistic ones (every E2M1 code; 512 x from
  `reference.mxfp8` of random rows over a spread of magnitudes), then adversarial ones (an eighth each: every product
  at its largest magnitude, one sign; alternating signs; 31 alternating largest values and a small residual)."""
  from gcmoe_jax import reference as ref

  a = E2M1_2W[rng.integers(0, 16, (n, m, 32))]
  rows = rng.standard_normal((n * t, 32)).astype(np.float32) * np.exp2(rng.integers(-6, 6, (n * t, 1)))
  xi = np.asarray(ref.mxfp8(rows)[0]).astype(np.int64).reshape(n, t, 32)
  q = n // 8
  a[:q] = 12
  xi[:q] = 229376
  a[q:2 * q] = 12 * np.where(np.arange(32) % 2, 1, -1)
  xi[q:2 * q] = 229376
  # 30 alternating largest values cancel; the last two leave a residual of -12 or so
  xi[2 * q:3 * q, :, :30] = 229376 * np.where(np.arange(30) % 2, 1, -1)
  xi[2 * q:3 * q, :, 30] = 229376 - rng.integers(1, 4, (q, t))
  xi[2 * q:3 * q, :, 31] = -229376
  a[2 * q:3 * q] = 12
  # both extremes of plane 0 (d0 = -256 and 255) beside large plane-1 digits
  xi[3 * q:4 * q] = 512 * rng.integers(-440, 440, (q, t, 32)) + np.where(rng.random((q, t, 32)) < 0.5, -256, 255)
  return a, xi


def exact_dots(a, xi):
  """S0, S1 (int64 [n, 16, 8]) and D = S0 + 512 S1."""
  d0, d1 = planes(xi)
  s0 = np.einsum("nmk,njk->nmj", a, d0)
  s1 = np.einsum("nmk,njk->nmj", a, d1)
  return s0, s1, s0 + 512 * s1


def check() -> int:
  rng = np.random.default_rng(0)
  a, xi = blocks(rng, 4096)
  s0, s1, d = exact_dots(a, xi)
  # A sanity check of the data, not of the GPU: the digits round-trip (`planes` asserts it), both plane sums stay
  # below 2**18 (exact in FP32 and in FP16 products), and D reaches past 2**24, so f32(D) really rounds.
  ok = np.abs(s0).max() < 2**18 and np.abs(s1).max() < 2**18 and np.abs(d).max() >= 2**24
  print(f"CPU: {d.size} block dots; |S0| max {np.abs(s0).max()}, |S1| max {np.abs(s1).max()}, |D| max "
        f"{np.abs(d).max()} (2**{np.log2(np.abs(d).max()):.1f}); plane sums exact in FP32: {ok}")
  return 0 if ok else 1


def gpu(cubin_path: str | None) -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # jax only makes the test data; the GPU is torch's and the probe's
  import torch
  import triton
  import triton.language as tl
  from cuda.bindings import driver as cu

  def ok(res):
    err, *vals = res
    if err != cu.CUresult.CUDA_SUCCESS:
      raise RuntimeError(f"CUDA driver: {err}")
    return vals[0] if len(vals) == 1 else vals

  path = pathlib.Path(cubin_path) if cubin_path else HERE / "fp16_planes.cubin"
  if not path.exists():
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-o", str(path), str(HERE / "fp16_planes.cu")],
                   check=True)
  torch.cuda.init()
  torch.zeros(1, device="cuda")  # the primary context current on this thread
  mod = ok(cu.cuModuleLoadData(path.read_bytes()))
  stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)

  def launch(name, grid, block, *args):
    fn = ok(cu.cuModuleGetFunction(mod, name.encode()))
    held = [np.array([x.data_ptr()], np.uint64) if isinstance(x, torch.Tensor) else np.array([x], np.int32)
            for x in args]
    ptrs = np.array([h.ctypes.data for h in held], dtype=np.uint64)
    ok(cu.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream, ptrs.ctypes.data, 0))

  rng = np.random.default_rng(1)
  n = 1 << 15
  a, xi = blocks(rng, n)
  s0, s1, _ = exact_dots(a, xi)
  d0, d1 = planes(xi)
  fails = 0

  def half(v):  # integers below 2**11: exact in FP16
    return torch.from_numpy(np.ascontiguousarray(v).astype(np.float16)).cuda()

  # 1. mma.sync: one launch per plane, a warp per block.
  a_dev = half(a)
  for p, (dp, sp) in enumerate(((d0, s0), (d1, s1))):
    out = torch.empty((n, 16, 8), dtype=torch.float32, device="cuda")
    launch("exact_hmma", n * 32 // 256, 256, a_dev, half(dp), out, n)
    torch.cuda.synchronize()
    bad = int(np.count_nonzero(out.cpu().numpy().astype(np.float64) != sp))
    fails += bad
    print(f"mma.sync m16n8k16 f16 -> f32, plane {p}: {sp.size} sums, {bad} differ from the exact int64 "
          f"(|sum| max {np.abs(sp).max()})")

  # 2. wgmma through Triton: one program per block of 64 weight rows x 64 tokens, K = 32.
  @triton.jit
  def blockdot(a_ptr, b_ptr, d_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    blk = tl.program_id(0)
    m = tl.arange(0, M)
    nn = tl.arange(0, N)
    k = tl.arange(0, K)
    at = tl.load(a_ptr + blk * M * K + m[:, None] * K + k[None, :])
    bt = tl.load(b_ptr + blk * K * N + k[:, None] * N + nn[None, :])
    tl.store(d_ptr + blk * M * N + m[:, None] * N + nn[None, :], tl.dot(at, bt, out_dtype=tl.float32))

  g = n // 16
  aw, xw = blocks(rng, g, 64, 64)
  for p, dp in enumerate(planes(xw)):
    want = np.einsum("gmk,gnk->gmn", aw, dp)
    out = torch.empty((g, 64, 64), dtype=torch.float32, device="cuda")
    kern = blockdot[(g,)](half(aw), half(dp.transpose(0, 2, 1)), out, 64, 64, 32, num_warps=4)
    torch.cuda.synchronize()
    bad = int(np.count_nonzero(out.cpu().numpy().astype(np.float64) != want))
    fails += bad
    print(f"triton tl.dot f16 -> f32 ({'wgmma' if 'wgmma' in kern.asm['ptx'] else 'NOT wgmma'}), plane {p}: "
          f"{want.size} sums, {bad} differ from the exact int64 (|sum| max {np.abs(want).max()})")

  # 3. Issue rates.
  dev = ok(cu.cuDeviceGet(torch.cuda.current_device()))
  sms = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
  khz = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev))
  sink = torch.empty(sms * 8 * 256, dtype=torch.float32, device="cuda")
  iters = 4096
  for name in ("rate_hmma", "rate_imma"):
    for warps in (4, 8):
      launch(name, sms * 2, warps * 32, iters // 16, sink)  # warm-up
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      launch(name, sms * 2, warps * 32, iters, sink)
      end.record()
      torch.cuda.synchronize()
      dt = start.elapsed_time(end) / 1e3
      mmas = sms * 2 * warps * iters * 8
      print(f"{name}: {warps} warps x 2 CTAs per SM: {mmas / dt / 1e12:.3f} T MMA/s, "
            f"{mmas / dt / sms / (khz * 1e3):.3f} per SM per clock (at the {khz / 1e6:.2f} GHz nominal clock)")
  print("OK: FP16 planes are exact" if fails == 0 else f"FAIL: {fails} sums differ")
  return 0 if fails == 0 else 1


if __name__ == "__main__":
  mode = sys.argv[1] if len(sys.argv) > 1 else "check"
  sys.exit(check() if mode == "check" else gpu(sys.argv[2] if len(sys.argv) > 2 else None))
