"""The bind domain: who a process is, where it goes, the node's ledger, and the one writer.

intake (a process read once) -> gate (may it) -> placer (decide and hold in the ledger)
-> binding (the only writer of CPU masks, memory policy and limits) -> registry
(the records), with the journal for binds made in the exec watcher's thread.
"""
