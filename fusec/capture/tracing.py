"""The conditions capture traces under, and what a tracing failure means for the user.

Why this file is long: every piece of Python that a trace must refuse (print, numpy, random
draws, checkpoints) is put in place and taken back in one function, next to the errors it raises.

While make_fx traces, a few things must hold that plain tracing does not give: Python that a
graph cannot hold (`print`, `.numpy()` of a traced tensor) is refused instead of running once
(`python_at_trace_time_refused`), libraries see `torch.compiler.is_compiling()` (`compiling`),
and SDPA gets dense attention masks on a GPU (`dense_attention_masks`). A failure turns into
one line at the user's source line (`capture_error`): a GraphBreakError when the program cannot
be one static graph or raised its own exception (capture/breaks.py), else an UnsupportedError.
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import os
import random
import sys
import sysconfig
import threading
import traceback
from typing import Callable

import torch
import torch.compiler as tc
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from fusec.errors import DeviceError, GraphBreakError, UnsupportedError, like_eager


_TORCH_DIR = os.path.dirname(torch.__file__)
_FUSEC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the fusec package


def _in_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB_DIR) and "-packages" not in filename


def _user_frame(err: BaseException):
    """The innermost stack frame that belongs to the user's code (not torch, not fusec)."""
    frames = traceback.extract_tb(err.__traceback__)
    user = [f for f in frames
            if not f.filename.startswith(_TORCH_DIR) and not _in_stdlib(f.filename)
            and not os.path.abspath(f.filename).startswith(_FUSEC_DIR)
            and not f.filename.startswith("<")]
    return user[-1] if user else None


def capture_error(err: BaseException) -> UnsupportedError:
    """One clear fusec error for a torch-internal tracing failure. The failures that mean "this
    program cannot be one static graph" are GraphBreakErrors: with fullgraph=False, fusec then
    compiles the program in regions around them (capture/breaks.py)."""
    frame = _user_frame(err)
    where = f" at {frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else ""
    line = f"{frame.filename}:{frame.lineno}" if frame else ""
    name = type(err).__name__
    text = str(err).strip().splitlines()[0] if str(err).strip() else name
    if "DataDependent" in name or "data-dependent" in text.lower() or "GuardOnDataDependent" in name \
            or "data is not allocated yet" in text:  # (an op reading its tensor argument's values:
        # tensor_split's indices, repeat_interleave's repeats, tensor sizes passed as tensors)
        return GraphBreakError(
            f"fusec: Python control flow or a Python value that depends on tensor data{where}. "
            "fusec captures one static graph per input signature, so `if tensor:`, `.item()`, "
            "`.tolist()` and loops over tensor values cannot be traced; use torch.where for "
            "branches or move the decision outside the compiled function",
            reason="Python control flow or a Python value that depends on tensor data", where=line)
    if "mutating a non-functional tensor with a functional tensor" in text:
        return GraphBreakError(
            f"fusec: an in-place update of a tensor that is neither an input, a parameter nor a "
            f"buffer (a plain module attribute, a global or a closure's tensor){where}; a captured "
            "graph would update it once, while tracing",
            reason="an in-place update of a tensor that is not an input, parameter or buffer",
            where=line)
    if "DynamicOutputShape" in name:
        return GraphBreakError(
            f"fusec: an op whose output shape depends on the data (nonzero, unique, boolean-mask "
            f"indexing){where}; fusec compiles static shapes only ({text})",
            reason=f"an op whose output shape depends on the data ({text})", where=line)
    if frame is not None and frame == traceback.extract_tb(err.__traceback__)[-1] and \
            type(err).__module__.split(".")[0] not in ("torch", "fusec"):  # the program's `raise`
        return GraphBreakError(f"fusec: the program raised {name}{where}: {text}",  # (eager does
                               reason=f"the program raises {name}", where=line)  # too: regions)
    if "DeviceMismatch" in name:  # eager raises it too: `cpu_tensor + cuda_tensor`
        return like_eager(DeviceError, err)(
            f"fusec: tensors on different devices meet in one op{where}: {text}")
    return like_eager(UnsupportedError, err)(
        f"fusec: could not capture the program{where}: {name}: {text}")


# ---- Python that a static graph would run only once ----------------------------------------------

def _user_caller():
    """The innermost frame on the current stack that belongs to the user (not torch, not fusec)."""
    frame = sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def is_user_file(path: str) -> bool:
    """Code of the program being compiled (the user's, or a library's it calls, such as
    transformers), not torch's, fusec's or Python's own standard library."""
    path = os.path.abspath(path) if not path.startswith("<") else path
    return not (path.startswith(_TORCH_DIR) or path.startswith("<")
                or path.startswith(_FUSEC_DIR)
                or (path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path))


