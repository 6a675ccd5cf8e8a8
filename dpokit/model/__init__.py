"""Models: the environment check (preflight), shapes, loading, LoRA and 4-bit (models), the sampler, constrained decoding (constrain) and the fused kernels and trainer subclasses (fastpath)."""
