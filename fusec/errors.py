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
