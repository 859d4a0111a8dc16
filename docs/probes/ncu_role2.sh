#!/usr/bin/env bash
# Nsight Compute on role 2 (docs/kernels_v2.md): one GLM5.2 per-rank layer (routed) at batch B through gm.moe, the
# second call's role-2 kernel profiled, with the stall reasons of its PC samples. Run on the GPU machine with the
# cubins carried:
#   GCMOE_CUBIN_DIR=$PWD/.cubins bash docs/probes/ncu_role2.sh 1 64
# NCU_LAYER: moe_layer.py's arguments after B ("dsv", "glm shared"); NCU_MORE=1 adds the pipe, shared-memory and
# instruction-mix sections (where two CTAs of an SM compete: session 41 measured a GEMM1 item 1.4x slower beside
# another than alone) and prints their tables. NCU_SOURCE=DIR also samples the warps' PCs every 256 cycles per
# scheduler (SourceCounters) and writes DIR/role2_B.ncu-rep and DIR/role2_B_sass.csv, ncu's source page per SASS
# instruction (its stall samples by reason), which `python docs/probes/sass_stalls.py` reads.
set -u
# Without XLA's preallocated pool ncu backs up (for its kernel replays) only the memory the layer uses; the shared
# variant's run under the pool ended in a segmentation fault in session 45.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
more=()
[[ -n "${NCU_MORE:-}" ]] && more=(--section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables --section InstructionStats --print-details all)
metrics=smsp__inst_executed.sum,smsp__inst_executed_pipe_tensor.sum,smsp__pcsamp_sample_count
for r in barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle membar \
    mio_throttle misc no_instructions not_selected selected short_scoreboard sleeping tex_throttle wait; do
  metrics+=,smsp__pcsamp_warps_issue_stalled_$r
done
src=()
[[ -n "${NCU_SOURCE:-}" ]] && mkdir -p "$NCU_SOURCE" && src=(--section SourceCounters --warp-sampling-interval 3 \
  --import-source no)
for B in "$@"; do
  [[ -n "${NCU_SOURCE:-}" ]] && src_out=(-o "$NCU_SOURCE/role2_$B" -f) || src_out=()
  ncu --clock-control none -k regex:gcmoe_role2 --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    "${more[@]}" "${src[@]}" "${src_out[@]}" --metrics "$metrics" python "$(dirname "$0")/moe_layer.py" "$B" \
    ${NCU_LAYER:-}
  if [[ -n "${NCU_SOURCE:-}" ]]; then
    ncu -i "$NCU_SOURCE/role2_$B.ncu-rep" --page details --print-details all 2>&1 | head -150
    ncu -i "$NCU_SOURCE/role2_$B.ncu-rep" --page source --csv --print-source sass > "$NCU_SOURCE/role2_${B}_sass.csv"
    wc -c "$NCU_SOURCE/role2_${B}_sass.csv"; head -3 "$NCU_SOURCE/role2_${B}_sass.csv" | cut -c1-1500
  fi
done
