"""Row-permutation kernels behind ``moe_comm.ops``.

Every backend implements the same three launchers with the same semantics (see ``reference.py``):
``permute_rows``, ``unpermute_rows`` and ``unpermute_weight_grad``.
  reference.py   pure torch; the test oracle and the fallback
  native.py      loader of the C++ CPU kernels in csrc/ (JIT-built, cached)
  triton_ops.py  @triton.jit kernels + launchers (CUDA; CPU only under TRITON_INTERPRET=1)
"""
