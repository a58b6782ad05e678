#!/usr/bin/env bash
# Run one mode of the course under torchrun: locally, on a node of a cluster, or as
# the command of every docker-compose "node".
#
#   RUN_MODE=tensor_parallel ./entrypoint.sh [extra args for the module]
#
# Environment (all optional):
#   RUN_MODE      which run (default: the tour, else data_parallel_naive); see MODES below
#   IMPL          whose lesson code the demo runs: solutions (default) or templates (yours;
#                 an unfinished TODO ends the run with one line naming it)
#   NPROC         processes per node (default 2; NPROC=gpu: one per GPU)
#   NNODES        number of nodes (default 1; "MIN:MAX" for an elastic job)
#   NODE_RANK     0 on the node that hosts the rendezvous (multi-node); ranks are handed out in
#                 arrival order (c10d rendezvous), so on other nodes any value but 0 means "connect"
#   MASTER_ADDR   rendezvous host (multi-node; default 127.0.0.1)
#   MASTER_PORT   rendezvous port (multi-node; default 29500; an integer 1-65535)
#   RDZV_ID       job id shared by all nodes of one job (default: distlab)
#   RDZV_TIMEOUT  seconds a node waits for the others to join (multi-node; default 600, torchrun's);
#                 it says "waiting for 1 of 2 nodes at ADDR:PORT ..." every 30 s meanwhile
#   MAX_RESTARTS  torchrun --max-restarts (default 0)
#   DISTLAB_TRACE a folder for a trace of the run (or the argument --trace DIR): DIR/trace.json
#
# Listening sockets: one node (NNODES=1) listens on 127.0.0.1 only (rendezvous store,
# gloo, NCCL bootstrap); several nodes listen on MASTER_ADDR (the store) and on the
# interface GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME names. torchrun runs through
# `python -m distlab.launch`, which is torchrun with its stores bound to those addresses
# (TORCHRUN=<command> replaces it, e.g. with plain `torchrun`, at the cost of a store on
# every interface).
set -euo pipefail

# mode -> module run with `torchrun -m` (one line each; tests parse this table). Every
# mode is a demo in demos/: it runs the lesson code chosen by IMPL (below) and prints a summary.
declare -A MODES=(
  [tour]=demos.tour
  [comm]=demos.comm
  [train]=demos.train
  [data_parallel_naive]=demos.data_parallel_naive
  [data_parallel_naive_grad_accumulation]=demos.data_parallel_naive_grad_accumulation
  [mixed_precision]=demos.mixed_precision
  [activation_checkpointing]=demos.activation_checkpointing
  [model_split]=demos.model_split
  [pipeline_gpipe]=demos.pipeline
  [pipeline_1f1b]=demos.pipeline
  [pipeline_interleaved]=demos.pipeline
  [tensor_parallel]=demos.tensor_parallel
  [tp_dp_2d]=demos.tp_dp_2d
  [sequence_parallel]=demos.sequence_parallel
  [ring_allreduce]=demos.ring_allreduce
  [parameter_server]=demos.parameter_server
  [data_parallel_overlap]=demos.data_parallel_overlap
  [data_parallel_bucket_overlap]=demos.data_parallel_bucket_overlap
  [zero]=demos.zero
  [fault_tolerance]=demos.fault_tolerance
  [compression]=demos.compression
  [monitoring]=demos.monitoring
  [imagenet]=demos.imagenet
  [context_parallel]=demos.context_parallel
  [expert_parallel]=demos.expert_parallel
  [device_mesh]=demos.device_mesh
  [sharded_checkpoint]=demos.sharded_checkpoint
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
IMPL=${IMPL:-${DISTLAB_IMPL:-solutions}}
if [[ "$IMPL" != "solutions" && "$IMPL" != "templates" ]]; then
  echo "entrypoint.sh: IMPL must be 'solutions' or 'templates', not '$IMPL'" >&2
  exit 2
fi
export DISTLAB_IMPL=$IMPL   # read by distlab.loader.load() in every rank

NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [[ "$NPROC" == "gpu" ]]; then
  NPROC=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
# Bad values stop here with what to write instead, not deep inside torchrun.
bad() { echo "entrypoint.sh: $*" >&2; exit 2; }
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] ||
  bad "NPROC='$NPROC' is not a number of processes per node: use a positive integer (NPROC=2), or NPROC=gpu"
