"""Lives in the notebook kernel: the magics, the session that owns the pool, output rendering.

Never imports torch or touches CUDA."""
