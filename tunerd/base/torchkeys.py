"""The keys of a ``[[job]]`` rule's ``torch`` table and the values each takes.

Declared once, in a module with no imports, for the two places that check them:
``tunerd.policy.sections`` builds the policy schema's torch table from them, and
``tunerd.torch.settings`` checks the environment and the daemon's reply against them.
Kept out of the ``tunerd.torch`` package so that loading a policy does not import the
training helpers. The ranges are what DataLoader accepts and what makes sense on a node.
"""

AMP_MODES = ("off", "bf16", "fp16")
INT_RANGES = {"num_workers": (0, 1024), "prefetch_factor": (1, 64)}
BOOLS = ("pin_memory", "persistent_workers", "compile")
# setting -> environment variable that overrides it (tunerctl bench and tune set these)
ENV = {
    "num_workers": "TUNERD_NUM_WORKERS",
    "pin_memory": "TUNERD_PIN_MEMORY",
    "persistent_workers": "TUNERD_PERSISTENT_WORKERS",
    "prefetch_factor": "TUNERD_PREFETCH_FACTOR",
    "amp": "TUNERD_AMP",
    "compile": "TUNERD_COMPILE",
}
