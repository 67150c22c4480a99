"""Front end: turn a Python function or nn.Module into an ATen-level torch.fx graph.

Why this file is long: it is capture's one path, from the caller's arguments to an annotated
graph (tracing, lifting, naming, the argument objects a program fills); split, a reader would
follow one capture across files.

We trace with `make_fx` under fake tensors (no real computation happens) and torch's core ATen
decompositions, so a few hundred ATen ops reduce to a small core set (`silu` becomes
`sigmoid` and `mul`, `F.linear` becomes `permute` and `addmm` ...). `functionalize` removes in-place
updates: `y.add_(1)` becomes `y2 = add(y, 1)`, and a mutated input becomes an explicit `copy_`
at the end of the graph, the only side effect a captured graph can have.

The graph's inputs are the module's parameters and buffers (lifted: `p_fc_weight`), then every
tensor the caller passed, named after the function's arguments (`x`, `xs_0`, ...). A tensor the
module holds under two names (GPT-2's `lm_head.weight` *is* `transformer.wte.weight`) is lifted
once, under its first name. Python values that are not tensors (ints, floats, flags) are baked
into the graph as constants: arguments are part of a program's signature, and the module
attributes, globals and closure values that capture read are guarded (guards.py), so the compiled
program recompiles when they change. Tensors the program reaches without being given them (a
closure's mask, a plain tensor attribute) become graph attributes that the program reads where
they live; those that need gradients, and the parameters and buffers of modules reached through
globals and closures, are lifted after the module's own (`reached`, found by guards.py).

The program may return anything torch's pytree can flatten, and objects holding tensors that it
cannot (capture/outputs.py): the graph returns the flat tensors, the caller gets eager's types back.

Every node gets `node.meta["fusec"]`: a TensorMeta (shape, dtype, stride, device) or a tuple of
them for ops with several outputs.
"""
from __future__ import annotations

import functools
import inspect
import time
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._decomp as decomp
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

# make_fx imports torch._dynamo and torch._inductor (and, through them, Triton and sympy) the
# first time it traces, and so does the first fake tensor a warm start's fingerprint makes
# (FakeTensorMode() imports torch._dynamo.config): ~1-2 s on a 2-core CPU, paid once per process
# by its first fusec call, not by `import fusec` (issue 52: `import fusec` costs little more than
# torch's own import, so `fusec --help` and a script that only reads fusec are quick).
# tests/test_import.py checks that `import fusec` leaves them unimported.

from fusec import graphmodule
from fusec.capture import decompositions as ours
from fusec.capture import guards
from fusec.capture import outputs
# (`module_state`, `program_device`, `compiling`, ... are also importable from here, where they
# lived before calls.py and tracing.py existed)
from fusec.capture.calls import (argument_containers, check_containers,  # noqa: F401
                                 check_arguments, check_copies, check_devices,
                                 flatten_call, is_cpu_scalar, module_state, program_device,
                                 traced_copies)
from fusec.capture.inplace import mutated_temporaries, out_of_place
from fusec.capture.rnn import RecurrentAsExtern
from fusec.capture.torch_level import torch_level
from fusec.capture.training_family import relate_sizes
from fusec.capture.tracing import (capture_error, autograd_functions_inlined,  # noqa: F401
                                   compiling, dense_attention_masks, python_at_trace_time_refused)
from fusec.capture.tracing import refuse_mixed_dtypes
from fusec.capture.eager_checks import eager_value_checks, refuse_overflowing_scalars
from fusec.errors import DeviceError, GraphBreakError, UnsupportedError
from fusec import symbolic
from fusec.ir import meta_of


