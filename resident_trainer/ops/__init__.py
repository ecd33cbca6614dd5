"""Public functional ops, one module per op: input checks, device dispatch,
autograd, and the plain-torch (or numpy) oracle next to each kernel path.

The functions are re-exported from the top-level package; this package keeps
the module names (resident_trainer.ops.fingerprint, ...) for the internals.
"""
