"""The errors fusec raises. Every one of them names the problem in words a user can act on."""


class FusecError(Exception):
    """Base class for every error fusec raises on purpose."""


class UnsupportedError(FusecError):
    """The program uses something fusec cannot capture or run (data-dependent control flow, ...)."""


class DeviceError(FusecError):
    """An input lives on a device the chosen backend cannot run on, or inputs mix devices."""


class CompilerNotFoundError(FusecError):
    """The C++ backend needs a C compiler and none was found."""


class CompileError(FusecError):
    """A generated kernel failed to compile; the message holds the compiler's output."""


class MismatchError(FusecError):
    """`check=True` found a fused result further from the float64 reference than eager's."""