@dataclass
class Captured:
    """A captured program: the graph plus what is needed to call it with the user's arguments."""

    gm: fx.GraphModule
    lifted: list[torch.Tensor]  # parameters and buffers, in placeholder order
    lifted_names: list[str]
    input_names: list[str]  # names of the user's tensor arguments (placeholders after lifted)
    out_spec: Any  # pytree spec of the user's outputs
    # flat output index -> flat input index, for outputs that *are* an input (`x.add_(1); return x`):
    # the graph returns the new value, the caller must get its own (now updated) tensor back
    output_aliases: dict = None
    # flat output index -> a non-tensor value the program returns as is (None, a number)
    output_constants: dict = None
    seconds: float = 0.0  # how long capturing took
    # a program for a shape family (fusec/symbolic.py): the ShapeEnv whose symbols its sizes are,
    # and {flat input: dims} that were traced as symbols; None and {} for one input signature
    shape_env: Any = None
    dynamic: dict = None



@functools.lru_cache(maxsize=None)
def decompositions() -> dict:
    """torch's core ATen decomposition table, plus fusec's own (capture/decompositions.py).

    `core_aten_decompositions()` also lists every CompositeImplicitAutograd op, which takes ~0.3 s
    to enumerate; tracing decomposes those ops by itself, so the post-autograd part is all we need.
    """
    if hasattr(decomp, "_core_aten_decompositions_post_autograd"):
        table = dict(decomp._core_aten_decompositions_post_autograd())
    else:
        table = dict(decomp.core_aten_decompositions())
    table.update(ours.table())  # softmax, layer_norm, var ... as reductions + pointwise ops
    return ours.keep_as_extern(table)  # CPU flash attention: eager's kernel, not math attention


def flat_callable(fn: Callable, leaves: list, rebuild: Callable, tensor_pos: list[int],
                  lifted_names: list[str], reached: list = (), derived: dict | None = None) -> Callable:
    """fn as a function of flat tensors: the lifted parameters and buffers first, then the
    caller's tensors (other arguments stay as the caller gave them). Recurrent layers inside
    run as one op each (capture/rnn.py).

    The last `len(reached)` lifted names are state the program reaches through globals and
    closures (capture/guards.py: a closure's `lin`'s weight, a global tensor that needs grad):
    while fn runs, each of those holds its traced tensor where the program finds it."""
    module = fn if isinstance(fn, torch.nn.Module) else None
    n_lifted = len(lifted_names)
    n_own = n_lifted - len(reached)

    def call(*tensors):
        new_leaves = list(leaves)
        for pos, t in zip(tensor_pos, tensors[n_lifted:]):
            new_leaves[pos] = t
        for pos, (of, d) in (derived or {}).items():  # an int that is a size: as a symbol
            new_leaves[pos] = new_leaves[of].shape[d]
        copies = traced_copies(new_leaves)  # (Note: argument objects while tracing, calls.py)
        for pos, copied in copies.items():
            new_leaves[pos] = copied
        call_args, call_kwargs = rebuild(new_leaves)
        containers = argument_containers(call_args, call_kwargs)
        with RecurrentAsExtern(), guards.substituted(reached, tensors[n_own:n_lifted]):
            if module is not None:
                params = dict(zip(lifted_names[:n_own], tensors[:n_own]))
                result = torch.func.functional_call(guards.tree_copy(module), params,
                                                    call_args, call_kwargs)
            else:
                result = fn(*call_args, **call_kwargs)
        check_copies(copies)
        check_containers(containers)
        return result
    return call