_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep


def _runs_python(what: str, why: str, frame) -> GraphBreakError:
    line = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
    at = f" at {line}" if line else ""
    return GraphBreakError(f"fusec: {what}{at}: {why}", reason=what, where=line)


def is_traced(t) -> bool:
    """A tensor of the trace (fake, functionalized), not one that holds data."""
    return isinstance(t, (FakeTensor, FunctionalTensor)) or \
        torch._C._functorch.is_functorch_wrapped_tensor(t)


_QUIET = threading.local()  # .on: this thread is capturing, and torch's own error logs are noise


class _CaptureNoise(logging.Filter):
    """Drops what torch logs while a capture in this thread fails: a shape error inside the trace
    makes torch's fake-tensor code log a 60-line traceback at ERROR level, before fusec raises
    its own one-line message at the user's line. `FUSEC_LOG=debug` keeps them. (Other threads'
    logs pass: the filter asks a thread-local flag.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_QUIET, "on", False)


_FILTER = _CaptureNoise()
for _name in ("torch._subclasses.fake_tensor", "torch.fx.experimental.proxy_tensor",
              "torch.fx.experimental.symbolic_shapes"):
    logging.getLogger(_name).addFilter(_FILTER)


def _debug_logs() -> bool:
    topics = {t.strip() for t in os.environ.get("FUSEC_LOG", "").split(",")}
    return "debug" in topics or "all" in topics


@contextlib.contextmanager
def compiling():
    """While tracing, `torch.compiler.is_compiling()` is True, as it is inside torch.compile and
    torch.export: fusec's capture is a compile. Libraries ask it to choose their traceable path;
    transformers, for one, then stops checking whether an attention mask is all ones
    (`mask.all()`, a Python branch on tensor data) and keeps the mask in the graph. torch's own
    error logs are held back meanwhile (`_CaptureNoise`)."""
    quiet = getattr(_QUIET, "on", False)
    _QUIET.on = not _debug_logs()
    if not hasattr(tc, "_is_compiling_flag"):  # an older torch: nothing to say it with
        try:
            yield
        finally:
            _QUIET.on = quiet
        return
    before = tc._is_compiling_flag
    tc._is_compiling_flag = True
    try:
        yield
    finally:
        tc._is_compiling_flag = before
        _QUIET.on = quiet


class _DenseAttentionMasks(torch.overrides.TorchFunctionMode):
    """See `dense_attention_masks`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask")
            bound = dict(zip(names, args), **kwargs)
            mask = bound.get("attn_mask")
            if isinstance(mask, torch.Tensor) and mask.is_cuda and mask.dim() > 0 \
                    and mask.shape[-1] > 1 and mask.stride(-1) != 1:
                args = tuple(a.contiguous() if i == 3 else a for i, a in enumerate(args))
                if "attn_mask" in kwargs:
                    kwargs = dict(kwargs, attn_mask=mask.contiguous())
        return func(*args, **kwargs)


@contextlib.contextmanager
def dense_attention_masks():
    """While tracing, an attention mask given to `F.scaled_dot_product_attention` on a GPU is
    made dense in its last dim.

    Note (attention masks with stride 0). SDPA picks its kernel when it is called, from its
    arguments: the fused kernels (cuDNN, flash, memory-efficient) need the mask's last dim
    contiguous, so a mask broadcast along the keys (stride 0, as `mask.expand(...)` makes) sends
    it to the math path: two matmuls in float32 around a softmax. transformers' BERT, called
    without an attention mask inside a compile (`torch.compiler.is_compiling()`, see
    `compiling`), builds exactly such a mask, (16, 1, 512, 512) with strides (0, 512, 1, 0): on
    an H100 the model ran 2.4x slower than eager, which passes no mask at all. The dense copy
    holds the same values (a few MB once per call), and the choice becomes cuDNN's attention."""
    with _DenseAttentionMasks():
        yield


class _ForwardOnlyContext:
    """The `ctx` a custom autograd.Function's `forward(ctx, ...)` receives when no backward will
    ever run: what it saves is dropped, and no input needs a gradient."""

    def __init__(self, n_inputs: int):
        self.needs_input_grad = (False,) * n_inputs
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass  # the in-place update itself is traced; functionalize makes it explicit

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


