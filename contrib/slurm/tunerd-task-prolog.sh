#!/bin/sh
# Slurm TaskProlog for tunerd: bind each task of a job step near its GPUs.
#
# slurm.conf:   TaskProlog=/usr/lib/tunerd/slurm/tunerd-task-prolog.sh
# config:       /etc/tunerd/slurm.conf (see slurm.conf.example and
#               tunerd-slurm-common.sh, which must sit next to this script)
#
# Runs as the job's user on the compute node right before each task starts,
# with the task's environment. The task (SLURM_TASK_PID) is bound through
# `tunerctl bind`, which a non-root user may do for its own processes; the
# daemon places it inside the cgroup cpuset Slurm gave the step, so Slurm's CPU
# allocation always wins.
#
# Which GPUs the task uses:
#   SLURM_STEP_GPUS / SLURM_JOB_GPUS (physical indices) when Slurm sets them,
#   else CUDA_VISIBLE_DEVICES (indices or UUIDs);
#   with several GPUs and several tasks per node, task SLURM_LOCALID takes
#   GPU number SLURM_LOCALID of that list (the torch convention cuda:LOCAL_RANK);
#   a job may set TUNERD_SLURM_GPUS_PER_TASK=all to bind every task near all
#   its GPUs (that choice is the user's: it only changes where their own tasks run).
# A task without GPUs is left to Slurm's own CPU binding.
#
# It never fails the task and never delays it by more than about 2 s (the
# config's TIMEOUT + 1 s), even when the daemon hangs: problems go to syslog
# (tag tunerd-slurm) and, as `print` lines, to the job's output; the task then
# starts unbound. What to run and where to connect come from the admin config
# only, never from the job's environment.

TS_SELF="tunerd-task-prolog: job ${SLURM_JOB_ID:-?}.${SLURM_STEP_ID:-batch} task ${SLURM_LOCALID:-?}"
case $0 in */*) TS_DIR=${0%/*} ;; *) TS_DIR=. ;; esac
if [ ! -r "$TS_DIR/tunerd-slurm-common.sh" ]; then
    echo "$TS_SELF: $TS_DIR/tunerd-slurm-common.sh missing; nothing done" >&2
    exit 0
fi
# shellcheck source=tunerd-slurm-common.sh
. "$TS_DIR/tunerd-slurm-common.sh"
ts_init untrusted

# say LEVEL TEXT: syslog and stderr; also the job's output for problems (and for
# everything with USER_MESSAGES=all). stdout is read by slurmstepd: only
# "print ..." lines may go there.
say() {
    ts_log "$1" "$2"
    case $TS_USER_MESSAGES/$1 in
        all/*|problems/warning|problems/err)
            printf 'print tunerd: %s\n' "$2" ;;
    esac
}


pid=${SLURM_TASK_PID:-}
case $pid in
    ''|*[!0-9]*) ts_log notice "SLURM_TASK_PID not set; nothing to bind"; exit 0 ;;
esac

gpus=${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}
if [ -z "$gpus" ]; then
    gpus=${CUDA_VISIBLE_DEVICES:-}
fi
case $gpus in
    # stderr only: not worth a syslog line per task of every CPU-only job
    ''|NoDevFiles)
        printf '%s\n' "$TS_SELF: no GPUs in this task; left to Slurm's CPU binding" >&2
        exit 0 ;;
esac

# tasks on this node: SLURM_STEP_TASKS_PER_NODE looks like "2" or "2(x3)" or "4,2"
tasks=${SLURM_NTASKS_PER_NODE:-${SLURM_STEP_TASKS_PER_NODE:-1}}
tasks=${tasks%%[!0-9]*}
ngpus=$(echo "$gpus" | tr ',' '\n' | grep -c .)
localid=${TS_LOCALID:-0}
case $localid in ''|*[!0-9]*) localid=0 ;; esac
if [ "${TUNERD_SLURM_GPUS_PER_TASK:-one}" != "all" ] && [ "${tasks:-1}" -gt 1 ] \
        && [ "$ngpus" -gt 1 ] && [ "$localid" -lt "$ngpus" ]; then
    gpus=$(echo "$gpus" | cut -d, -f$((localid + 1)))
fi

# UUIDs (CUDA_VISIBLE_DEVICES=GPU-...): map them to indices with nvidia-smi.
# (The task's /proc/PID/environ cannot tell: before its exec it still shows
# slurmstepd's environment.) nvidia-smi is bounded too: a wedged driver must not
# hold the task.
case $gpus in
    *[!0-9,]*)
        if ! command -v nvidia-smi >/dev/null 2>&1; then
            say warning "GPUs given as UUIDs ($gpus) and no nvidia-smi to map them; not bound"
            exit 0
        fi
        map=$(timeout -k 0.1 0.5 nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null)
        idx=
        for u in $(echo "$gpus" | tr ',' ' '); do
            i=$(echo "$map" | awk -F', *' -v u="$u" 'index($2, u) == 1 {print $1; exit}')
            [ -n "$i" ] || { say warning "GPU $u not found by nvidia-smi; not bound"; exit 0; }
            idx=${idx:+$idx,}$i
        done
        gpus=$idx ;;
esac

ts_tunerctl bind "$pid" --gpus "$gpus"
if [ "$TS_RC" -eq 0 ]; then
    say info "bound near GPU $gpus: $(ts_oneline "$TS_OUT")"
else
    say warning "not bound (tunerctl exit $TS_RC): $(ts_oneline "$TS_OUT")"
fi
exit 0
