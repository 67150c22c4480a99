"""fusec/runtime/fast_start/triton_launch.py: after the first launch, a Triton kernel is called
through its compiled kernel directly, unless a pointer lost the alignment the kernel was
specialized for.

On a CPU (TRITON_INTERPRET=1) Triton returns no compiled kernel, so the fast path only runs on a
GPU (tests/test_cuda_graphs.py and every triton test there). Here a stand-in module shows the
decisions: which calls go to the JIT and which to the bound kernel.
"""
import torch

from fusec.runtime.fast_start.triton_launch import TritonLauncher


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
        assert compiled is self
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