@contextlib.contextmanager
def autograd_functions_inlined():
    """While tracing, a custom `torch.autograd.Function` runs its `forward` directly.

    Capture traces inside `torch.func.functionalize` with gradients off, and torch cannot take a
    custom Function there. One written the old way (`forward(ctx, ...)`, no `setup_context`) is
    refused inside any functorch transform ("it must override the setup_context staticmethod").
    One written the new way fails in functionalize ("NYI: Functionalize rule for
    custom_function_call"). So a model that uses either could not be compiled for inference.
    Hugging Face's BLOOM is an example: its `GeLUFunction.apply(x)`.
    With gradients off, `apply` computes exactly `forward`'s outputs and records nothing for a
    backward. So the capture calls `forward` itself, the old way with a context that keeps
    nothing. The ops inside it are then traced like any others, and fused.
    The training path (capture/training.py, AOT autograd) does not use this; it traces the
    Function's own backward.
    Note: the patch is process-wide while a capture runs, but acts only in the thread that
    traces (see the note on tracing and threads below)."""
    from torch.autograd.function import Function, _SingleLevelFunction
    real = Function.__dict__["apply"]  # the classmethod object itself, restored as is

    def apply(cls, *args, **kwargs):
        if torch.is_grad_enabled() or not _tracing_here():  # (another thread's call: as it was)
            return real.__func__(cls, *args, **kwargs)
        if cls.setup_context == _SingleLevelFunction.setup_context:  # forward(ctx, ...)
            return cls.forward(_ForwardOnlyContext(len(args)), *args, **kwargs)
        return cls.forward(*args, **kwargs)  # forward(...), setup_context(ctx, ...)

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = real


# Note (tracing and threads). torch's tracers are not thread-safe: make_fx keeps the tracer
# that patches functions in a global (torch.fx's `CURRENT_PATCHER`), and two threads tracing at
# once failed with "CURRENT_PATCHER is None in finally block". So every trace in the process
# runs under one lock, `CAPTURE_LOCK`, taken by `python_at_trace_time_refused`, which every
# capture enters (frontend.py, runtime/fast_start/fingerprint.py, training's first call). The lock is re-entrant:
# AOT Autograd, tracing the training path, compiles its forward graph with a capture of its own.
# What the context replaces (`print`, `Tensor.numpy`, jiterator's launcher) is put in place by
# the outermost capture and put back, exactly as it was, when that capture ends; and the
# replacement `print` refuses only in the thread that traces (`_TRACING.depth`): another
# thread's `print`, while a capture runs, prints.
CAPTURE_LOCK = threading.RLock()
_TRACING = threading.local()  # .depth: how many captures this thread is inside


def _tracing_here() -> bool:
    """Is this thread inside a capture?"""
    return getattr(_TRACING, "depth", 0) > 0


def tracing_here() -> bool:
    """Is this thread tracing a program now (running the user's code on traced tensors)?"""
    return _tracing_here()


@contextlib.contextmanager
def python_at_trace_time_refused():
    """While tracing, refuse the Python that a graph cannot hold and that would otherwise run
    once at trace time and never again: the user's `print(...)` (it would print once), and
    `.numpy()` / `np.asarray` of a traced tensor (it would read memory that holds no data and
    bake it into the graph as a constant: a wrong result). Both raise a GraphBreakError, which
    with fullgraph=False sends the program to the graph-break path, where they run every call.
    It also holds `CAPTURE_LOCK`: one trace at a time in the process (see the note above)."""
    with CAPTURE_LOCK:
        depth = getattr(_TRACING, "depth", 0)
        restore = _refuse_python() if depth == 0 else None
        _TRACING.depth = depth + 1
        try:
            yield
        finally:
            _TRACING.depth = depth
            if restore is not None:
                restore()


@contextlib.contextmanager
def grad_mode_of_caller(read: Callable[[bool], None]):
    """Within (on this thread): the program's own `torch.is_grad_enabled()` answers, while
    tracing, what it answers here and now, in the caller, and `read(answer)` is told.

    Note (grad mode while tracing). An inference capture traces under `torch.no_grad()` (no
    autograd records for a graph that has no backward), so a program that asks
    `torch.is_grad_enabled()` (to skip work in evaluation, to choose a path) would read False
    though its caller had gradients on, and keep the wrong branch: a wrong result. So while
    tracing, the user's call of it (code in a user file, as for `print`) answers the caller's
    mode, and the read is a guard (`read` is capture/guards.py's `Recording.grad_mode_read`): a
    call under the other mode compiles again. torch's and fusec's own calls read the real mode."""
    outer = getattr(_TRACING, "caller_grad", None), getattr(_TRACING, "grad_read", None)
    if outer[0] is None:
        _TRACING.caller_grad, _TRACING.grad_read = torch.is_grad_enabled(), read
    try:
        yield
    finally:
        _TRACING.caller_grad, _TRACING.grad_read = outer