def capture(fn: Callable, args: tuple, kwargs: dict | None = None,
            stack_traces: bool = False, same: dict | None = None,
            reached: list = (), dynamic: dict | None = None,
            derived: dict | None = None, relations: tuple | None = None) -> Captured:
    """Trace `fn(*args, **kwargs)` into an annotated ATen graph. See the module docstring.

    stack_traces: also record, on every node, the user's source line that produced it
    (`node.meta["stack_trace"]`; explain and profile show it). Off by default: it costs time.
    same: {i: j} when flat input i (lifted state first, then the caller's tensors) is the very
    tensor j < i, for a program that writes into its inputs (fusec/api.py, "Note: aliased
    inputs"): both positions then trace as one tensor, so functionalization sees a write through
    one as a change of the other, as eager does; input i's placeholder goes unread.
    reached: state the program reaches through globals and closures, lifted after the module's
    own (capture/guards.py: `Guards.reached`).
    dynamic: {flat input index (lifted state first): dims} to trace as symbols, for a program that
    serves every size of those dims (fusec/symbolic.py); its guards are on the ShapeEnv.
    derived: {argument leaf: (tensor leaf, dim)}: int arguments traced as that tensor's size.
    relations: how the caller's tensors' symbolic sizes relate, for a graph handed over with
    symbolic sizes (capture/training_family.py `size_relations`), stated before tracing.
    """
    start = time.perf_counter()
    kwargs = kwargs or {}
    module = fn if isinstance(fn, torch.nn.Module) else None
    leaves, names, rebuild = flatten_call(fn, args, kwargs)
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    check_arguments(leaves, names)
    state = (module_state(module) if module is not None else []) + list(reached)
    lifted_names = [ref.name for ref in state]
    lifted = [ref.get() for ref in state]
    user_tensors = [leaves[i] for i in tensor_pos]
    user_names = [names[i] for i in tensor_pos]
    device = program_device([*lifted, *user_tensors])
    check_devices(user_tensors, user_names, device)

    traced = _anchor(fn) if stack_traces else fn
    call = flat_callable(traced if module is None else module, leaves, rebuild, tensor_pos,
                         lifted_names, reached, derived)
    flat_fn, seen = _flat_outputs(call, same)
    gm = _trace(flat_fn, [*lifted, *user_tensors], module, stack_traces, user_names, dynamic,
                relations)

    lifted_ph = ["p_" + n.replace(".", "_") for n in lifted_names]
    _rename_placeholders(gm, lifted_ph + user_names)
    annotate(gm)
    env = symbolic.name_sizes(gm) if dynamic else None
    if dynamic and env is None:  # tracing pinned every symbol to its size: one signature's
        return capture(fn, args, kwargs, stack_traces, same, reached)  # program, traced as one
    if device.type != "cpu":
        scalars_to_device(gm, device)
    return Captured(gm, lifted, lifted_names, user_names, seen["spec"], dict(seen["aliases"]),
                    dict(seen["constants"]), time.perf_counter() - start, env, dict(dynamic or {}))


def _flat_outputs(call: Callable, same: dict | None) -> tuple[Callable, dict]:
    """`call` as make_fx traces it: flat tensors in, a flat list of tensors out. The dict fills
    in while it runs with what the caller needs to get eager's outputs back: the pytree "spec",
    the "aliases" (outputs that are inputs) and the "constants" (outputs that are not tensors)."""
    seen: dict[str, Any] = {"spec": None, "aliases": {}, "constants": {}}
    aliases: dict[int, int] = seen["aliases"]
    constants: dict[int, Any] = seen["constants"]

    def flat_fn(*tensors):
        if same:  # input i *is* input same[i] (the caller passed one tensor twice): so here too
            tensors = tuple(tensors[same.get(i, i)] for i in range(len(tensors)))
        flat_out, spec = outputs.flatten(call(*tensors))  # ModelOutput, caches ...: outputs.py
        seen["spec"] = spec
        aliases.clear()
        constants.clear()
        for k, o in enumerate(flat_out):
            for i, t in enumerate(tensors):
                if o is t:
                    aliases[k] = i
            if not isinstance(o, torch.Tensor):
                constants[k] = o  # returned as is (a backward graph returns None gradients)
        return [o for k, o in enumerate(flat_out) if k not in constants]
    return flat_fn, seen


