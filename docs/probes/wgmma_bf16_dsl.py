"""The k32r pass of `wgmma_bf16.cu` in CuTe DSL with role 2's BF16 helpers (`roles_v2._bf16_decode`,
`_wgmma_bf16_block`, `_wgmma_wait_add`: docs/kernels_v2.md "Session 58", "Session 59"), as a standalone kernel
whose data sit in SMEM: the BF16 wide pass's rate without its copies, barriers and epilogues.

A warpgroup takes 64 weight rows and T tokens per K32 block: the lane's word t4 of the weights' real payload
layout (`bf16fold.lane_word`, as role 2's ldmatrix loads give it), decoded by `bf16fold.decode_pair`'s five
instructions a register, two BF16 `wgmma` m64nTk16 from the activation plane (in `bf16fold.B_PLANE_ORDER`) into one
of two accumulator sets, whose sum is added to the FP32 accumulator while the next block's wgmma runs; 8 K32 blocks
resident in SMEM, cycled. What it shows: that ptxas does not serialize those wgmma (the SASS of `build`), and, on
the GPU, the rate against the CUDA probe's k32r row.

CPU: ``python docs/probes/wgmma_bf16_dsl.py build [--tokens 64 32] [--out DIR]`` compiles a cubin per T for sm_90a
(``DIR/wgmma_bf16_dsl_T<T>.cubin`` and ``.json`` with the entry name; default DIR docs/probes/.dsl) and prints the
SASS's HGMMA and WARPGROUP counts when cuobjdump is on PATH.
GPU (torch, cuda-bindings; carry DIR, the package importable): ``PYTHONPATH=$PWD python
docs/probes/wgmma_bf16_dsl.py run [--out DIR]`` checks every output against the host's double sums (within 2**-18
of the terms' magnitude sum) and prints (row, token, K32 block) triples per ns per SM.
"""
import argparse
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROWS, NB, THREADS = 128, 8, 256


