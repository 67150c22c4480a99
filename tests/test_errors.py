"""Errors a user can act on: every refusal is a fusec error class with a one-paragraph message that
points at the user's own code, never a torch-internal traceback.
"""
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fusec
from fusec.codegen.cpp import find_compiler

THIS_FILE = os.path.basename(__file__)


def sin4(x):
    return torch.sin(torch.sin(torch.sin(torch.sin(x))))


def line_of(fn, text: str) -> int:
    """The line number of `text` inside fn's source."""
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if text in line:
            return start + i
    raise AssertionError(f"{text!r} not in {fn.__name__}")


def assert_points_at_user_code(err: BaseException, fn, text: str):
    message = str(err)
    assert THIS_FILE in message, message
    assert f"{THIS_FILE}:{line_of(fn, text)}" in message, message
    assert text in message, message
    # one clear message: no traceback, no torch internals pasted in, no chained torch error shown
    assert "Traceback" not in message and 'File "' not in message, message
    assert os.path.dirname(torch.__file__) not in message, message
    assert "site-packages" not in message, message
    assert "TORCH_LOGS" not in message and "TORCHDYNAMO" not in message, message
    assert err.__cause__ is None and err.__suppress_context__, "torch's error is chained on"


# ---- data-dependent Python -----------------------------------------------------------------------
# With fullgraph=True these raise the clear error below; by default (fullgraph=False) they run in
# compiled regions with graph breaks instead (tests/test_graph_breaks.py).

def branch_on_tensor(x):
    if x.sum() > 0:
        return torch.sin(x)
    return torch.cos(x)


def python_scalar_from_tensor(x):
    scale = x.abs().max().item()
    return x / scale


def test_control_flow_on_tensor_values(target):
    backend, device = target
    cf = fusec.compile(branch_on_tensor, backend=backend, fullgraph=True)
    with pytest.raises(fusec.GraphBreakError) as info:
        cf(torch.randn(16, device=device))
    assert_points_at_user_code(info.value, branch_on_tensor, "if x.sum() > 0:")
    assert "torch.where" in str(info.value)  # says what to do instead
    assert cf.compiled == {}


def test_item(target):
    backend, device = target
    with pytest.raises(fusec.GraphBreakError) as info:
        fusec.compile(python_scalar_from_tensor, backend=backend,
                      fullgraph=True)(torch.randn(16, device=device))
    assert_points_at_user_code(info.value, python_scalar_from_tensor, "x.abs().max().item()")


def nonzero(x):
    return torch.nonzero(x > 0)


def boolean_mask(x):
    return torch.sin(x[x > 0])


@pytest.mark.parametrize("fn, text", [(nonzero, "torch.nonzero(x > 0)"),
                                      (boolean_mask, "x[x > 0]")], ids=["nonzero", "mask"])
def test_data_dependent_output_shape(target, fn, text):
    backend, device = target
    with pytest.raises(fusec.GraphBreakError) as info:
        fusec.compile(fn, backend=backend, fullgraph=True)(torch.randn(16, device=device))
    assert "depends on the data" in str(info.value)
    assert_points_at_user_code(info.value, fn, text)


# ---- devices -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["auto", "cpp", "triton"])
def test_inputs_on_different_devices(backend):
    cf = fusec.compile(lambda a, b: a * b + 1, backend=backend)
    from conftest import TRITON_DEVICE
    a = torch.randn(4, device=TRITON_DEVICE if backend == "triton" else "cpu")
    b = torch.randn(4, device="meta")
    with pytest.raises(fusec.DeviceError) as info:
        cf(a, b)
    message = str(info.value)
    assert f"a on {a.device.type}" in message and "b on meta" in message
    assert cf.compiled == {}


def test_cpp_backend_rejects_other_devices():
    with pytest.raises(fusec.DeviceError, match="backend 'cpp' runs on CPU tensors.*meta"):
        fusec.compile(sin4, backend="cpp")(torch.randn(8, device="meta"))
    with pytest.raises(fusec.DeviceError, match="meta"):
        fusec.explain(sin4, torch.randn(8, device="meta"), backend="cpp")


def test_triton_backend_rejects_meta():
    with pytest.raises(fusec.DeviceError, match="meta"):
        fusec.compile(sin4, backend="triton")(torch.randn(8, device="meta"))


