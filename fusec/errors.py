"""The errors fusec raises. Every one of them names the problem in words a user can act on."""


class FusecError(Exception):
    """Base class for every error fusec raises on purpose."""


class UnsupportedError(FusecError):
    """The program uses something fusec cannot capture or run (data-dependent control flow, ...)."""


class GraphBreakError(UnsupportedError):
    """The program cannot be one static graph: Python control flow on tensor values, `.item()`,
    an op whose output shape depends on the data, or Python that must run on every call (print,
    numpy). `fullgraph=False` (the default) compiles the regions around it instead (graph breaks,
    fusec/capture/regions.py); `fullgraph=True` raises this.

    `reason` says what happened in a few words; `where` is the user's `file:line` (or "")."""

    def __init__(self, message: str, reason: str = "", where: str = ""):
        super().__init__(message)
        self.reason = reason or message
        self.where = where


class DeviceError(FusecError):
    """An input lives on a device the chosen backend cannot run on, or inputs mix devices."""


# Note (eager's exception types). A program that eager refuses for these inputs (a size
# mismatch, a view that cannot be, tensors on two devices) makes capture fail with the error
# torch raised: RuntimeError, IndexError, ValueError or TypeError. fusec reports it as its own
# error (naming the user's line), and that error is *also* of the type eager raises, so a caller's
# `except RuntimeError:` catches fusec's as it catches eager's (`like_eager`).
_EAGER_TYPES = (IndexError, ValueError, TypeError, NotImplementedError, RuntimeError)


def like_eager(cls: type, err: BaseException) -> type:
    """`cls` (UnsupportedError, DeviceError), or its subclass that is also the built-in
    exception type `err` is an instance of (Note: eager's exception types)."""
    base = next((b for b in _EAGER_TYPES if isinstance(err, b)), None)
    if base is None or issubclass(cls, base):
        return cls
    return globals()[f"{cls.__name__}As{base.__name__}"]


class CompilerNotFoundError(FusecError):
    """The C++ backend needs a C compiler and none was found."""


class CompileError(FusecError):
    """A generated kernel failed to compile; the message holds the compiler's output."""


class MismatchError(FusecError):
    """`check=True` found a fused result further from the float64 reference than eager's."""


class FusecWarning(UserWarning):
    """The base of fusec's warnings: `warnings.simplefilter("error", fusec.FusecWarning)` turns
    every one of them into an error, `"ignore"` silences them."""


class FallbackWarning(FusecWarning):
    """A kernel no backend could build runs its group's ATen ops eagerly (said once per kernel;
    fusec/runtime/eager.py)."""


class GraphBreakWarning(FusecWarning):
    """fusec.compile could not capture the program as one graph and compiles it in regions,
    with graph breaks between them (fusec/capture/regions.py). Said once per compiled program."""


# The classes `like_eager` returns: UnsupportedErrorAsRuntimeError is an UnsupportedError and a
# RuntimeError, and so on (module-level names, so that they pickle).
for _fusec in (UnsupportedError, DeviceError):
    for _eager in _EAGER_TYPES:
        _name = f"{_fusec.__name__}As{_eager.__name__}"
        globals()[_name] = type(_name, (_fusec, _eager), {"__module__": __name__,
                                                          "__qualname__": _name,
                                                          "__doc__": f"A {_fusec.__name__} for a "
                                                          f"program eager refuses with {_eager.__name__}."})
del _fusec, _eager, _name
