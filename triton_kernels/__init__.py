"""Triton kernels of resident_trainer (installed as resident_trainer.triton_kernels).

Pure compute: each module holds the @triton.jit kernels of one op and a thin
launcher that takes already-validated tensors. Input checks, dispatch and
autograd live in resident_trainer.ops.
"""
