#!/usr/bin/env bash
# Nsight Compute on role 2 (docs/kernels_v2.md): one GLM5.2 per-rank layer (routed) at batch B through gm.moe, the
# second call's role-2 kernel profiled. Run on the GPU machine with the cubins carried:
#   GCMOE_CUBIN_DIR=$PWD/.cubins bash docs/probes/ncu_role2.sh 1 64
set -u
for B in "$@"; do
  ncu --clock-control none -k regex:gcmoe_role2 --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --metrics smsp__inst_executed.sum,smsp__inst_executed_pipe_tensor.sum,smsp__pcsamp_sample_count \
    python "$(dirname "$0")/moe_layer.py" "$B"
done
