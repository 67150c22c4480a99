"""Runnable examples, one idea each: `python examples/sin4.py`. `fusec demo` runs them all.

Each file defines `example()` returning a fusec.demo.Example (the function, its inputs, a
sentence about it) and ends with `run_example(example())`.
"""
