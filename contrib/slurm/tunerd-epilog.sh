#!/bin/sh
# Slurm Epilog for tunerd: release the leases a job made with `tunerctl alloc`.
#
# slurm.conf:   Epilog=/usr/lib/tunerd/slurm/tunerd-epilog.sh
# config:       /etc/tunerd/slurm.conf (see slurm.conf.example and
#               tunerd-slurm-common.sh, which must sit next to this script)
#
# Runs as root on each node when a job ends, with no PATH and only the
# variables slurmd sets. `tunerctl alloc` inside a Slurm job tags its lease
# "slurm:$SLURM_JOB_ID"; leases of `tunerctl run` end with their command by
# themselves. Bindings need no cleanup: they end with the processes.
#
# Never fails the job's cleanup and never holds the node in COMPLETING for more
# than about 2 s (the config's TIMEOUT + 1 s), even when the daemon hangs:
# problems go to syslog (tag tunerd-slurm). TUNERCTL and TUNERD_SOCKET in the
# environment override the config here (only slurmd or root set the Epilog's
# environment; the TaskProlog ignores them).

TS_SELF="tunerd-epilog: job ${SLURM_JOB_ID:-?}"
case $0 in */*) TS_DIR=${0%/*} ;; *) TS_DIR=. ;; esac
if [ ! -r "$TS_DIR/tunerd-slurm-common.sh" ]; then
    echo "$TS_SELF: $TS_DIR/tunerd-slurm-common.sh missing; nothing done" >&2
    exit 0
fi
# shellcheck source=tunerd-slurm-common.sh
. "$TS_DIR/tunerd-slurm-common.sh"
ts_init trusted

job=${SLURM_JOB_ID:-}
case $job in
    ''|*[!0-9_]*) ts_log warning "SLURM_JOB_ID not set; nothing to release"; exit 0 ;;
esac

ts_tunerctl release --tag "slurm:$job"
if [ "$TS_RC" -ne 0 ]; then
    ts_log warning "leases tagged slurm:$job not released (tunerctl exit $TS_RC): $(ts_oneline "$TS_OUT")"
else
    case $TS_OUT in
        # most jobs never alloc: no syslog line for them
        "no lease tagged"*)
            [ -z "$TS_CONF_NOTES" ] || ts_log warning "nothing to release" ;;
        *) ts_log info "$(ts_oneline "$TS_OUT")" ;;
    esac
fi
exit 0
