#!/usr/bin/env bash
# Slurm job: Qwen3-32B full fine-tuning (inputs/qwen3_32b.ini) on 4 nodes x 8 GPUs of 80 GB, one
# rank a GPU, each rank bound to its GPU's NUMA node; requeued until the run is done.
# docs/cluster.md. Submit from the repository root:
#
#   sbatch scripts/slurm/qwen3_32b.sh                          # the deck as it is
#   sbatch scripts/slurm/qwen3_32b.sh inputs/qwen3_32b.ini --train.steps=4000
#   DRY_RUN=1 bash scripts/slurm/qwen3_32b.sh                  # print what would run, run nothing
#   bash scripts/slurm/qwen3_32b.sh --dry-run --optim.lr=2e-5  # the same
#
# The dry run needs no Slurm: it prints the exact launch command, the layout (dp, tp, pp, ZeRO
# stage, ranks per node, GPU and NUMA mapping), the NCCL variables and the requeue plan, and exits.
#
# Variables (the environment of sbatch; `sbatch --export=ALL,QTRAIN_LAUNCHER=mpirun ...`):
#   QTRAIN_BIN        the qtrain executable (default: build-cuda/bin/qtrain, the CUDA build)
#   QTRAIN_LAUNCHER   srun | mpirun (default: srun)
#   QTRAIN_SRUN_MPI   srun's --mpi plugin (default: pmix; `srun --mpi=list` shows yours)
#   QTRAIN_THREADS    OpenMP/OpenBLAS threads a rank (default: $SLURM_CPUS_PER_TASK, else 12)
#   QTRAIN_GPU_NUMA   the NUMA node of GPUs 0..7 of a node, e.g. 0,0,0,0,1,1,1,1 (default: read
#                     on the first node from nvidia-smi and /sys/bus/pci/devices/*/numa_node)
#   QTRAIN_REQUEUE    1 (default): after the time-limit checkpoint, `scontrol requeue` the job
#   QTRAIN_PROBE      1: run `qtrain probe` first (a few seconds), printing the link bandwidths
#                     as the planner's topology keys
#   QTRAIN_ENV        a file to source first (module loads, `spack env activate`)
#
# Binding. qtrain gives local rank l GPU l (local rank % GPUs), so every rank sees all 8 GPUs
# (no --gpu-bind: a rank that saw only its own GPU would lose NVLink peer access to the others)
# and is bound to the CPUs of its GPU's NUMA node: srun --cpu-bind=map_ldom:<GPU l's node for each
# l> with tasks dealt node by node (--distribution=block), or mpirun --map-by ppr:<ranks a NUMA
# node>:numa --bind-to numa when GPUs 0..k-1 sit on NUMA node 0, the next k on node 1, and so on.
# The start-up banner's topology report shows where each rank ended up and warns when a rank's
# CPUs are not on its GPU's NUMA node.
#
# NCCL settings that matter (left unset, NCCL detects the fabric; set them with `export` before
# sbatch, or in QTRAIN_ENV, once the defaults are known to be wrong):
#   NCCL_IB_HCA         the InfiniBand HCAs (ports) NCCL may use, e.g. mlx5_0,mlx5_3 or ^mlx5_bond:
#                       list the compute fabric's, one a GPU on H100 nodes; keep out storage or
#                       management ports, which are slower and shared
#   NCCL_SOCKET_IFNAME  the IP interface for NCCL's bootstrap (and its socket transport, a slow
#                       fallback), e.g. ib0 or ^lo,docker: a wrong or unroutable one hangs at start
#   NCCL_NET_GDR_LEVEL  how far (PCI distance: PIX, PXB, PHB, SYS) a NIC may be from a GPU for
#                       GPUDirect RDMA (the NIC reads and writes GPU memory, no bounce through host
#                       memory); needs the nvidia-peermem module or dma-buf. NCCL's default (PXB)
#                       suits nodes with a NIC beside each GPU
#   NCCL_IB_GID_INDEX   RoCE only: the GID index of the RoCE v2 address (often 3)
#   NCCL_CROSS_NIC      0/1: whether rings may leave a node on one NIC and enter the next on
#                       another; 0 on rail-optimised fabrics (NIC k of every node on one switch)
#   NCCL_NVLS_ENABLE    NVLink SHARP (multicast); qtrain sets 0 when unset
#   NCCL_TOPO_FILE      an XML topology for VMs whose PCI tree hides the real one
#   NCCL_DEBUG          WARN (default here) or INFO: INFO prints the transports chosen; check
#                       once that "NET/IB" and "GDRDMA" appear, not "NET/Socket"
#   NCCL_DEBUG_SUBSYS   with INFO, e.g. INIT,NET to keep it short
#
# Requeue. Slurm sends SIGUSR1 to this script 300 s before the time limit (--signal=B:USR1@300);
# it passes the signal to the launcher, which passes it to every rank: qtrain finishes its step,
# writes a checkpoint (393 GB: 300 s covers a step and the write at 1.4 GB/s or more; raise the
# margin on a slower file system) and exits 0; the script then requeues the job (scontrol requeue,
# --requeue allows it) and the next start resumes from that checkpoint (checkpoint.resume = auto).
# On preemption (PreemptMode=REQUEUE) Slurm sends SIGTERM, which qtrain treats the same, and
# requeues the job itself; the partition's GraceTime must cover a step plus the checkpoint. A job
# killed outright resumes from the last periodic checkpoint (checkpoint.every). --open-mode=append
# keeps every start's output in one file.
#
#SBATCH --job-name=qwen3-32b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=qwen3_32b-%j.out
set -euo pipefail

