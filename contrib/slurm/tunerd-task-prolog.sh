#!/bin/sh
# Slurm TaskProlog for tunerd: bind each task of a job step near its GPUs.
#
# slurm.conf:   TaskProlog=/usr/lib/tunerd/slurm/tunerd-task-prolog.sh
#
# Runs as the job's user on the compute node right before each task starts,
# with the task's environment. The task (SLURM_TASK_PID) is bound through
# `tunerctl bind`, which a non-root user may do for its own processes; the
# daemon intersects the CPUs with the cgroup cpuset Slurm gave the step, so
# Slurm's CPU allocation is always honoured.
#
# Which GPUs the task uses:
#   SLURM_STEP_GPUS / SLURM_JOB_GPUS (physical indices) when Slurm sets them,
#   else CUDA_VISIBLE_DEVICES (indices or UUIDs);
#   with several GPUs and several tasks per node, task SLURM_LOCALID takes
#   GPU number SLURM_LOCALID of that list (the torch convention cuda:LOCAL_RANK);
#   set TUNERD_SLURM_GPUS_PER_TASK=all to bind every task near all its GPUs.
# A task without GPUs is left to Slurm's own CPU binding.
#
# It never fails the task: problems are reported on stderr (slurmd's log) and
# the task starts unbound.
#
# Environment: TUNERCTL (default "tunerctl"), TUNERD_SOCKET (default
# /run/tunerd/tunerd.sock).

TUNERCTL=${TUNERCTL:-tunerctl}
log() { echo "tunerd-task-prolog: job ${SLURM_JOB_ID:-?}.${SLURM_STEP_ID:-?} task ${SLURM_LOCALID:-?}: $*" >&2; }

pid=${SLURM_TASK_PID:-}
case $pid in
    ''|*[!0-9]*) log "SLURM_TASK_PID not set; nothing to bind"; exit 0 ;;
esac

gpus=${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}
if [ -z "$gpus" ]; then
    gpus=${CUDA_VISIBLE_DEVICES:-}
fi
case $gpus in
    ''|NoDevFiles) log "no GPUs in this task; left to Slurm's CPU binding"; exit 0 ;;
esac

# tasks on this node: SLURM_STEP_TASKS_PER_NODE looks like "2" or "2(x3)" or "4,2"
tasks=${SLURM_NTASKS_PER_NODE:-${SLURM_STEP_TASKS_PER_NODE:-1}}
tasks=${tasks%%[!0-9]*}
ngpus=$(echo "$gpus" | tr ',' '\n' | grep -c .)
localid=${SLURM_LOCALID:-0}
if [ "${TUNERD_SLURM_GPUS_PER_TASK:-one}" != "all" ] && [ "${tasks:-1}" -gt 1 ] \
        && [ "$ngpus" -gt 1 ] && [ "$localid" -lt "$ngpus" ]; then
    gpus=$(echo "$gpus" | cut -d, -f$((localid + 1)))
fi

# UUIDs (CUDA_VISIBLE_DEVICES=GPU-...): map them to indices with nvidia-smi.
# (The task's /proc/PID/environ cannot tell: before its exec it still shows
# slurmstepd's environment.)
case $gpus in
    *[!0-9,]*)
        if ! command -v nvidia-smi >/dev/null 2>&1; then
            log "GPUs given as UUIDs ($gpus) and no nvidia-smi to map them; not bound"
            exit 0
        fi
        map=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null)
        idx=
        for u in $(echo "$gpus" | tr ',' ' '); do
            i=$(echo "$map" | awk -F', *' -v u="$u" 'index($2, u) == 1 {print $1; exit}')
            [ -n "$i" ] || { log "GPU $u not found by nvidia-smi; not bound"; exit 0; }
            idx=${idx:+$idx,}$i
        done
        gpus=$idx ;;
esac

if out=$($TUNERCTL bind "$pid" --gpus "$gpus" 2>&1); then
    log "bound near GPU ${gpus}: $(echo "$out" | tail -n 1)"
else
    log "not bound (tunerctl exit $?): $out"
fi
exit 0
