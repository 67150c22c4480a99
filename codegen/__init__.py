"""Code generation: fused group -> kernel IR (lower.py) -> source text from a Jinja template
(one module per backend: triton.py, cpp.py) -> a JIT-loaded callable, cached on disk."""
