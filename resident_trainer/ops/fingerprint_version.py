"""The fingerprint definition's version, in a module of its own so that the
torch-free layers (the protocol's receipts) can record it without importing
torch. A digest of one version is unrelated to the same tensor's digest of
another: checkpoints and receipts store it next to every digest."""

FINGERPRINT_VERSION = 3
