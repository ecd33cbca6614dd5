"""The protocol's torch bridges: what the torch-free state machines of
resident_trainer.protocol need in a real process.

| module | what |
|---|---|
| `store` | `TorchKVStore`: the KVStore contract over any torch.distributed.Store |
| `memory` | `system_sampler`: free device memory and workspace for the budget monitor |
| `procs` | `gloo_worker`, `exit_now`, `die_with_parent`, `pid_alive` |
| `drive` | the real-process driver: tick a serving loop, block in the store on the keys it names |
| `pair` | a minimal serving pair (TCPStore, gloo) with a toy job body: the protocol live (`python -m ...pair --rank R`) |
| `control` | recovery's `GroupControl` for the pair: its ranks as child processes |
| `client` | chats and jobs sent to a running pair's head |
"""