def sizes(t: int) -> dict:
  a = NB * ROWS * 16  # [block][row] 16 payload bytes
  b_block = 4 * (t // 8) * 128  # [k8 group 0..3][n8 group][8 n][8 k] BF16, no swizzle
  s = NB * ROWS * 4  # [block][row] bf16x2 2**(126 + ew)
  return {"a": a, "b_block": b_block, "b": NB * b_block, "s": s, "total": a + NB * b_block + s,
          "lbo": (t // 8) * 128, "sbo": 128}


# ---- the kernel (CPU: CuTe DSL) ----------------------------------------------------------------------------------

try:  # the GPU machine has no CuTe DSL: there the cubins come built
  import cutlass
  from cutlass import Int32, Int64, Uint8, cute

  from gcmoe_jax.kernels.roles_v2 import _bf16_decode, _lds, _smem_desc, _wgmma_bf16_block, _wgmma_wait_add
except ImportError:
  cutlass = None


if cutlass is not None:  # (the class is defined only where CuTe DSL is: its decorators trace the kernel)

  class Probe:
    """The k32r pass at T tokens (`build`), with role 2's BF16 helpers (`roles_v2._stage_bf16`'s)."""

    def __init__(self, tokens: int):
      self.t = tokens
      self.nt = tokens // 8  # n-tiles: accumulator registers per thread 4 nt (m64nT)
      self.sz = sizes(tokens)

    def _decode(self, sa, ss, q, row0, t4):
      b = q % NB
      w0 = _lds(sa + (b * ROWS + row0) * 16 + t4 * 4)  # `bf16fold.lane_word`: word t4 of the row's 16 bytes
      w1 = _lds(sa + (b * ROWS + row0 + 8) * 16 + t4 * 4)
      s0 = _lds(ss + (b * ROWS + row0) * 4)
      s1 = _lds(ss + (b * ROWS + row0 + 8) * 4)
      return [_bf16_decode(w, r, s) for r in range(4) for w, s in ((w0, s0), (w1, s1))]

    def _issue(self, a, sb, q):
      base = sb + (q % NB) * self.sz["b_block"]
      lbo, sbo = self.sz["lbo"], self.sz["sbo"]
      return _wgmma_bf16_block(self.nt, a, _smem_desc(base, lbo, sbo), _smem_desc(base + 2 * lbo, lbo, sbo))

    @cute.kernel
    def kern(self, ga: cute.Pointer, gb: cute.Pointer, gs: cute.Pointer, out: cute.Pointer, nblk: Int32):
      sz, tokens = self.sz, self.t
      tid, _, _ = cute.arch.thread_idx()
      bid, _, _ = cute.arch.block_idx()
      smem = cute.arch.get_dyn_smem(Int32, alignment=1024).toint()
      sa = smem
      sb = smem + sz["a"]
      ss = smem + sz["a"] + sz["b"]
      for src, dst, n in ((ga, sa, sz["a"]), (gb, sb, sz["b"]), (gs, ss, sz["s"])):
        for i in range(tid, n // 16, THREADS):
          cute.arch.inline_ptx("{ .reg .b32 _a, _b, _c, _d; ld.global.v4.u32 {_a, _b, _c, _d}, [{$r0}]; "
                               "st.shared.v4.u32 [{$r1}], {_a, _b, _c, _d}; }",
                               read_only_args=[src.toint() + Int64(i) * 16, dst + i * 16])
      cute.arch.inline_ptx("fence.proxy.async.shared::cta;", read_only_args=[])
      cute.arch.sync_threads()

      warp = tid // 32
      lane = tid % 32
      t4 = lane % 4
      row0 = 16 * warp + lane // 4
      acc = cute.make_rmem_tensor(4 * self.nt, Int32)
      for i in cutlass.range_constexpr(4 * self.nt):
        acc[i] = Int32(0)
      for q in range(0, nblk, 4):
        d0 = self._issue(self._decode(sa, ss, q, row0, t4), sb, q)
        d1 = self._issue(self._decode(sa, ss, q + 1, row0, t4), sb, q + 1)
        _wgmma_wait_add(self.nt, 1, acc, d0)
        d0 = self._issue(self._decode(sa, ss, q + 2, row0, t4), sb, q + 2)
        _wgmma_wait_add(self.nt, 1, acc, d1)
        d1 = self._issue(self._decode(sa, ss, q + 3, row0, t4), sb, q + 3)
        _wgmma_wait_add(self.nt, 1, acc, d0)
        _wgmma_wait_add(self.nt, 0, acc, d1)
      # acc[4 j + 2 h + p]: row row0 + 8 h, token 8 j + 2 t4 + p.
      base = out.toint() + Int64(bid * ROWS * tokens) * 4
      for j in cutlass.range_constexpr(tokens // 8):
        for h in cutlass.range_constexpr(2):
          for p in cutlass.range_constexpr(2):
            cute.arch.inline_ptx("st.global.b32 [{$r0}], {$r1};",
                                 read_only_args=[base + Int64((row0 + 8 * h) * tokens + 8 * j + 2 * t4 + p) * 4,
                                                 acc[4 * j + 2 * h + p]])

    @cute.jit
    def launch(self, ga: cute.Pointer, gb: cute.Pointer, gs: cute.Pointer, out: cute.Pointer, nblk: Int32):
      self.kern(ga, gb, gs, out, nblk).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], smem=self.sz["total"])


def build(tokens: int, out: pathlib.Path) -> pathlib.Path:
  """Compiles the pass at T = ``tokens`` for sm_90a into ``out`` (cubin + json with its entry name)."""
  from cutlass.cute.runtime import make_ptr

  probe = Probe(tokens)
  out.mkdir(parents=True, exist_ok=True)
  dump = out / f".dump{tokens}"
  shutil.rmtree(dump, ignore_errors=True)
  dump.mkdir()
  ptrs = [make_ptr(Uint8, 0, cute.AddressSpace.gmem, assumed_align=16) for _ in range(4)]
  cute.compile(probe.launch, *ptrs, Int32(0), options=f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {dump}")
  cubin = out / f"wgmma_bf16_dsl_T{tokens}.cubin"
  next(dump.glob("*.cubin")).rename(cubin)
  ptx = next(dump.glob("*.ptx")).read_text()
  entry = next(ln.split()[-1].split("(")[0] for ln in ptx.splitlines() if ".entry" in ln)
  (out / f"wgmma_bf16_dsl_T{tokens}.json").write_text(json.dumps({"entry": entry, "tokens": tokens, **probe.sz}))
  (out / f"wgmma_bf16_dsl_T{tokens}.ptx").write_text(ptx)
  shutil.rmtree(dump)
  return cubin


def sass_summary(cubin: pathlib.Path) -> str:
  if shutil.which("cuobjdump") is None:
    return "(no cuobjdump on PATH)"
  sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True).stdout
  ops = [ln.split("*/")[1].split()[0] for ln in sass.splitlines() if "*/" in ln and ln.strip().startswith("/*")
         and len(ln.split("*/")) > 1 and ln.split("*/")[1].split()]
  count = lambda p: sum(1 for o in ops if o.startswith(p))  # noqa: E731
  return (f"{len(ops)} instructions: HGMMA {count('HGMMA')}, WARPGROUP.ARRIVE {count('WARPGROUP.ARRIVE')}, "
          f"WARPGROUP.DEPBAR {count('WARPGROUP.DEPBAR')}, HMUL2 {count('HMUL2')}, PRMT {count('PRMT')}, "
          f"FADD {count('FADD')}, LDL/STL {count('LDL') + count('STL')}")


# ---- the run (GPU: cuda-bindings) ----------------------------------------------------------------------------------


def problem(tokens: int, seed: int):
  import ml_dtypes

  from gcmoe_jax import formats
  from gcmoe_jax.kernels import bf16fold
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 16, (NB, ROWS, 32))
  e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  finite = np.nonzero(np.isfinite(e4m3))[0]
  x = e4m3[rng.choice(finite, (NB, tokens, 32))] * np.exp2(rng.integers(-12, -3, (NB, tokens, 1)))
  ew = rng.integers(-10, 2, (NB, ROWS))
  e2m1 = np.asarray(formats.decode_e2m1(np.arange(16, dtype=np.uint8)), np.float64)
  w = e2m1[codes] * np.exp2(ew)[..., None]  # [NB, ROWS, 32]
  payload = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # [NB, ROWS, 16]: byte i = K 2i, 2i + 1
  plane = x[..., bf16fold.B_PLANE_ORDER]  # [NB, T, 32] in the fragment's K order
  sz = sizes(tokens)
  bimg = np.zeros((NB, sz["b_block"] // 2), np.uint16)
  t = np.arange(tokens)[:, None]
  k = np.arange(32)[None, :]
  idx = ((k // 8) * (tokens // 8) + t // 8) * 64 + (t % 8) * 8 + k % 8
  bits = plane.astype(np.float32).astype(ml_dtypes.bfloat16)
  assert np.array_equal(bits.astype(np.float64), plane), "an activation is not exact in BF16"
  for b in range(NB):
    bimg[b, idx] = bits[b].view(np.uint16)
  h = ((126 + ew + 127) << 7).astype(np.uint32)
  simg = (h | (h << 16)).astype(np.uint32)
  return payload, bimg, simg, w, x


def run(out: pathlib.Path) -> int:
  """Loads each built cubin (cuda-bindings; memory and events from torch, as `stage_stream.py` does), checks it
  against the host's double sums and times it at 1-3 CTAs per SM."""
  import torch
  from cuda.bindings import driver as cu

  def ok(res):
    err, *vals = res
    if err != cu.CUresult.CUDA_SUCCESS:
      raise RuntimeError(f"CUDA driver: {err}")
    return vals[0] if len(vals) == 1 else (vals or None)

  torch.cuda.init()
  torch.zeros(1, device="cuda")
  dev = torch.cuda.current_device()
  sms = torch.cuda.get_device_properties(dev).multi_processor_count
  stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
  print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs", flush=True)
  metas = sorted(out.glob("wgmma_bf16_dsl_T*.json"))
  if not metas:
    raise SystemExit(f"no cubins in {out}: run `build` on a machine with CuTe DSL and carry {out}")
  for meta_path in metas:
    meta = json.loads(meta_path.read_text())
    tokens, smem = meta["tokens"], meta["total"]
    mod = ok(cu.cuModuleLoadData(meta_path.with_suffix(".cubin").read_bytes()))
    fn = ok(cu.cuModuleGetFunction(mod, meta["entry"].encode()))
    ok(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    regs = ok(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, fn))
    local = ok(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn))
    per_sm = ok(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, THREADS, smem))
    print(f"T={tokens}: {regs} registers, {local} B local, {smem} B SMEM, {per_sm} CTA/SM", flush=True)
    payload, bimg, simg, w, x = problem(tokens, 1234 + tokens)
    dev_in = [torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).reshape(-1)).cuda()
              for a in (payload, bimg, simg)]
    dout = torch.empty(max(per_sm, 1) * sms * ROWS * tokens, dtype=torch.float32, device="cuda")

    def launch(nblk: int, grid: int) -> None:
      held = [np.array([t.data_ptr()], np.uint64) for t in dev_in + [dout]] + [np.array([nblk], np.int32)]
      ptrs = np.array([h.ctypes.data for h in held], dtype=np.uint64)
      ok(cu.cuLaunchKernel(fn, grid, 1, 1, THREADS, 1, 1, smem, stream, ptrs.ctypes.data, 0))

    nchk = 64
    launch(nchk, sms)
    torch.cuda.synchronize()
    got = dout[:sms * ROWS * tokens].cpu().numpy().reshape(sms, ROWS, tokens)
    blocks = np.arange(nchk) % NB
    terms = np.einsum("brk,btk->brtk", w[blocks], x[blocks])  # [nchk, ROWS, T, 32]
    want, mag = terms.sum((0, 3)), np.abs(terms).sum((0, 3))
    err = np.abs(got - want[None]) / np.maximum(mag[None], 1e-300)
    print(f"T={tokens} k32r (CuTe DSL): {(err > 2.0**-18).sum()} of {err.size} outputs beyond 2**-18 of the terms' "
          f"magnitude; worst {err.max():.3e}", flush=True)
    nblk = 1 << 14
    for c in range(1, min(per_sm, 3) + 1):
      launch(4, sms * c)  # warm-up
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      launch(nblk, sms * c)
      end.record()
      torch.cuda.synchronize()
      ms = start.elapsed_time(end)
      rate = c * ROWS * tokens * nblk / (ms * 1e6)
      print(f"T={tokens} k32r (CuTe DSL) {c} CTA/SM: {ms:.3f} ms for {nblk} blocks: {rate:.2f} (row, token, block) "
            "per ns per SM", flush=True)
  return 0


def main(argv) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("what", choices=("build", "run"))
  ap.add_argument("--tokens", type=int, nargs="+", default=[64, 32])
  ap.add_argument("--out", type=pathlib.Path, default=HERE / ".dsl")
  args = ap.parse_args(argv)
  if args.what == "build":
    for t in args.tokens:
      if t not in (8, 16, 32, 64, 128):
        raise SystemExit(f"--tokens: each T must be 8, 16, 32, 64 or 128, got {t}")
      cubin = build(t, args.out)
      print(f"T={t}: {cubin} ({sass_summary(cubin)})", flush=True)
    return 0
  return run(args.out)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