def _trace(flat_fn: Callable, example: list[torch.Tensor], module: torch.nn.Module | None,
           stack_traces: bool, user_names: list[str], dynamic: dict | None = None,
           relations: tuple | None = None) -> fx.GraphModule:
    """make_fx of `flat_fn` on fake copies of `example`, functionalized and decomposed; torch's
    internal failures become one clear line, and a program that leaves new tensors on its module's
    attributes is refused (a graph cannot replay that side effect)."""
    # Our own fake mode, with no ShapeEnv: `.item()` or `nonzero` then fail while tracing, at the
    # user's line, instead of becoming symbolic values that no static schedule could run. Tensors
    # the program reaches by itself (a closure's, a global's) become constants of the graph.
    # A program for a shape family traces its dynamic dims as symbols of a ShapeEnv
    # (fusec/symbolic.py): then `.item()` still fails, but sizes compute symbolically.
    mode = symbolic.fake_mode() if dynamic else FakeTensorMode(allow_non_fake_inputs=True)
    attributes = tensor_attributes(module)
    with guards.copies_made() as pairs:  # (the module tree is traced as a copy)
        try:
            fakes = [symbolic.fake_input(mode, t, (dynamic or {}).get(i))
                     for i, t in enumerate(example)]
            if relations and dynamic:  # (the caller's tensors come after the lifted state)
                relate_sizes(fakes[len(fakes) - len(user_names):], relations)
            with torch.no_grad(), mode, python_at_trace_time_refused(), compiling(), \
                    dense_attention_masks(), autograd_functions_inlined(), torch_level(), \
                    eager_value_checks(), graphmodule.lazily():
                gm = make_fx(torch.func.functionalize(flat_fn, remove="mutations"),
                             decomposition_table=decompositions(),
                             record_stack_traces=stack_traces)(*fakes)
                out_of_place(gm)
                if mutated_temporaries(gm):  # (see out_of_place): functionalize the graph itself
                    gm = make_fx(torch.func.functionalize(gm, remove="mutations"),
                                 record_stack_traces=stack_traces)(*fakes)
        except UnsupportedError:
            raise
        except Exception as err:  # translate torch-internal failures into one clear line
            cause = capture_error(err)
            if isinstance(cause, DeviceError):  # name where each input lives
                users = example[len(example) - len(user_names):]
                cause = type(cause)(f"{cause} (inputs: " + ", ".join(
                    f"{name} on {t.device}" for name, t in zip(user_names, users)) + ")")
            raise cause from None
        finally:
            changed = restore_attributes(attributes) + written_attributes(pairs)
    if changed:
        raise GraphBreakError(
            f"fusec: the program assigns module attributes ({', '.join(changed)}) that are "
            "neither parameters nor buffers; a captured graph cannot replay that side effect "
            "(a tensor: register it as a buffer and update it in place, or return it)",
            reason="assigns module attributes that are neither parameters nor buffers")
    return refuse_overflowing_scalars(refuse_mixed_dtypes(gm))


def tensor_attributes(module: torch.nn.Module | None) -> list[tuple]:
    """(submodule, its __dict__ before tracing, the tensors in it): what `restore_attributes`
    checks. Plain tensor attributes (`self.h0 = torch.randn(...)`) are not lifted state."""
    if module is None:
        return []
    return [(sub, dict(vars(sub)), {k for k, v in vars(sub).items() if isinstance(v, torch.Tensor)})
            for sub in module.modules()]


def restore_attributes(saved: list[tuple]) -> list[str]:
    """Undo tensor attributes that tracing assigned (`self.hidden = tanh(...)` in forward leaves
    a fake tensor on the user's module) and name them: eager would have kept the new value, a
    captured graph cannot."""
    changed = []
    for sub, before, tensors in saved:
        now = vars(sub)
        for name in [k for k, v in now.items() if isinstance(v, torch.Tensor)
                     and (k not in before or before[k] is not v)]:
            changed.append(f"{type(sub).__name__}.{name}")
            if name in before:
                now[name] = before[name]
            else:
                del now[name]
        for name in tensors - set(now):  # `del self.h0` during tracing
            changed.append(f"{type(sub).__name__}.{name}")
            now[name] = before[name]
    return changed


