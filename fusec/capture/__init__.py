"""Capture: the first room of the pipeline, where a Python program becomes an annotated ATen graph.

    frontend.py        the make_fx path: `capture(fn, args)` -> `Captured` (graph + how to call it)
    calls.py           a call's arguments: flattened, named, the module's state, the device
    tracing.py         the conditions capture traces under, and its errors at the user's line
    decompositions.py  fusec's own decompositions (softmax, layer_norm, var ... as reductions)
    torch_level.py     composite torch functions traced fusec's way (InstanceNorm without its view)
    outputs.py         whatever the program returns, flattened into tensors and built again
    rnn.py             nn.RNN / LSTM / GRU recorded as one extern op each
    training.py        a program that needs gradients: AOT Autograd's forward and backward
    breaks.py          why a program cannot be one graph, in the user's words
    regions.py         a program in regions: TorchDynamo's graphs, each compiled
    dynamo_names.py    a region's function and inputs under the user's names (Dynamo's sources)

Nothing here imports the driver (fusec/api.py, fusec/driver.py): training and regions are handed
the compiler they use (`fusec.api.part_compiler`).
"""
