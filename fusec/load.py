"""What `fusec run|explain|kernels|profile X` runs: X names a program and its inputs.

    sin4                          an example of this repository (examples/sin4.py)
    path/to/file.py               a file that defines example() -> fusec.demo.Example, or a
                                  KernelBench-style file: `Model` (built from get_init_inputs(),
                                  if the file has it) and get_inputs()
    path/to/file.py:name          `name` in that file: a function, a module object, or an
                                  nn.Module class (built from get_init_inputs(), else with no
                                  arguments); dots reach inside (`file.py:net.encoder`)
    package.module:name           the same, from an importable module (`torchvision.models:resnet18`
                                  is a function returning a model: it is called with no arguments)

The inputs come from `--inputs "randn(8, 64), randint(0, 10, (8,))"` (torch's tensor factories
and dtypes by their bare names; the text is parsed, never run as Python: see parse_inputs),
else the file's `example_inputs()` or `get_inputs()`. A program without either is an error
that says how to give them.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import operator
from pathlib import Path

import torch

from fusec.demo import Example, load_example
from fusec.errors import FusecError

# what --inputs may call by its bare name (torch's tensor factories) and the dtypes
_FACTORIES = ("randn", "rand", "randint", "zeros", "ones", "full", "arange", "linspace",
              "tensor", "empty", "eye", "randperm")
_DTYPES = ("float16", "bfloat16", "float32", "float64", "float", "half", "double", "int8",
           "uint8", "int16", "int32", "int64", "long", "int", "bool")


# tensor methods --inputs may call on a factory's result (`randn(4, 8).t()`, `.half()`)
_METHODS = ("to", "half", "float", "double", "bfloat16", "int", "long", "bool", "t",
            "contiguous", "transpose", "permute", "reshape", "view", "expand", "requires_grad_")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def parse_inputs(text: str, device: str = "cpu") -> tuple:
    """`--inputs "randn(8, 64), randint(0, 10, (8,))"` -> the tensors (on `device`).

    The text is not run as Python: it is parsed (ast) and only these are evaluated, so a
    command line cannot run arbitrary code: literals (numbers, strings, True/False/None, tuples,
    lists), + - * / // ** on them, torch's tensor factories and dtypes by their bare names or as
    `torch.<name>` (_FACTORIES, _DTYPES), keyword arguments, and a few tensor methods on a
    factory's result (_METHODS: `randn(8, 4).t()`, `.half()`, `.to(bfloat16)`)."""
    try:
        tree = ast.parse(f"({text},)", mode="eval")
        value = _evaluate(tree.body)
    except Exception as err:  # noqa: BLE001 (shown to the user)
        raise FusecError(f"fusec: --inputs {text!r} is not a list of tensors: "
                         f"{type(err).__name__}: {err}. Write torch calls by their bare names, "
                         f"e.g. --inputs \"randn(8, 64), randint(0, 10, (8,))\"") from None
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in value)


def _evaluate(node: ast.AST):
    """One node of --inputs' parsed text, if it is one of the forms parse_inputs allows."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_evaluate(e) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(right, (int, float)) and abs(right) > 64:
            raise ValueError(f"an exponent of {right} is too large for a size")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.Call):
        args = [_evaluate(a) for a in node.args]
        kwargs = {k.arg: _evaluate(k.value) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords):
            raise ValueError("**keyword unpacking is not allowed")
        if isinstance(node.func, ast.Attribute) and not _is_torch_name(node.func):
            if node.func.attr not in _METHODS:
                raise ValueError(f".{node.func.attr}() is not one of the tensor methods allowed "
                                 f"here ({', '.join(_METHODS)})")
            owner = _evaluate(node.func.value)
            if not isinstance(owner, torch.Tensor):
                raise ValueError(f".{node.func.attr}() is allowed on a tensor only")
            return getattr(owner, node.func.attr)(*args, **kwargs)
        name = _name(node.func)
        if name not in _FACTORIES:
            raise ValueError(f"{ast.unparse(node.func)}() is not one of torch's tensor factories "
                             f"({', '.join(_FACTORIES)})")
        return getattr(torch, name)(*args, **kwargs)
    name = _name(node)
    if name in _DTYPES:
        return getattr(torch, name)
    raise ValueError(f"{ast.unparse(node)!r} is not allowed here (only literals, torch's tensor "
                     "factories and dtypes)")


def _is_torch_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
        node.value.id == "torch"


def _name(node: ast.AST) -> str | None:
    """`randn` or `torch.randn` -> "randn"; anything else -> None."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if _is_torch_name(node) else None


