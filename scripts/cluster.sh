# shellcheck shell=bash
# Shared by the multi-node batch scripts (scripts/slurm/qwen3_32b.sh, scripts/pbs/qwen3_32b.pbs);
# source it, do not run it. docs/cluster.md.
#
#   qt_deck_value DECK SECTION KEY DEFAULT ARGS...   a key's value: a --SECTION.KEY=v among ARGS
#                                                    wins over the deck file (as qtrain reads it)
#   qt_layout DECK RANKS RANKS_PER_NODE ARGS...      sets QT_DP QT_TP QT_PP QT_ZERO QT_MICRO
#                                                    QT_GLOBAL QT_SEQ QT_DEVICE QT_LAYOUT_ERROR
#   qt_gpu_numa GPUS                                 sets QT_GPU_NUMA (the NUMA node of each GPU of
#                                                    this node, comma list) and QT_GPU_NUMA_FROM
#   qt_numa_blocks                                   ranks per NUMA node when QT_GPU_NUMA is
#                                                    GPUs 0..k-1 on the first node, the next k on
#                                                    the next...; 0 otherwise
#   qt_print_layout NAME NODES PPN THREADS BINDING   the dry run's layout lines
#   qt_nccl_report                                   the NCCL_* variables the job passes on
#   qt_print_command ARGS...                         the command, quoted so it can be pasted
# It sources scripts/common.sh (qt_ini_get).

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

qt_deck_value() {
  local deck=$1 section=$2 key=$3 default=$4 a value=""
  shift 4
  for a in "$@"; do
    case "$a" in
      --"$section.$key"=*) value=${a#--"$section.$key"=} ;;
    esac
  done
  if [ -z "$value" ]; then value=$(qt_ini_get "$deck" "$section" "$key" "$default"); fi
  printf '%s' "$value"
}

qt_layout() {
  local deck=$1 ranks=$2 ppn=$3
  shift 3
  QT_TP=$(qt_deck_value "$deck" mesh tp 1 "$@")
  QT_PP=$(qt_deck_value "$deck" mesh pp 1 "$@")
  QT_DP=$(qt_deck_value "$deck" mesh dp 0 "$@")
  QT_ZERO=$(qt_deck_value "$deck" optim zero_stage 0 "$@")
  QT_MICRO=$(qt_deck_value "$deck" train micro_batch 4 "$@")
  QT_GLOBAL=$(qt_deck_value "$deck" train global_batch 8 "$@")
  QT_SEQ=$(qt_deck_value "$deck" train seq_len 64 "$@")
  QT_DEVICE=$(qt_deck_value "$deck" train device cpu "$@")
  QT_LAYOUT_ERROR=""
  if [ "$QT_DP" = 0 ]; then QT_DP=$((ranks / (QT_TP * QT_PP))); fi  # auto, as qtrain resolves it
  if [ $((QT_DP * QT_TP * QT_PP)) -ne "$ranks" ]; then
    QT_LAYOUT_ERROR="mesh.dp x mesh.tp x mesh.pp = $QT_DP x $QT_TP x $QT_PP is not the job's $ranks ranks"
  elif [ $((ppn % QT_TP)) -ne 0 ]; then
    QT_LAYOUT_ERROR="mesh.tp = $QT_TP does not divide the $ppn ranks per node: tensor-parallel groups would cross nodes"
  fi
}

