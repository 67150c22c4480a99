"""fusec/runtime/fast_start/triton_launch.py: after the first launch, a Triton kernel is called
through its compiled kernel directly, unless a pointer lost the alignment the kernel was
specialized for.

On a CPU (TRITON_INTERPRET=1) Triton returns no compiled kernel, so the fast path only runs on a
GPU (tests/test_cuda_graphs.py and every triton test there). Here a stand-in module shows the
decisions: which calls go to the JIT and which to the bound kernel.
"""
import torch

import pytest
from triton import knobs
from triton.runtime import driver

from fusec.runtime.fast_start.triton_launch import Direct, TritonLauncher


class FakeModule:
    """`launch` is the JIT path (returns a 'compiled kernel'); `bind` the fast one."""

    def __init__(self, compiled=True):
        self.calls = []
        self.compiled = compiled

    def launch(self, *tensors):
        self.calls.append("jit")
        return self if self.compiled else None

    def run(self):  # a compiled kernel has .run
        pass

    def bind(self, compiled):
        assert isinstance(compiled, Direct) and compiled.compiled is self
        return lambda *tensors: self.calls.append("fast")


def test_first_call_jit_then_bound_kernel():
    m = FakeModule()
    launcher = TritonLauncher(m, None, "k", 2)
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        launcher(x, y)
    assert m.calls == ["jit", "fast", "fast"]


def test_unaligned_pointer_goes_back_to_the_jit():
    m = FakeModule()
    launcher = TritonLauncher(m, None, "k", 2)
    base = torch.zeros(65)
    launcher(base[:64], base[:64])        # aligned: the kernel is specialized for it
    launcher(base[1:], base[:64])         # 4 bytes in: not 16-byte aligned
    launcher(base[:64], base[:64])
    assert m.calls == ["jit", "jit", "fast"]


def test_interpreter_never_binds():
    m = FakeModule(compiled=False)        # TRITON_INTERPRET=1: launch returns None
    launcher = TritonLauncher(m, None, "k", 1)
    for _ in range(3):
        launcher(torch.zeros(4))
    assert m.calls == ["jit"] * 3


class FakeCompiled:
    """A compiled kernel as Triton's CompiledKernel shows itself to a launch: `[grid]` gives
    Triton's runner; `run` is the launcher compiled for its signature."""

    function, packed_metadata = "cu-function", "packed"

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("runner", grid, args))

    def run(self, *args):
        self.launches.append(args)


class FakeDriver:
    """The active driver: device 3, whose current stream changes from launch to launch (as under
    `torch.cuda.stream(s)` or a CUDA graph's capture)."""

    def __init__(self):
        self.streams = iter([1001, 1002])

    def get_current_device(self):
        return 3

    def get_current_stream(self, device):
        assert device == 3
        return next(self.streams)


def test_direct_launch_reads_the_stream_per_launch_and_calls_no_hooks(monkeypatch):
    monkeypatch.setattr(driver, "_active", FakeDriver())
    for hook in ("launch_enter_hook", "launch_exit_hook"):
        monkeypatch.setattr(knobs.runtime, hook, None)
    compiled = FakeCompiled()
    launch = Direct(compiled)[(7, 2, 1)]
    launch("x", "out", 64)
    launch("y", "out", 64)
    assert compiled.launches == [
        (7, 2, 1, 1001, "cu-function", "packed", None, None, None, "x", "out", 64),
        (7, 2, 1, 1002, "cu-function", "packed", None, None, None, "y", "out", 64)]


@pytest.mark.parametrize("hook", ["a function", "a hook chain with a hook"])
def test_direct_launch_with_a_hook_installed_is_tritons_runner(monkeypatch, hook):
    """A launch hook someone installed (Triton's proton profiler) is still called: the launch
    goes through Triton's own runner."""
    monkeypatch.setattr(driver, "_active", FakeDriver())
    seen = []
    if hook == "a function":
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", seen.append)
    else:
        chain = knobs.HookChain()
        chain.add(seen.append)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    compiled = FakeCompiled()
    Direct(compiled)[(7, 1, 1)]("x")
    assert compiled.launches == [("runner", (7, 1, 1), ("x",))]
