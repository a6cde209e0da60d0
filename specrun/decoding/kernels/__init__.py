"""Our C kernels (AVX-512 BF16 CPUs) and their build: bindings only, no decoding policy; callers keep a torch fallback."""
