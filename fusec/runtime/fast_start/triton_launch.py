"""Launching a generated Triton kernel cheaply, call after call.

`kernel[grid](x, out, 4096, BLOCK_SIZE=1024)` goes through Triton's JIT every time: it binds
the arguments, works out their specialization (is each pointer 16-byte aligned? is each integer
1, or a multiple of 16?), hashes that into a cache key and looks the compiled kernel up. That is
tens of microseconds of Python per launch, longer than a small kernel runs on the GPU.

A fusec program was compiled for one input signature, so after the first launch nothing the JIT
checks can change, except one thing: pointer alignment, because a tensor of the same shape and
strides can start anywhere in its storage. So TritonLauncher

1. launches the first time through the module's `launch(...)`, which returns the compiled
   kernel (Triton's `CompiledKernel`), and remembers which pointers were 16-byte aligned;
2. from then on calls the module's `bind(compiled)`: the compiled kernel with its grid fixed
   (`compiled[grid]`), given all its arguments in order, which is Triton's own launcher minus
   the JIT's work (and minus the per-launch work of Triton's `compiled[grid]` runner too:
   see `Direct` below),
3. unless a pointer that was aligned at the first launch is not aligned now: the kernel was
   specialized for aligned loads, so that call goes through the JIT again (it compiles or finds
   the unaligned version).

Sizes. A kernel compiled for a shape family (fusec/symbolic.py) takes its sizes after the
tensors, `launcher(x, out, s0)`, and its module computes the grid from them per call, so `bind`
gives a function of the sizes too. Triton specializes each integer argument as well: a 1 is
compiled in as a constant, a multiple of 16 lets it assume the divisibility, a value past 32 bits
is an int64. A compiled kernel is right only for sizes of the kinds it was compiled for (the
module passes the kernel nothing else that depends on the sizes: codegen/triton/text.py, Note:
Triton kernels for a shape family), so the launcher keeps one bound kernel per kind of the sizes
(`size_kinds`), each bound after the JIT's launch for the first call of its kind, and each with
the pointer alignment of that call.

Under TRITON_INTERPRET=1 there is no compiled kernel (launch returns None) and every call takes
the JIT path, which is how the tests on a CPU run.

A kernel Triton cannot compile. Triton compiles a kernel at its first launch (or ahead of it,
fusec/runtime/build.py's `_compile_ahead`, which leaves a failure to the first launch), and
Triton's compiler can fail on a kernel it should take (`PassManager::run failed`, "operand #1
does not dominate this use"). So the first launch is the one place where a failure is caught:
if it raises, the launcher asks `fallback` (set by fusec/driver.py) for the group's ATen ops
(fusec/runtime/eager.py), which warns once, and from then on runs those through the fast path.
A launch that fails after one succeeded is a real run-time error and is raised. The check costs
nothing on the fast path: it sits where the JIT is called anyway.
"""
from __future__ import annotations

from pathlib import Path

ALIGNMENT = 16  # bytes: what Triton specializes pointer arguments on


def size_kinds(sizes) -> tuple:
    """What Triton specializes an integer argument on, for each size: 1 (a constant), or whether
    it is a multiple of 16 and whether it fits 32 bits."""
    return tuple(1 if v == 1 else (v % 16 == 0, v < 2 ** 31) for v in sizes)


def _aligned(tensors) -> tuple[bool, ...]:
    return tuple(t.data_ptr() % ALIGNMENT == 0 for t in tensors)


