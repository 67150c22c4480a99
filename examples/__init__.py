"""Runnable examples, one idea each: `python examples/sin4.py`. `fusec demo` runs them all.

Each file defines `example()` returning a fusec.demo.Example (the function, its inputs, a
sentence about it) and ends with `run_example(example())`; the CLI (`fusec explain|kernels|profile
FILE.py`) calls `example(device=...)`. The training scripts (xor_train, gpt2_train_step) define
`example()` too: their model's forward on one batch, for inference; `train()` / `step()` train.
`SMALL`, a dict of `example()` keyword arguments, gives small sizes: `fusec explain sin4 --small`.
"""
