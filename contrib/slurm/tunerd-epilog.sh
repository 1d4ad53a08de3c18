#!/bin/sh
# Slurm Epilog for tunerd: release the leases a job made with `tunerctl alloc`.
#
# slurm.conf:   Epilog=/usr/lib/tunerd/slurm/tunerd-epilog.sh
#
# Runs as root on each node when a job ends. `tunerctl alloc` inside a Slurm
# job tags its lease "slurm:$SLURM_JOB_ID"; leases of `tunerctl run` end with
# their command by themselves. Bindings need no cleanup: they end with the
# processes. Never fails the job's cleanup.

TUNERCTL=${TUNERCTL:-tunerctl}
job=${SLURM_JOB_ID:-}
case $job in
    ''|*[!0-9_]*) echo "tunerd-epilog: SLURM_JOB_ID not set" >&2; exit 0 ;;
esac
if ! out=$($TUNERCTL release --tag "slurm:$job" 2>&1); then
    echo "tunerd-epilog: job $job: $out" >&2
fi
exit 0