def written_attributes(pairs: list[tuple]) -> list[str]:
    """The attributes tracing assigned or deleted on the copies of the module tree it ran
    (capture/guards.py `tree_copy`: the user's modules were not touched), named: tensors, and
    any other value rebound (`self.calls += 1`, `self.cache = {...}`), which eager assigns on
    every call and a captured graph never would. (An equal number or string assigned again is
    no change; the parameter, buffer and child dicts are tree_copy's own.)"""
    changed = []
    for module, copy in pairs:
        before, now = vars(module), vars(copy)
        # (torch's own modules keep caches of their own: a GraphModule's `_lineno_map` ...)
        every = not type(module).__module__.startswith(("torch.", "fusec."))
        for name, value in now.items():
            old = before.get(name, _ABSENT)
            if name in _TREE or value is old or not (every or isinstance(value, torch.Tensor)) \
                    or (isinstance(value, (bool, int, float, str)) and type(value) is type(old)
                        and value == old):
                continue
            changed.append(f"{type(module).__name__}.{name}")
        changed += [f"{type(module).__name__}.{name}" for name in before if name not in now
                    and (every or isinstance(before[name], torch.Tensor))]
    return list(dict.fromkeys(changed))


_ABSENT = object()
_TREE = ("_parameters", "_buffers", "_modules")