class TritonLauncher:
    def __init__(self, module, path: Path, name: str, n_params: int, n_sizes: int = 0):
        self.module = module
        self.lib, self.name, self.n_params = path, name, n_params  # for the printed wrapper
        self.n_sizes = n_sizes  # size arguments (ints) after the tensors (fusec/symbolic.py)
        self.fast = None
        self.aligned: tuple[bool, ...] = ()
        # with sizes: {size_kinds: (bound kernel, alignment)}, once a compiled kernel is bound
        self.bound: dict[tuple, tuple] = {}
        # the CPU work of one call, in launches: more than one where the module launches several
        # kernels or allocates (fusec/runtime/cuda_graphs.py, graph_blocker)
        self.cpu_launches = getattr(module, "CPU_LAUNCHES", 1)
        # what to run instead if the kernel fails to compile at its first launch: fallback(error)
        # returns a launcher of the group's ATen ops (fusec/driver.py sets it; runtime/eager.py)
        self.fallback = None
        self.launched = False

    def __call__(self, *tensors) -> None:  # (the tensors, then the sizes, if any)
        fast = self.fast
        if fast is not None:
            if self.bound:  # a kernel that takes sizes (see "Sizes" above)
                self._sized(tensors)
                return
            for t, was in zip(tensors, self.aligned):
                if was and t.data_ptr() % ALIGNMENT:
                    break  # specialized for an aligned pointer: let the JIT pick the right kernel
            else:
                fast(*tensors)
                return
            self.module.launch(*tensors)
            return
        try:
            compiled = self.module.launch(*tensors)
        except Exception as err:  # noqa: BLE001 - see "A kernel Triton cannot compile" above
            if self.launched or self.fallback is None:
                raise
            # the group's ATen ops from now on, through the fast path (no alignment to check)
            self.fast, self.aligned = self.fallback(err), ()
            self.fast(*tensors)
            return
        self.launched = True
        # (a module that launches two kernels returns both, and binds both)
        if self._bindable(compiled):
            self.aligned = _aligned(tensors[:len(tensors) - self.n_sizes])
            self.fast = self.module.bind(direct(compiled))
            if self.n_sizes:
                self.bound[size_kinds(tensors[-self.n_sizes:])] = (self.fast, self.aligned)

    def _bindable(self, compiled) -> bool:
        return compiled is not None and hasattr(self.module, "bind") and all(
            hasattr(c, "run") for c in (compiled if isinstance(compiled, tuple) else [compiled]))

    def _sized(self, args) -> None:
        """A call of a kernel that takes sizes: the bound kernel of its sizes' kinds, unless a
        pointer it was specialized on as aligned is not now; else the JIT, and a first call of
        new kinds binds the kernel the JIT compiled for them."""
        kinds = size_kinds(args[-self.n_sizes:])
        fast, aligned = self.bound.get(kinds, (None, ()))
        if fast is not None:
            if not any(was and t.data_ptr() % ALIGNMENT for t, was in zip(args, aligned)):
                fast(*args)
                return
            self.module.launch(*args)
            return
        compiled = self.module.launch(*args)
        if self._bindable(compiled):
            self.bound[kinds] = (self.module.bind(direct(compiled)), _aligned(args[:-self.n_sizes]))


# Note (what a bound launch still costs, and what `Direct` takes off). Triton's `compiled[grid]`
# is a `runner(*args)` that, at every launch, asks the driver for the current device (through
# torch.cuda.current_device and its lazy-init check) and that device's current stream, builds the
# launch's metadata for the launch hooks (Triton 3.6 always has hook chains, empty or not, so it
# builds it and the C launcher calls both chains) and then calls `compiled.run(...)`, the
# launcher that Triton compiled for this kernel's signature. Measured on an H100 in a resnet50
# training step (487 launches a step), those steps were over half the Python time per launch.
# `Direct(compiled)[grid]` does the same launch with the device read once, at bind time (a bound
# kernel is loaded on that device and launched on it from then on), the current stream read per
# launch with the driver's own function (`torch._C._cuda_getCurrentRawStream`, so a launch still
# follows `torch.cuda.stream(...)` and CUDA-graph capture), and no launch hooks, unless someone
# installed one (Triton's proton profiler does): then it is Triton's runner, hooks and all. This is
# the call torch's Inductor makes to Triton's launcher too: `run(grid_x, grid_y, grid_z, stream,
# function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`.


def _hooks_installed() -> bool:
    """Whether any Triton launch hook is installed (None before Triton 3.5, an empty or filled
    HookChain since)."""
    from triton import knobs
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class Direct:
    """A compiled Triton kernel whose `[grid]` is a cheaper launcher than `compiled[grid]`
    (the note above); `bind` templates index it as they would the compiled kernel."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __getitem__(self, grid):
        runner = self.compiled[grid]  # (also loads the kernel on the device, once)
        if _hooks_installed():
            return runner  # (a hook to call: Triton's runner calls it)
        try:  # (what Triton's runner reads; a Triton without it keeps its runner)
            from triton.runtime import driver
            active = driver.active
            device, get_stream = active.get_current_device(), active.get_current_stream
            run, function = self.compiled.run, self.compiled.function
            metadata = self.compiled.packed_metadata
        except (AttributeError, ImportError, RuntimeError):
            return runner
        x, y, z = (*grid, 1, 1)[:3]

        def launch(*args):
            run(x, y, z, get_stream(device), function, metadata, None, None, None, *args)
        return launch


def direct(compiled):
    """`compiled` (a CompiledKernel, or a module's tuple of them) as `Direct` launchers."""
    if isinstance(compiled, tuple):
        return tuple(Direct(c) for c in compiled)
    return Direct(compiled)
