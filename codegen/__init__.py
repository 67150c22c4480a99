"""Code generation: fused group -> kernel IR (lower.py) -> source text from a Jinja template
(one package per backend: triton/, cpp/, llvm/) -> a JIT-loaded callable, cached on disk."""