qt_gpu_numa() {
  local gpus=$1 ids id node nodes n g list=""
  QT_GPU_NUMA_FROM=""
  if [ -n "${QTRAIN_GPU_NUMA:-}" ]; then
    QT_GPU_NUMA=$QTRAIN_GPU_NUMA
    QT_GPU_NUMA_FROM="QTRAIN_GPU_NUMA"
    return 0
  fi
  if command -v nvidia-smi >/dev/null 2>&1 &&
    ids=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null) && [ -n "$ids" ]; then
    for id in $ids; do
      # nvidia-smi writes 00000000:1B:00.0; /sys names it 0000:1b:00.0.
      id=$(printf '%s' "${id: -12}" | tr 'A-F' 'a-f')
      node=$(cat "/sys/bus/pci/devices/$id/numa_node" 2>/dev/null || echo -1)
      [ "$node" -ge 0 ] 2>/dev/null || node=0
      list="${list:+$list,}$node"
    done
    QT_GPU_NUMA=$list
    QT_GPU_NUMA_FROM="nvidia-smi and /sys/bus/pci on $(hostname)"
    return 0
  fi
  # No GPU here (a login node, a dry run): the usual layout, GPUs split evenly over the NUMA
  # nodes of this host in order (GPUs 0-3 on node 0 and 4-7 on node 1 on two sockets).
  nodes=$(find /sys/devices/system/node -maxdepth 1 -name 'node[0-9]*' 2>/dev/null | wc -l)
  [ "$nodes" -ge 1 ] || nodes=1
  [ "$nodes" -le "$gpus" ] || nodes=$gpus
  for ((g = 0; g < gpus; g++)); do
    n=$((g * nodes / gpus))
    list="${list:+$list,}$n"
  done
  QT_GPU_NUMA=$list
  QT_GPU_NUMA_FROM="assumed: no GPU visible on $(hostname), $gpus GPUs split evenly over $nodes NUMA node(s); set QTRAIN_GPU_NUMA to the compute nodes' map"
}

qt_numa_blocks() {
  local IFS=, n nodes per i
  local -a map
  read -r -a map <<<"$QT_GPU_NUMA"
  n=${#map[@]}
  nodes=$(printf '%s\n' "${map[@]}" | sort -u | wc -l)
  per=$((n / nodes))
  if [ $((per * nodes)) -ne "$n" ]; then printf 0; return 0; fi
  for ((i = 0; i < n; i++)); do
    if [ "${map[i]}" != $((i / per)) ]; then printf 0; return 0; fi
  done
  printf '%s' "$per"
}

qt_print_layout() {
  local name=$1 nodes=$2 ppn=$3 threads=$4 binding=$5 micro
  micro=$((QT_GLOBAL / (QT_MICRO * QT_DP)))
  printf '%s: dry run, nothing is launched\n' "$name"
  printf 'job      %s nodes x %s ranks per node = %s ranks, one GPU each; %s CPU thread(s) a rank\n' \
    "$nodes" "$ppn" $((nodes * ppn)) "$threads"
  printf 'layout   world %s = pp %s x dp %s x tp %s (tp innermost); optim.zero_stage = %s; train.device = %s\n' \
    $((QT_DP * QT_TP * QT_PP)) "$QT_PP" "$QT_DP" "$QT_TP" "$QT_ZERO" "$QT_DEVICE"
  printf 'batch    global_batch %s x seq_len %s = %s tokens a step: %s micro-batch(es) of %s on each dp rank\n' \
    "$QT_GLOBAL" "$QT_SEQ" $((QT_GLOBAL * QT_SEQ)) "$micro" "$QT_MICRO"
  printf 'gpus     local rank l of each node -> GPU l (qtrain: local rank %% GPUs); all %s GPUs stay visible to every rank (NCCL uses NVLink between them)\n' "$ppn"
  printf 'numa     GPU NUMA nodes %s (%s)\n' "$QT_GPU_NUMA" "$QT_GPU_NUMA_FROM"
  printf 'binding  %s\n' "$binding"
  if [ -n "$QT_LAYOUT_ERROR" ]; then printf 'error    %s\n' "$QT_LAYOUT_ERROR"; fi
}

qt_nccl_report() {
  local v any=""
  for v in NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_NET_GDR_LEVEL NCCL_IB_GID_INDEX NCCL_CROSS_NIC \
    NCCL_NVLS_ENABLE NCCL_TOPO_FILE NCCL_DEBUG NCCL_DEBUG_SUBSYS; do
    if [ -n "${!v:-}" ]; then
      printf '%s=%s ' "$v" "${!v}"
      any=1
    fi
  done
  [ -n "$any" ] || printf '(none set: NCCL detects the fabric itself) '
  printf '\n'
}

qt_print_command() {
  local a out=""
  for a in "$@"; do
    # Plain words as they are; anything else in single quotes.
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out="$out $a"
    else out="$out '${a//\'/\'\\\'\'}'"; fi
  done
  printf 'command %s\n' "$out"
}