def _module_from_file(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resolve(owner, dotted: str, where: str):
    value = owner
    for part in dotted.split("."):
        if not hasattr(value, part):
            raise FusecError(f"fusec: {where} has no {dotted!r} ({part!r} is missing)")
        value = getattr(value, part)
    return value


def _build(module, value):
    """A program from what `name` holds: a class is built, a function returning a module (a
    model factory taking no arguments) is called, anything else is used as it is."""
    if inspect.isclass(value) and issubclass(value, torch.nn.Module):
        init = getattr(module, "get_init_inputs", None)
        if callable(init):
            return value(*init())
        missing = _required_parameters(value.__init__)[1:]  # (less `self`)
        if missing:
            raise FusecError(f"fusec: {value.__name__}() needs {', '.join(p.name for p in missing)}"
                             f": define get_init_inputs() next to it, returning the arguments to "
                             f"build it with (KernelBench's form), or name a built module object")
        return value()
    if inspect.isfunction(value) and not _required_parameters(value) and \
            _returns_module(value):
        return value()
    return value


def _required_parameters(fn) -> list:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                       p.POSITIONAL_OR_KEYWORD)]


def _returns_module(fn) -> bool:
    hint = getattr(fn, "__annotations__", {}).get("return")
    if isinstance(hint, type):
        return issubclass(hint, torch.nn.Module)
    return fn.__module__.split(".")[0] in ("torchvision", "timm", "transformers")


def _inputs(module, text: str | None, device: str, name: str) -> tuple:
    if text is not None:
        return parse_inputs(text, device)
    for getter in ("example_inputs", "get_inputs"):
        found = getattr(module, getter, None)
        if callable(found):
            value = found()
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
            return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in value)
    raise FusecError(f"fusec: {name} has no inputs: give them with --inputs \"randn(8, 64)\", "
                     f"or define example_inputs() (or get_inputs()) next to it")


def load(spec: str, *, device: str = "cpu", inputs: str | None = None,
         small: bool = False) -> Example:
    """The program and inputs that `spec` names (see the module docstring)."""
    target, _, attr = spec.partition(":") if ":" in spec and not Path(spec).exists() \
        else (spec, "", "")
    path = Path(target)
    if target.endswith(".py") or path.is_file() or "/" in target:
        if not path.is_file():
            raise FusecError(f"fusec: no such file: {target}")
        module = _module_from_file(path)
    elif attr:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise FusecError(f"fusec: cannot import {target!r} ({err})") from None
    else:
        try:
            module = load_example(target)
        except (ImportError, SystemExit):
            raise FusecError(f"fusec: {target!r} is neither a file nor an example of this "
                             "repository (fusec run sin4, fusec run path/to/model.py:Model, "
                             "fusec run package.module:name)") from None
    if not attr and hasattr(module, "example"):  # the repository's own example form
        ex = module.example(device=device, **(getattr(module, "SMALL", {}) if small else {}))
        return ex if inputs is None else Example(ex.name, ex.fn, parse_inputs(inputs, device),
                                                 ex.about)
    if not attr:
        if not hasattr(module, "Model"):
            raise FusecError(f"fusec: {target} defines neither example() nor Model: name the "
                             f"program to run, as {target}:name")
        attr = "Model"
    program = _build(module, _resolve(module, attr, target))
    if isinstance(program, torch.nn.Module):
        program = program.to(device)
    if not callable(program):
        raise FusecError(f"fusec: {spec} is a {type(program).__name__}, not something to call")
    return Example(name=attr.rpartition(".")[2], fn=program,
                   inputs=_inputs(module, inputs, device, spec), about=f"{spec}")