def _grad_mode_as_callers():
    """Put the `torch.is_grad_enabled` of `grad_mode_of_caller` in place; returns the function
    that puts torch's back."""
    real = torch.is_grad_enabled

    def is_grad_enabled():
        caller = getattr(_TRACING, "caller_grad", None)
        if caller is None or not _tracing_here() \
                or not is_user_file(sys._getframe(1).f_code.co_filename):
            return real()
        _TRACING.grad_read(caller)
        return caller

    torch.is_grad_enabled = is_grad_enabled

    def restore():
        torch.is_grad_enabled = real
    return restore


def _refuse_python():
    """Put the refusing `print`, `Tensor.numpy`, jiterator launcher and Python random draws
    (`refuse_random`) in place; returns the function that puts the originals back."""
    real_print = builtins.print
    had_numpy = "numpy" in vars(torch.Tensor)
    real_numpy = torch.Tensor.numpy

    def print_(*args, **kwargs):
        if _tracing_here() and is_user_file(sys._getframe(1).f_code.co_filename):
            raise _runs_python("print(...)", "Python that runs on every call, but a captured graph "
                               "would run it once, while tracing; move it outside the compiled "
                               "function", sys._getframe(1))
        return real_print(*args, **kwargs)

    def numpy_(self, *args, **kwargs):
        if is_traced(self):
            raise _runs_python(".numpy() of a tensor the program computes", "numpy needs the "
                               "tensor's values, which do not exist while tracing (they would be "
                               "baked into the graph as garbage); use torch ops, or move it "
                               "outside the compiled function", _user_caller())
        return real_numpy(self, *args, **kwargs)

    # A jiterator kernel (torch.cuda.jiterator._create_jit_fn) launches real CUDA code on its
    # arguments, fake or not: on traced tensors it read address 0 and left the CUDA context
    # broken (an illegal memory access, found by the OpInfo sweep on an H200)
    real_jiterator = getattr(torch._C, "_cuda_jiterator_compile_and_launch_kernel", None)

    def jiterator_(*args, **kwargs):
        if not _tracing_here():
            return real_jiterator(*args, **kwargs)
        raise _runs_python("a jiterator kernel (torch.cuda.jiterator)", "it runs its own CUDA "
                           "code on the tensors, which hold no data while tracing", _user_caller())

    # torch.utils.checkpoint in a program traced for training: tracing runs through it, so AOT
    # Autograd's partitioner never learns which activations the user asked to recompute, and
    # saves them all (right answers, but the memory the checkpoint was there to save is spent).
    # TorchDynamo turns a checkpoint into a tagged region whose activations the partitioner
    # recomputes in the backward: a graph break. (Under torch.no_grad, an inference capture,
    # a checkpoint saves nothing and traces as its function.)
    from torch.utils import checkpoint as ckpt
    real_generator, real_function = ckpt._checkpoint_without_reentrant_generator, \
        ckpt.CheckpointFunction

    def refuse_checkpoint():
        if _tracing_here() and torch.is_grad_enabled():
            raise _runs_python("torch.utils.checkpoint", "its activations are recomputed in the "
                               "backward, which TorchDynamo's checkpoint regions tell the "
                               "partitioner and a traced graph cannot", _user_caller())

    def generator_(*args, **kwargs):
        refuse_checkpoint()
        return real_generator(*args, **kwargs)

    class CheckpointFunction_:  # (checkpoint() calls only its `apply`)
        @staticmethod
        def apply(*args):
            refuse_checkpoint()
            return real_function.apply(*args)

    builtins.print, torch.Tensor.numpy = print_, numpy_
    restore_random, restore_autograd = refuse_random(), refuse_autograd()
    restore_grad_mode = _grad_mode_as_callers()
    ckpt._checkpoint_without_reentrant_generator = generator_
    ckpt.CheckpointFunction = CheckpointFunction_
    if real_jiterator is not None:
        torch._C._cuda_jiterator_compile_and_launch_kernel = jiterator_

    def restore():
        builtins.print, ckpt.CheckpointFunction = real_print, real_function
        restore_grad_mode()
        restore_autograd()
        ckpt._checkpoint_without_reentrant_generator = real_generator
        if real_jiterator is not None:
            torch._C._cuda_jiterator_compile_and_launch_kernel = real_jiterator
        restore_random()
        setattr(torch.Tensor, "numpy", real_numpy) if had_numpy else delattr(torch.Tensor, "numpy")
    return restore