[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] ||
  bad "NNODES='$NNODES' is not a number of nodes: use a positive integer (NNODES=2)," \
      "or MIN:MAX for an elastic job (NNODES=2:4)"
if [[ "$NNODES" == *:* ]] && (( ${NNODES%:*} > ${NNODES#*:} )); then
  bad "NNODES='$NNODES': the minimum is above the maximum; use NNODES=${NNODES#*:}:${NNODES%:*}"
fi
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] ||
  bad "MAX_RESTARTS='$MAX_RESTARTS' is not a number of restarts: use a whole number (MAX_RESTARTS=3), or 0 for none"
[[ -z "${RDZV_TIMEOUT:-}" || "$RDZV_TIMEOUT" =~ ^[1-9][0-9]*$ ]] ||
  bad "RDZV_TIMEOUT='$RDZV_TIMEOUT' is not a number of seconds: use a positive integer (RDZV_TIMEOUT=600)"
[[ -z "${NODE_RANK:-}" || "$NODE_RANK" =~ ^[0-9]+$ ]] ||
  bad "NODE_RANK='$NODE_RANK' is not a node rank: use 0 on the first node, 1 on the next, ... (NODE_RANK=0)"

# The rendezvous address: checked wherever it is set (one node ignores it, but a bad value is a
# mistake all the same) and resolved where it is used (several nodes), so a typo is one line here,
# not torchrun's traceback. MASTER_PORT: an integer 1-65535 (0 would let each node pick its own).
if [[ -n "${MASTER_PORT+set}" ]]; then
  [[ "$MASTER_PORT" =~ ^[0-9]{1,5}$ ]] && (( 10#$MASTER_PORT >= 1 && 10#$MASTER_PORT <= 65535 )) ||
    bad "MASTER_PORT='$MASTER_PORT' is not a TCP port: use an integer from 1 to 65535 that is free on node 0" \
        "(MASTER_PORT=29500)"
fi
if [[ -n "${MASTER_ADDR+set}" ]]; then
  [[ -n "${MASTER_ADDR//[[:space:]]/}" ]] ||
    bad "MASTER_ADDR is set but empty: name node 0's host or IP address (MASTER_ADDR=10.0.0.1), or unset it" \
        "for 127.0.0.1"
  if [[ "$MASTER_ADDR" =~ ^[^:]+:[0-9]+$ ]]; then
    bad "MASTER_ADDR='$MASTER_ADDR' has a port: use MASTER_ADDR=${MASTER_ADDR%:*} MASTER_PORT=${MASTER_ADDR##*:}"
  fi
  [[ "$MASTER_ADDR" =~ ^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$ || "$MASTER_ADDR" =~ ^\[?[0-9A-Fa-f:.]+(%[A-Za-z0-9]+)?\]?$ ]] ||
    bad "MASTER_ADDR='$MASTER_ADDR' is not a host name or IP address: write node 0's address alone" \
        "(MASTER_ADDR=node0 or 10.0.0.1; the port goes in MASTER_PORT)"
  if [[ "$NNODES" != "1" && ! "$MASTER_ADDR" =~ ^[0-9.]+$ && "$MASTER_ADDR" != *:* ]]; then
    # A name: one lookup, bounded (an unreachable DNS server must not hold the job for minutes).
    if command -v getent > /dev/null; then resolve=(getent ahosts "$MASTER_ADDR")
    else resolve=(python -c 'import socket, sys; socket.getaddrinfo(sys.argv[1], None)' "$MASTER_ADDR"); fi
    timeout 10 "${resolve[@]}" > /dev/null 2>&1 ||
      bad "MASTER_ADDR='$MASTER_ADDR' does not resolve on this node: use node 0's host name as this node" \
          "sees it, or its IP address (MASTER_ADDR=10.0.0.1)"
  fi
fi

caller_dir=$PWD  # relative paths given by the user (--trace DIR) are theirs, not the checkout's
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
  rdzv_conf=()
  if [[ -n "${NODE_RANK:-}" ]]; then
    # Node 0 hosts the rendezvous store; the others only connect to it. Saying so
    # explicitly lets several "nodes" share one host (docker-compose, loopback tests).
    # Not --node_rank: c10d ignores it and torchrun warns so on every node but node 0.
    if [[ "$NODE_RANK" == "0" ]]; then rdzv_conf+=("is_host=true"); else rdzv_conf+=("is_host=false"); fi
  fi
  [[ -n "${RDZV_TIMEOUT:-}" ]] && rdzv_conf+=("join_timeout=$RDZV_TIMEOUT")
  if (( ${#rdzv_conf[@]} )); then args+=(--rdzv_conf="$(IFS=,; echo "${rdzv_conf[*]}")"); fi
fi

# Arguments for the mode: empty ones dropped (docker-compose passes RUN_ARGS="" as one), and
# the checkpointing modes write to $CHECKPOINT_DIR (the compose/cluster shared volume) unless
# the arguments name a directory themselves.
# --trace DIR (any mode): every rank's communication over time (and what the mode measured itself,
# e.g. a pipeline stage's compute and idle time), merged into DIR/trace.json for Perfetto
# (distlab/trace.py); the same as DISTLAB_TRACE=DIR. The run ends with one line: "trace: DIR/trace.json
# (N ranks): open it in https://ui.perfetto.dev ...".
mode_args=()
while (( $# )); do
  case "$1" in
    --trace) [[ $# -ge 2 && -n "$2" ]] || bad "--trace needs a folder: --trace DIR (DIR/trace.json is written)"
             DISTLAB_TRACE=$2; shift 2; continue ;;
    --trace=*) DISTLAB_TRACE=${1#--trace=}; shift; continue ;;
  esac
  [[ -n "$1" ]] && mode_args+=("$1")
  shift
done
if [[ -n "${DISTLAB_TRACE:-}" ]]; then
  [[ "$DISTLAB_TRACE" == /* ]] || DISTLAB_TRACE=$caller_dir/$DISTLAB_TRACE
  mkdir -p "$DISTLAB_TRACE" && export DISTLAB_TRACE
fi
if [[ -n "${CHECKPOINT_DIR:-}" ]]; then
  case "$RUN_MODE" in
    imagenet) flag=--checkpoint-dir ;;
    fault_tolerance) flag=--ckpt-dir ;;
    *) flag= ;;
  esac
  if [[ -n "$flag" && " ${mode_args[*]-} " != *" $flag"* ]]; then
    mode_args+=("$flag=$CHECKPOINT_DIR/$RUN_MODE")
  fi
fi
set -- ${mode_args[@]+"${mode_args[@]}"}

read -r -a launcher <<< "${TORCHRUN:-python -m distlab.launch}"  # torchrun, bound as said at the top
echo "entrypoint.sh: RUN_MODE=$RUN_MODE IMPL=$IMPL -> torchrun ${args[*]} -m $module $*" >&2
if [[ "$IMPL" == "templates" ]]; then
  # Every rank stops at the learner's first unfinished TODO with the same line (exit code 3);
  # stderr goes through a filter that prints that line once instead of torchrun's report of
  # every rank's exit. stdout (progress, tables) passes straight through.
  set +e
  # The filter ignores Ctrl-C: it reads on until the launcher (which says it was stopped) closes the pipe.
  todo_filter='import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN)
from distlab.todo import TODO_EXIT_CODE, filter_launcher_output as f
sys.exit(TODO_EXIT_CODE if f(sys.stdin, sys.stderr) else 0)'
  { "${launcher[@]}" "${args[@]}" -m "$module" "$@" 2>&1 1>&3 3>&- | python -c "$todo_filter" 3>&-
    statuses=("${PIPESTATUS[@]}"); } 3>&1
  if [[ "${statuses[1]}" == "3" ]]; then exit 3; fi
  exit "${statuses[0]}"
fi
exec "${launcher[@]}" "${args[@]}" -m "$module" "$@"
