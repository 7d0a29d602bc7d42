"""CuTe DSL kernels of mok_cute, one module per kernel family.

- ``token_ops``: ``GatherRows`` (rows into expert-sorted order) and ``WeightedKSum``
  (fixed-order fp32 k-sum plus shared expert), memory bound, 16-byte vector accesses.
- ``gemm_sm90``: persistent warp-specialised grouped GEMM (TMA + wgmma) for FC1/FC2.
- ``common``: device helpers shared by the kernels.

Importing this package does not import the CuTe DSL; each module does, and
``mok_cute.jit.KERNELS`` says how to compile each kernel without a GPU.
"""
