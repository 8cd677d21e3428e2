"""sgl_kernel: Triton kernels of the engine, each with a torch reference beside it."""
