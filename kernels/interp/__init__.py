"""The CUDA interpreter of GC3 programs (GC3 §6): interp.cu and its Python runtime."""
