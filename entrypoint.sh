#!/usr/bin/env bash
# Run one mode of the course under torchrun: locally, on a node of a cluster, or as
# the command of every docker-compose "node".
#
#   RUN_MODE=tensor_parallel ./entrypoint.sh [extra args for the module]
#
# Environment (all optional):
#   RUN_MODE      which run (default: the tour, else data_parallel_naive); see MODES below
#   NPROC         processes per node (default 2; NPROC=gpu: one per GPU)
#   NNODES        number of nodes (default 1; "MIN:MAX" for an elastic job)
#   NODE_RANK     this node's rank (multi-node; with c10d rendezvous it is only a hint)
#   MASTER_ADDR   rendezvous host (multi-node; default 127.0.0.1)
#   MASTER_PORT   rendezvous port (multi-node; default 29500)
#   RDZV_ID       job id shared by all nodes of one job (default: distlab)
#   MAX_RESTARTS  torchrun --max-restarts (default 0)
set -euo pipefail

# mode -> module run with `torchrun -m` (one line each; tests parse this table)
declare -A MODES=(
  [sequence_parallel]=solutions.phase2_advanced.sequence_parallel
  [pipeline_interleaved]=solutions.phase2_advanced.pipeline
  [parameter_server]=solutions.phase3_multi_node.parameter_server
  [model_split]=solutions.phase2_advanced.model_split
  [tp_dp_2d]=solutions.phase2_advanced.tp_dp_2d
  [activation_checkpointing]=solutions.phase2_advanced.activation_checkpointing
  [monitoring]=solutions.phase4_production.monitoring
  [compression]=solutions.phase4_production.compression
  [tour]=solutions.tour
  [mixed_precision]=solutions.phase2_advanced.mixed_precision
  [imagenet]=solutions.phase4_production.imagenet_trainer
  [zero]=solutions.phase3_multi_node.zero_demo
  [fault_tolerance]=solutions.phase4_production.fault_tolerance
  [pipeline_1f1b]=solutions.phase2_advanced.pipeline
  [pipeline_gpipe]=solutions.phase2_advanced.pipeline
  [ring_allreduce]=solutions.phase3_multi_node.ring_allreduce
  [tensor_parallel]=solutions.phase2_advanced.tensor_parallel
  [data_parallel_naive_grad_accumulation]=solutions.phase2_advanced.grad_accumulation
  [data_parallel_bucket_overlap]=solutions.phase3_multi_node.ddp_bucketed
  [data_parallel_overlap]=solutions.phase3_multi_node.ddp_overlap
  [comm]=solutions.phase1_data_parallel.collectives
  [train]=solutions.phase1_data_parallel.data_loader
  [data_parallel_naive]=solutions.phase1_data_parallel.trainer
)

valid_modes() { printf '%s\n' "${!MODES[@]}" | sort | tr '\n' ' '; }

if [[ -z "${RUN_MODE:-}" ]]; then
  if [[ -n "${MODES[tour]:-}" ]]; then RUN_MODE=tour; else RUN_MODE=data_parallel_naive; fi
fi
if [[ -z "${MODES[$RUN_MODE]:-}" ]]; then
  echo "entrypoint.sh: unknown RUN_MODE '$RUN_MODE'. Valid modes: $(valid_modes)" >&2
  exit 2
fi
module=${MODES[$RUN_MODE]}

NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [[ "$NPROC" == "gpu" ]]; then
  NPROC=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
fi

cd "$(dirname "$0")"
args=(--nproc_per_node="$NPROC" --max_restarts="$MAX_RESTARTS")
if [[ "$NNODES" == "1" ]]; then
  # One machine: torchrun picks a free port itself, so parallel runs never collide.
  args+=(--standalone --nnodes=1)
else
  MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
  MASTER_PORT=${MASTER_PORT:-29500}
  args+=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"
         --rdzv_id="${RDZV_ID:-distlab}")
  if [[ -n "${NODE_RANK:-}" ]]; then
    # Node 0 hosts the rendezvous store; the others only connect to it. Saying so
    # explicitly lets several "nodes" share one host (docker-compose, loopback tests).
    if [[ "$NODE_RANK" == "0" ]]; then host=true; else host=false; fi
    args+=(--node_rank="$NODE_RANK" --rdzv_conf="is_host=$host")
  fi
fi

echo "entrypoint.sh: RUN_MODE=$RUN_MODE -> torchrun ${args[*]} -m $module $*" >&2
exec torchrun "${args[@]}" -m "$module" "$@"
