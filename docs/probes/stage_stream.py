"""What an SM pulls through role 2's cp.async stage pipeline with the math left out (`stage_stream.cu`).

Session 52's `GCMOE_ABLATION=threecta` showed an SM's pace at B <= 2 not growing with a third CTA (three GEMM1
items on an SM at 69.8 us each, two at 44.8: docs/kernels_v2.md "Three CTAs per SM for B <= 2"), so the one-row
stage is bound by something per SM. This probe streams role 2's GEMM1 items of GLM5.2 at B = 1 (8 experts, 4096 rows
of 64 B over 48 K128 stages: 256 items of 128 rows, claimed from a counter) through the same pipeline (8 slots, a
barrier every two stages, 6 in flight, 16-B `cp.async.cg` weight copies), with the scale words copied as role 2 does
(mode 1: 4 B per row and stage), not at all (0), as `scpair` does (2: 8 B per row and paired step) or from the
MN-major scales of session 53 (3: a stage's 512-B run by 32 16-B copies), or mode 3's bytes by the TMA engine (4:
two 1-D bulk copies a stage onto the slot's mbarrier, session 55), at 1, 2 and 3
CTAs per SM, and a fixed spin per step in place of the math. It prints the time per pass over the weights, the
bytes per second and the KB per us and SM, against which role 2's ~18.6 KB/us per SM at B = 1-2 (two GEMM1 items
of 417 KB in 44.8 us) reads:

- mode 1 at 2 CTAs and spin 0 near the device's read rate (~3.1 TB/s on the H100, ~23.6 KB/us per SM): the copies
  are not the bound, the math is; far below it, and mode 0 or 2 well above: the scale copies cost the SM's pace.
- the spins: at which per-step latency the stream falls to role 2's rate, at each CTA count.

``python docs/probes/stage_stream.py [--cubin PATH] [--spins 0,1000,2000,4000] [--iters 20]`` on the GPU machine
(needs torch and cuda-bindings). The cubin is built here with ``nvcc -arch=sm_90a -cubin -O3 -o
docs/probes/stage_stream.cubin docs/probes/stage_stream.cu`` and carried, or compiled there by the nvcc on PATH.
"""
import argparse
import pathlib
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
SLOT_BYTES = 128 * 64 + 128 * 8
SLOTS = 8
MBAR_BYTES = SLOTS * 8  # mode 4's mbarriers, after the slots


def main(argv) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cubin", default=None)
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--rows", type=int, default=4096, help="weight rows per expert (GLM5.2's GEMM1: 2 I = 4096)")
  ap.add_argument("--kb", type=int, default=48, help="K128 stages per item (GLM5.2's GEMM1: H / 128 = 48)")
  ap.add_argument("--modes", default="1,0,2,3", help="scale-word copies: 0 none, 1 4 B per row and stage, "
                  "2 8 B per row and paired step, 3 MN-major: a stage's 512-B run by 16-B copies, 4: mode 3's bytes by "
                  "the TMA engine (1-D bulk copies onto an mbarrier a slot)")
  ap.add_argument("--ctas", default="1,2,3")
  ap.add_argument("--spins", default="0,1000,2000,4000", help="clocks spun per paired step after its reads")
  ap.add_argument("--iters", type=int, default=20)
  a = ap.parse_args(argv)
  if "4" in a.modes.split(",") and a.kb % SLOTS:
    ap.error(f"--kb must be a multiple of {SLOTS} with mode 4 (its mbarriers' phases), got {a.kb}")

  import torch
  from cuda.bindings import driver as cu

  def ok(res):
    err, *vals = res
    if err != cu.CUresult.CUDA_SUCCESS:
      raise RuntimeError(f"CUDA driver: {err}")
    return vals[0] if len(vals) == 1 else (vals or None)

  path = pathlib.Path(a.cubin) if a.cubin else HERE / "stage_stream.cubin"
  if not path.exists():
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-o", str(path), str(HERE / "stage_stream.cu")],
                   check=True)
  torch.cuda.init()
  torch.zeros(1, device="cuda")
  dev = torch.cuda.current_device()
  sms = torch.cuda.get_device_properties(dev).multi_processor_count
  mod = ok(cu.cuModuleLoadData(path.read_bytes()))
  stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)

  w_bytes = a.experts * a.kb * a.rows * 64
  s_words = a.experts * a.rows * a.kb
  # Two copies of the weights, alternated, so that a pass never finds the previous one's lines in L2.
  ws = [torch.randint(0, 256, (w_bytes,), dtype=torch.uint8, device="cuda") for _ in range(2)]
  ss = [torch.randint(0, 2**31 - 1, (s_words,), dtype=torch.int32, device="cuda") for _ in range(2)]
  counters = torch.zeros(a.iters + 2, dtype=torch.int32, device="cuda")
  sink = torch.zeros(3 * sms, dtype=torch.int32, device="cuda")
  items = a.experts * (a.rows // 128)
  print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; {items} items of 128 rows x {a.kb} K128 stages, "
        f"{w_bytes / 1e6:.1f} MB of weights a pass (+ {s_words * 4 / 1e6:.1f} MB of scale words)")
  print("| CTAs/SM (resident) | mode | spin (clk/step) | us per pass | GB/s (weights + words) | KB/us per SM |")
  print("| --- | --- | --- | --- | --- | --- |")
  for ctas in (int(c) for c in a.ctas.split(",")):
    fn = ok(cu.cuModuleGetFunction(mod, f"stage_stream_{ctas}".encode()))
    smem = SLOTS * SLOT_BYTES + MBAR_BYTES
    ok(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    resident = ok(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, 256, smem))
    for mode in (int(m) for m in a.modes.split(",")):
      for spin in (int(s) for s in a.spins.split(",")):
        def launch(i):
          held = [np.array([ws[i % 2].data_ptr()], np.uint64), np.array([ss[i % 2].data_ptr()], np.uint64),
                  np.array([a.experts], np.int32), np.array([a.rows], np.int32), np.array([a.kb], np.int32),
                  np.array([mode], np.int32), np.array([spin], np.int32),
                  np.array([counters.data_ptr() + 4 * i], np.uint64), np.array([sink.data_ptr()], np.uint64)]
          ptrs = np.array([h.ctypes.data for h in held], dtype=np.uint64)
          ok(cu.cuLaunchKernel(fn, ctas * sms, 1, 1, 256, 1, 1, smem, stream, ptrs.ctypes.data, 0))

        counters.zero_()
        launch(a.iters)  # warm-up (its own counter)
        launch(a.iters + 1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(a.iters):
          launch(i)
        end.record()
        torch.cuda.synchronize()
        claimed = counters[:a.iters].cpu().numpy()
        assert (claimed >= items).all(), claimed  # every item was claimed in every pass
        us = start.elapsed_time(end) * 1e3 / a.iters
        moved = w_bytes + (s_words * 4 if mode else 0)
        print(f"| {ctas} ({resident}) | {mode} | {spin} | {us:.1f} | {moved / us / 1e3:.0f} | "
              f"{moved / us / 1e3 / sms:.1f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