def refuse_autograd():
    """`loss.backward()` (or torch.autograd.grad) called by the program while it is traced, as a
    whole training step written as one function does (`opt.zero_grad(); loss.backward();
    opt.step()`): a traced graph computes values, it cannot run autograd on them (torch's errors
    said "Cannot backprop through mirrored meta"). A graph break: TorchDynamo compiles the forward
    and the optimizer step as regions and runs the backward between them, as eager does. (AOT
    Autograd's own calls, from torch's files, go through.) Returns the function that puts the
    originals back."""
    real_backward = torch.Tensor.backward
    real_autograd = torch.autograd.backward, torch.autograd.grad

    def refusing(real, what):
        def call(*args, **kwargs):
            if _tracing_here() and is_user_file(sys._getframe(1).f_code.co_filename):
                raise _runs_python(what, "autograd runs on the values of a call, which a traced "
                                   "graph does not have", sys._getframe(1))
            return real(*args, **kwargs)
        return call

    torch.Tensor.backward = refusing(real_backward, ".backward()")
    torch.autograd.backward = refusing(real_autograd[0], "torch.autograd.backward()")
    torch.autograd.grad = refusing(real_autograd[1], "torch.autograd.grad()")

    def restore():
        torch.Tensor.backward = real_backward
        torch.autograd.backward, torch.autograd.grad = real_autograd
    return restore


# Python's own random numbers: `if random.random() < self.layerdrop:` (LayerDrop, stochastic
# depth), `x * np.random.rand()`. Eager draws a new number on every call; a captured graph would
# keep the one drawn while tracing, forever (every call skips the same layers). While a capture
# runs, these module functions called from the user's code raise a GraphBreakError; in regions
# TorchDynamo draws them on every call. (`torch.rand(())` is a graph op, drawn on every call.)
# A name imported before (`from random import random`) is the original function, not seen.
_RANDOM = {"random": ("random", "uniform", "randint", "randrange", "choice", "choices", "sample",
                      "shuffle", "gauss", "normalvariate", "triangular", "betavariate",
                      "expovariate"),
           "numpy.random": ("rand", "randn", "random", "random_sample", "uniform", "normal",
                            "randint", "choice", "permutation", "shuffle")}


def refuse_random():
    """Put refusing versions of `random`'s and (when imported) `numpy.random`'s functions in
    place (see `_RANDOM`); returns the function that puts the originals back."""
    saved = [(owner, name, getattr(owner, name)) for module, names in _RANDOM.items()
             if (owner := random if module == "random" else sys.modules.get(module)) is not None
             for name in names if hasattr(owner, name)]
    for owner, name, real in saved:
        setattr(owner, name, _refusing(real, f"{owner.__name__}.{name}()"))
    return lambda: [setattr(owner, name, real) for owner, name, real in saved]


def _refusing(real, label: str):
    def draw(*args, **kwargs):
        frame = sys._getframe(1)
        if _tracing_here() and is_user_file(frame.f_code.co_filename):
            raise _runs_python(f"a Python random number ({label})", "eager draws a new one on "
                               "every call, a captured graph would keep the one drawn while "
                               "tracing; use torch.rand, or move it outside the compiled "
                               "function", frame)
        return real(*args, **kwargs)
    draw.__wrapped__ = real
    return draw


# ---- what eager refuses and fake tensors let through ---------------------------------------------

aten = torch.ops.aten
# Operand positions that eager's kernels require to share one dtype, and that torch's fake
# (meta) kernels do not check: traced, `x_f32 @ w_f64` would become a graph that computes what
# eager refuses to.
SAME_DTYPE = {aten.mm.default: (0, 1), aten.addmm.default: (0, 1, 2), aten.mv.default: (0, 1),
              aten.addmv.default: (0, 1, 2)}


def refuse_mixed_dtypes(gm):
    """gm, or the UnsupportedError eager's RuntimeError would be for a matmul whose operands
    differ in dtype (eager: "expected m1 and m2 to have the same dtype")."""
    for node in gm.graph.nodes:
        positions = SAME_DTYPE.get(node.target) if node.op == "call_function" else None
        values = [node.args[i].meta.get("val") for i in positions or ()
                  if i < len(node.args) and hasattr(node.args[i], "meta")]
        dtypes = [v.dtype for v in values if isinstance(v, torch.Tensor)]
        if len(set(dtypes)) > 1:
            raise UnsupportedError(
                f"fusec: {node.target.__name__.split('.')[0]} of operands of different dtypes "
                f"({', '.join(str(d).replace('torch.', '') for d in dtypes)}): eager PyTorch "
                "refuses it too (a matmul's operands share one dtype); cast them to one dtype")
    return gm
