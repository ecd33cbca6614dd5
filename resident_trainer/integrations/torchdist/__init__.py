"""The protocol's torch bridges: what the torch-free state machines of
resident_trainer.protocol need in a real process.

| module | what |
|---|---|
| `store` | `TorchKVStore`: the KVStore contract over any torch.distributed.Store |
| `memory` | `system_sampler`: free device memory and workspace for the budget monitor |
| `procs` | `gloo_worker`, `exit_now`, `die_with_parent`, `pid_alive` |
| `pair` | a minimal serving pair (TCPStore, gloo) with a toy job body: the protocol live |
"""