dry=${DRY_RUN:-0}
if [ "${1:-}" = --dry-run ]; then
  dry=1
  shift
fi
deck=inputs/qwen3_32b.ini
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then
  deck=$1
  shift
fi

# Slurm runs a copy of this script: the repository is the submission directory.
root=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
cd "$root"
# shellcheck source=scripts/cluster.sh
. "$root/scripts/cluster.sh"
if [ -n "${QTRAIN_ENV:-}" ]; then
  # shellcheck disable=SC1090  # a user-chosen file
  . "$QTRAIN_ENV"
fi
bin=${QTRAIN_BIN:-$root/build-cuda/bin/qtrain}
nodes=${SLURM_JOB_NUM_NODES:-4}
ppn=${SLURM_NTASKS_PER_NODE:-8}
ppn=${ppn%%(*}  # Slurm may write "8(x4)"
ranks=$((nodes * ppn))
threads=${QTRAIN_THREADS:-${SLURM_CPUS_PER_TASK:-12}}
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

qt_layout "$deck" "$ranks" "$ppn" "$@"
qt_gpu_numa "$ppn"
per_numa=$(qt_numa_blocks)
case "${QTRAIN_LAUNCHER:-srun}" in
  srun)
    binding="srun --cpu-bind=map_ldom:$QT_GPU_NUMA: local rank l on the CPUs of GPU l's NUMA node"
    launch=(srun --mpi="${QTRAIN_SRUN_MPI:-pmix}" --ntasks-per-node="$ppn" --distribution=block:block
      --cpus-per-task="$threads" --cpu-bind="map_ldom:$QT_GPU_NUMA")
    probe=("${launch[@]}")
    ;;
  mpirun)
    # Open MPI reads the allocation from Slurm.
    if [ "$per_numa" -gt 0 ]; then
      binding="mpirun --map-by ppr:$per_numa:numa --bind-to numa: $per_numa ranks on each NUMA node, in GPU order"
      launch=(mpirun -np "$ranks" --map-by "ppr:$per_numa:numa" --bind-to numa)
    else
      binding="none: GPU NUMA nodes $QT_GPU_NUMA are not in blocks mpirun can map (use srun)"
      launch=(mpirun -np "$ranks" --map-by "ppr:$ppn:node" --bind-to none)
    fi
    probe=("${launch[@]}")
    ;;
  *)
    echo "qwen3_32b.sh: QTRAIN_LAUNCHER must be srun or mpirun, got '$QTRAIN_LAUNCHER'" >&2
    exit 2
    ;;
esac
cmd=("${launch[@]}" "$bin" "$deck" "$@")

if [ "$dry" = 1 ]; then
  qt_print_layout qwen3_32b.sh "$nodes" "$ppn" "$threads" "$binding"
  printf 'nccl     %s' "$(qt_nccl_report)"
  printf '\nrequeue  SIGUSR1 300 s before the time limit: checkpoint, exit, scontrol requeue (QTRAIN_REQUEUE=%s); preemption: SIGTERM, checkpoint, Slurm requeues (--requeue); checkpoint.resume = %s\n' \
    "${QTRAIN_REQUEUE:-1}" "$(qt_deck_value "$deck" checkpoint resume auto "$@")"
  [ -x "$bin" ] || printf 'note     %s is not built yet (cmake --preset cuda && cmake --build --preset cuda)\n' "$bin"
  qt_print_command "${cmd[@]}"
  [ -z "$QT_LAYOUT_ERROR" ] || exit 2
  exit 0
fi

[ -r "$deck" ] || { echo "qwen3_32b.sh: deck $deck not found (from $PWD)" >&2; exit 2; }
[ -x "$bin" ] || { echo "qwen3_32b.sh: $bin is not an executable; build first or set QTRAIN_BIN" >&2; exit 2; }
if [ -n "$QT_LAYOUT_ERROR" ]; then
  echo "qwen3_32b.sh: $QT_LAYOUT_ERROR" >&2
  exit 2
fi
echo "qwen3_32b.sh: job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on $nodes nodes x $ppn ranks;" \
  "dp $QT_DP x tp $QT_TP x pp $QT_PP, ZeRO-$QT_ZERO; GPU NUMA nodes $QT_GPU_NUMA ($QT_GPU_NUMA_FROM)"
if [ "${QTRAIN_PROBE:-0}" = 1 ]; then "${probe[@]}" "$bin" probe; fi
echo "qwen3_32b.sh: ${cmd[*]}"

stop=""
"${cmd[@]}" &
pid=$!
trap 'stop=USR1; kill -USR1 "$pid" 2>/dev/null || true' USR1
trap 'stop=TERM; kill -TERM "$pid" 2>/dev/null || true' TERM
rc=0
wait "$pid" || rc=$?
# A trapped signal ends `wait` early: wait for the launcher itself.
while kill -0 "$pid" 2>/dev/null; do
  rc=0
  wait "$pid" || rc=$?
done
if [ "$stop" = USR1 ] && [ "$rc" -eq 0 ] && [ "${QTRAIN_REQUEUE:-1}" = 1 ]; then
  echo "qwen3_32b.sh: checkpoint written before the time limit; requeueing job ${SLURM_JOB_ID:-?}"
  scontrol requeue "${SLURM_JOB_ID:?}"
fi
exit "$rc"