def test_auto_backend_on_an_unsupported_device():
    # In a child process: today this segfaults, which must not take pytest down with it.
    code = textwrap.dedent("""
        import torch, fusec
        try:
            fusec.compile(lambda x: torch.sin(x) * 2)(torch.randn(8, device="meta"))
        except fusec.DeviceError as err:
            print("DeviceError:", err)
        else:
            print("no error")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.startswith("DeviceError:") and "meta" in proc.stdout, proc.stdout


# ---- configuration -----------------------------------------------------------------------------

def test_unknown_backend():
    for make in (lambda: fusec.compile(sin4, backend="llvmm"),
                 lambda: fusec.compile(backend="llvmm")(sin4),
                 lambda: fusec.compile(torch.nn.ReLU(), backend="llvmm"),
                 lambda: fusec.explain(sin4, torch.randn(4), backend="llvmm")):
        with pytest.raises(fusec.FusecError) as info:
            make()
        message = str(info.value)
        assert "'llvmm'" in message and "cpp" in message and "triton" in message


@pytest.fixture
def no_cxx(monkeypatch, tmp_path):
    """$CXX names a compiler that does not exist; a fresh cache, so nothing can be reused."""
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "fusec-missing-g++")
    from fusec.runtime import build
    monkeypatch.setattr(build, "_FELL_BACK", set())  # the fallback is said once per process
    find_compiler.cache_clear()
    yield "fusec-missing-g++"
    monkeypatch.undo()
    find_compiler.cache_clear()


def test_missing_compiler(no_cxx, monkeypatch):
    from fusec.runtime import build
    monkeypatch.setattr(build, "_FELL_BACK", set())
    cf = fusec.compile(sin4, backend="cpp")
    x = torch.randn(100)
    # a kernel the C++ backend cannot build is built by the LLVM backend, and that is said
    with pytest.warns(UserWarning, match="llvm backend builds") as info:
        torch.testing.assert_close(cf(x), sin4(x))
    said = "\n".join(str(w.message) for w in info)
    assert no_cxx in said
    assert "backend='llvm'" in said  # says what to do instead
    assert [k.backend for k in cf.kernels] == ["llvm"]
    # auto picks the LLVM backend on CPU when there is no C++ compiler (tests/test_llvm.py)
    with pytest.warns(UserWarning, match="LLVM backend"):
        monkeypatch_said = fusec.api._SAID_LLVM
        fusec.api._SAID_LLVM = False
        try:
            af = fusec.compile(sin4)
            torch.testing.assert_close(af(x), sin4(x))
        finally:
            fusec.api._SAID_LLVM = monkeypatch_said
    assert af.kernels[0].backend == "llvm"

    # The Triton backend needs no C compiler: it keeps working in the same process.
    from conftest import TRITON_DEVICE
    tf = fusec.compile(sin4, backend="triton")
    xt = x.to(TRITON_DEVICE)
    torch.testing.assert_close(tf(xt), sin4(xt))
    assert tf.kernels[0].backend == "triton"


def test_missing_compiler_is_not_sticky(no_cxx, monkeypatch):
    cf = fusec.compile(sin4, backend="cpp")
    x = torch.randn(100)
    with pytest.warns(UserWarning):
        cf(x)  # built by the LLVM backend instead
    assert [k.backend for k in cf.kernels] == ["llvm"]
    monkeypatch.delenv("CXX")
    find_compiler.cache_clear()
    cf = fusec.compile(sin4, backend="cpp")  # a new function: g++ builds it again
    torch.testing.assert_close(cf(x.reshape(10, 10)), sin4(x.reshape(10, 10)))
    assert [k.backend for k in cf.kernels] == ["cpp"]


def broadcast_error(x, y):
    return torch.sin(x.t()) * y + 1.0


@pytest.mark.parametrize("debug", [False, True])
def test_a_failed_capture_says_one_thing(debug, caplog, monkeypatch):
    """The tutorial's shape error: fusec's one-line message, without torch's fake-tensor
    traceback logged before it (60 lines); FUSEC_LOG=debug keeps torch's logs."""
    if debug:
        monkeypatch.setenv("FUSEC_LOG", "debug")
    with caplog.at_level("ERROR"):
        with pytest.raises(fusec.UnsupportedError, match="Attempting to broadcast"):
            fusec.compile(broadcast_error, backend="cpp")(torch.randn(64, 32), torch.randn(32))
    torch_records = [r for r in caplog.records if r.name.startswith("torch")]
    assert bool(torch_records) == debug


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_a_matmul_of_two_dtypes_is_refused_as_eager_refuses_it(backend):
    """Fake tensors let `x_f32 @ w_f64` through; eager raises. fusec raises too, naming the
    dtypes, instead of computing something eager would not."""
    x, w = torch.randn(2, 24), torch.randn(8, 24, dtype=torch.float64)
    for f in (lambda x, w: x @ w.t(), lambda x, w: F.linear(x, w, torch.zeros(8)),
              lambda x, w: torch.mv(w, x[0])):
        with pytest.raises(RuntimeError):
            f(x, w)
        with pytest.raises(fusec.UnsupportedError, match="float32.*float64|float64.*float32"):
            fusec.compile(f, backend=backend)(x, w)


@pytest.mark.parametrize("program, args, eager_type", [
    (lambda x, y: x + y, (torch.randn(3), torch.randn(4)), RuntimeError),
    (lambda x: x.view(7, -1), (torch.randn(10),), RuntimeError),
    (lambda x: torch.cat([x, x], dim=3), (torch.randn(2, 3),), IndexError),
])
def test_a_program_eager_refuses_raises_eagers_type_too(program, args, eager_type):
    """Bad input that eager refuses (a size mismatch, an impossible view, a dim out of range)
    is a fusec error that names the line and is also of the type eager raises, so a caller's
    `except RuntimeError:` catches it as it catches eager's (fusec/errors.py like_eager)."""
    import pickle
    with pytest.raises(eager_type):
        program(*args)
    with pytest.raises(eager_type) as caught:
        fusec.compile(program, backend="cpp")(*args)
    assert isinstance(caught.value, fusec.UnsupportedError), type(caught.value).__mro__
    assert "fusec:" in str(caught.value)
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is type(caught.value) and str(again) == str(caught.value)
