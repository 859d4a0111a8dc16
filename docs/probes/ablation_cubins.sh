#!/usr/bin/env bash
# The cubins a device call needs to check and time timing ablations (issue 6; docs/kernels_v2.md), under the current
# source key: main's build, the timeline's, and each NAME's and timeline+NAME's, of both paper models' routed
# capacity-8 variants (B = 1..8, where the session-42 ablations act) and the small shape's (the 8-token GPU test).
#
#   bash docs/probes/ablation_cubins.sh NAME [NAME ...]     # here (CuTe DSL), after the last kernel edit: into .cubins
#
# Then, in device calls with .cubins carried (.ci/gpu-check's steps; each fits one 10-minute call for two NAMEs):
#   GCMOE_ABLATION=NAME GPU_STEPS="install tests" GPU_TESTS_K="eight_tokens_match or [1-routed or [2-routed or
#     [8-routed" bash .ci/gpu-check                                  # exact: every bit the oracle's, per NAME
#   GPU_STEPS="install timeline" GPU_TL="timeline|timeline+NAME|..." bash .ci/gpu-check
#   GPU_STEPS="install ab" GPU_AB="|GCMOE_ABLATION=NAME|..." AB_BATCH=1,2,4,8 AB_MODELS=glm5.2 bash .ci/gpu-check
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash docs/probes/ablation_cubins.sh NAME [NAME ...]" >&2; exit 2; }
tmp=$(mktemp -d)
settings=("" timeline)
for name in "$@"; do settings+=("$name" "timeline+$name"); done
for a in "${settings[@]}"; do
  GCMOE_ABLATION=$a python -m gcmoe_jax build-kernels --arch sm_90a --out "$tmp" --jobs 2 \
    --variant 6144,2048,32,8,8 --variant 5120,2304,48,6,8 --variant 512,256,8,4,8 > /dev/null
done
mkdir -p .cubins
for d in "$tmp"/*/; do  # the cubins and manifests (the PTX stays here: the carry is at most 64 MiB)
  mkdir -p ".cubins/$(basename "$d")"
  cp "$d"/meta.json "$d"/role*.cubin ".cubins/$(basename "$d")/"
done
ls .cubins | grep -c -- -sm_90a- | xargs echo "builds in .cubins:"
du -sh .cubins