def _anchor(fn: Callable) -> Callable:
    """What to call while tracing so that make_fx records the user's source lines.

    make_fx keeps only the stack frames of `forward` methods and of registered "anchor"
    functions: register the user's function (torch 2.13 can; 2.11 cannot), or else call a copy
    of a plain function whose code object is named `forward` (same lines, same globals)."""
    try:
        from torch.fx.proxy import _register_stack_trace_anchor  # torch >= 2.13 only
    except ImportError:
        _register_stack_trace_anchor = None
    if isinstance(fn, torch.nn.Module):
        if _register_stack_trace_anchor is not None:  # helper methods (`self.attn(x)`) too
            for cls in {type(m) for m in fn.modules()}:
                if not cls.__module__.startswith("torch."):
                    for member in vars(cls).values():
                        if inspect.isfunction(member):
                            _register_stack_trace_anchor(member)
        return fn
    if _register_stack_trace_anchor is not None:
        _register_stack_trace_anchor(fn)
        return fn
    if isinstance(fn, types.FunctionType):
        copy = types.FunctionType(fn.__code__.replace(co_name="forward"), fn.__globals__,
                                  fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        return copy
    return fn


def annotate(gm: fx.GraphModule) -> fx.GraphModule:
    """Give every node node.meta["fusec"] from its fake value: a TensorMeta, a ValueMeta for
    what is not a tensor, or a tuple of those for ops with several outputs.

    Note: multi-output externs. Some ops return tensors *and* other values: the CUDA attention
    kernels return `(out, logsumexp, cum_seq_q, cum_seq_k, max_seqlen_q, max_seqlen_k,
    philox_seed, philox_offset, debug_mask)`, with ints, SymInts and None among them, and a graph
    reads only some of them. Every output gets a meta (and every `getitem` of one), so the passes
    can tell each one's kind without asking the op."""
    for node in gm.graph.nodes:
        if node.op != "output" and "val" in node.meta:
            node.meta["fusec"] = meta_of(node.meta["val"])
    return gm


def _rename_placeholders(gm: fx.GraphModule, names: list[str]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        node._rename(name)
        node.target = node.name
    gm.recompile()



def scalars_to_device(gm: fx.GraphModule, device: torch.device) -> None:
    """Move the program's 0-dim CPU tensors to `device`, where its kernels can read them.

    Eager lets `cuda_x * torch.tensor(2.0)` read the CPU scalar as a number; a generated kernel
    can only read memory on its own device. So, in a program whose device is not the CPU:
    - a tensor literal of the program (`torch.tensor(2.0)` in forward: a constant that only
      `lift_fresh_copy` reads) is moved once, now: eager makes it anew on every call anyway;
    - a 0-dim CPU input, buffer or other constant is copied to the device at the start of every
      call (`_to_copy`, one extern step), so the program reads its value of the day;
    - a factory that makes a 0-dim CPU tensor (`torch.full((), 2.0)`) makes it on the device;
    - a CPU input of any size (the indices of `x[idx]` or `index_put`, which eager also takes
      from the CPU) is copied like a 0-dim one. Where an op needs it on the CPU after all, the
      graph does not check out on the device and that is a DeviceError, as before.
    The values then flow on the device; an output eager returns on the CPU is copied back.
    """
    graph = gm.graph
    moved = False
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.device.type != "cpu" or \
                not (is_cpu_scalar(val) or node.op == "placeholder"):
            continue
        literal = node.op == "get_attr" and all(
            u.target is torch.ops.aten.lift_fresh_copy.default for u in node.users)
        if literal:
            setattr(gm, node.target, getattr(gm, node.target).to(device))
        elif node.op in ("placeholder", "get_attr"):
            with graph.inserting_after(node):
                copy = graph.call_function(torch.ops.aten._to_copy.default, (node,),
                                           {"device": device})
            node.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
        elif node.kwargs.get("device") is not None or _factory_on_default_device(node):
            node.kwargs = {**node.kwargs, "device": device}
        else:
            continue
        moved = True
    if not moved:
        return
    was_cpu = [isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
               and a.meta["val"].device.type == "cpu" for a in graph.output_node().args[0]]
    try:
        _propagate(gm)
    except Exception as err:  # noqa: BLE001 (an op that wants its CPU argument on the CPU)
        inputs = [n.name for n in graph.nodes if n.op == "placeholder"
                  and n.meta["val"].device.type == "cpu" and not is_cpu_scalar(n.meta["val"])]
        raise DeviceError(f"fusec: inputs live on different devices ({', '.join(inputs)} on the "
                          f"CPU, the program on {device}), and an op of the program cannot take "
                          f"them on {device} ({type(err).__name__}); move them to one device "
                          "before calling the compiled program") from None
    output = graph.output_node()
    results = list(output.args[0])
    for k, (arg, cpu) in enumerate(zip(results, was_cpu)):
        if cpu and arg.meta["val"].device != torch.device("cpu"):
            with graph.inserting_before(output):
                results[k] = graph.call_function(torch.ops.aten._to_copy.default, (arg,),
                                                 {"device": torch.device("cpu")})
    output.args = (results,)
    _propagate(gm)
    gm.recompile()


def _factory_on_default_device(node: fx.Node) -> bool:
    """A factory that names no device (`aten.scalar_tensor(1.0)` in a backward graph) makes its
    tensor on the CPU."""
    target = node.target
    return (node.op == "call_function" and not node.all_input_nodes
            and isinstance(target, torch._ops.OpOverload)
            and any(a.name == "device" for a in target._schema.arguments)
            and node.kwargs.get("device") is None)


def _propagate(gm: fx.GraphModule) -> None:
    """Recompute every node's fake value (and meta) after the graph changed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    traced = next((n.meta["val"].fake_mode for n in placeholders
                   if getattr(n.meta.get("val"), "fake_mode", None) is not None
                   and n.meta["val"].fake_mode.shape_env is not None), None)
    if traced is not None:  # a shape family's graph: its own fake values, symbols and all
        gm.recompile()
        FakeTensorProp(gm, traced).propagate_dont_convert_inputs(
            *[n.meta["val"] for n in placeholders])
        annotate(gm)
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty_strided(n.meta["val"].shape, n.meta["val"].stride(),
                                      dtype=n.meta["val"].dtype, device=n.meta["val"].device)
                  for n in placeholders]
    gm.recompile()
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    annotate(gm)


