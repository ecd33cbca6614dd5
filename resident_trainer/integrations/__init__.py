"""Where the protocol and the training core meet a real runtime.

| package | what |
|---|---|
| `torchdist` | the protocol over torch.distributed: `TorchKVStore` over a TCPStore, the memory sampler, process control (gloo workers that exit cleanly, die with their parent), and a minimal serving pair in real processes |
"""
