"""What a Triton kernel becomes on a named NVIDIA GPU, without that GPU.

A learner reading a generated Triton kernel wants to see the machine code it turns into: which
loads became 16-byte vectors, how many registers it needs, whether a layout change goes through
shared memory. A performance engineer wants the same to compare two versions of a kernel between
GPU sessions. Triton's compiler does not need a GPU to compile: its wheel ships the NVIDIA
backend's tools (ptxas, cuobjdump), and `triton.compile` takes a target. So

    fusec.explain(fn, *inputs, backend="triton").assembly(0, target="sm_90")

renders the kernel as it would be rendered for that GPU, compiles it for that architecture and
returns its SASS, with the registers per thread and the spilled bytes on top.

How, in three steps:
  1. The kernel's module is written to a file (Triton reads a kernel's source from its file) and
     run in a child process with TRITON_INTERPRET=0: a process that interprets Triton kernels
     (every process on a machine without a GPU) cannot also compile them.
  2. There, `launch()` is called on empty tensors of the kernel's dtypes, with the kernel itself
     replaced by a recorder, which keeps the arguments it is launched with: the shape constants,
     block sizes, warps and stages the template chose, exactly as a GPU launch would pass them.
  3. Those become Triton's signature (pointers declared 16-byte aligned, as Triton specializes
     them at a launch with freshly allocated tensors), `triton.compile` builds the binary for the
     target, and cuobjdump prints it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from fusec.errors import FusecError

GPU_TARGETS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90}  # A100, A10/3090, L4/4090, H100/H200
DEFAULT = "sm_90"
TIMEOUT_S = 300

TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
         "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8",
         "bool": "i1"}


def arch_of(target: str) -> int:
    """"sm_90" -> 90, or a clear error naming the targets there are."""
    arch = GPU_TARGETS.get(target)
    if arch is None:
        raise FusecError(f"fusec: unknown GPU target {target!r}; choose one of "
                         f"{', '.join(GPU_TARGETS)}")
    return arch


def assembly(ir, name: str, target: str = DEFAULT) -> str:
    """The SASS of the Triton kernel `ir` (a canonical kernel IR) on `target` ("sm_90", ...),
    rendered as fusec renders it for that GPU, with a one-line summary on top."""
    from fusec.codegen import triton as triton_codegen
    arch = arch_of(target)
    from .text import kernel_sizes, traced_sizes
    source = triton_codegen.render(ir, arch=arch)
    traced = traced_sizes(ir)  # a shape family's kernel: compiled for the sizes it was traced at
    done = compile_for(source, name, [str(p.dtype).removeprefix("torch.") for p in ir.params],
                       arch, [traced[s] for s in kernel_sizes(ir)])
    return (f"// {name} on {target} (Triton {done['triton']}): {done['regs']} registers per "
            f"thread, {done['spills']} bytes spilled, {done['instructions']} instructions\n"
            + done["sass"])


def compile_for(source: str, name: str, dtypes: list[str], arch: int, sizes=()) -> dict:
    """Compile kernel `name` of the module `source` for sm_<arch> in a child process; returns
    {"sass", "ptx", "regs", "spills", "instructions", "triton"}. `dtypes` are its tensors',
    `sizes` the values of its size arguments (a kernel of a shape family: fusec/symbolic.py)."""
    with tempfile.TemporaryDirectory(prefix="fusec-target-") as tmp:
        path = Path(tmp) / f"{name}.py"
        path.write_text(source)
        job = json.dumps(dict(path=str(path), name=name, dtypes=dtypes, arch=arch,
                              sizes=list(sizes)))
        env = dict(os.environ, TRITON_INTERPRET="0")  # "0": fusec would switch it on without a GPU
        try:
            done = subprocess.run([sys.executable, "-m", "fusec.codegen.triton.target"],
                                  input=job, capture_output=True, text=True, env=env,
                                  timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FusecError(f"fusec: compiling {name} for sm_{arch} took over {TIMEOUT_S} s")
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        raise FusecError(f"fusec: compiling {name} for sm_{arch} failed: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class _Recorder:
    """Stands in for the kernel in its module: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self):
        self.call = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.call = (args, kwargs)
        return launch


def _signature(fn, args, kwargs) -> tuple[dict, dict, dict, list]:
    """Triton's (signature, constexprs, options, pointer positions) for the launch recorded."""
    import torch
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg",
                                          "enable_fp_fusion", "launch_pdl") if k in kwargs}
    given = dict(zip([p.name for p in fn.params], args)) | kwargs
    signature, constants, pointers = {}, {}, []
    for i, p in enumerate(fn.params):
        value = given.get(p.name)
        if p.is_constexpr:
            signature[p.name], constants[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + TYPES[str(value.dtype).removeprefix("torch.")]
            pointers.append(i)
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[p.name] = "fp32"
        else:
            signature[p.name], constants[p.name] = "constexpr", value
    return signature, constants, options, pointers


def cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's output (`flag`: -sass, -res-usage) for a cubin, with the tool Triton ships."""
    import triton
    try:
        from triton import knobs
        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001 (a Triton without knobs: its bundled tool)
        tool = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def _child() -> None:
    """The child process: a job (JSON) on stdin, the compiled kernel (JSON) on stdout."""
    import importlib.util

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    job = json.loads(sys.stdin.read())
    spec = importlib.util.spec_from_file_location(job["name"], job["path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn, recorder = getattr(module, job["name"]), _Recorder()
    # a launch may start two kernels (a kernel family's split-K `<name>` and `<name>_finish`):
    # both are stood in for, and the one asked for records its call
    for attr in [a for a in vars(module) if a.startswith(job["name"].removesuffix("_finish"))]:
        if isinstance(getattr(module, attr), triton.runtime.JITFunction):
            setattr(module, attr, recorder if attr == job["name"] else _Recorder())
    module.launch(*[torch.empty(64, dtype=getattr(torch, d)) for d in job["dtypes"]],
                  *job.get("sizes", ()))
    if recorder.call is None:
        raise SystemExit(f"launch() did not launch {job['name']}")
    signature, constants, options, pointers = _signature(fn, *recorder.call)
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants,
                                       attrs={(i,): [["tt.divisibility", 16]] for i in pointers})
    compiled = triton.compile(source, target=GPUTarget("cuda", job["arch"], 32), options=options)
    cubin = compiled.asm["cubin"]
    # one instruction per line, without the encodings cuobjdump prints beside and under each
    sass = "\n".join(line.rstrip() for line in
                     re.sub(r"\s*/\* 0x[0-9a-f]{16} \*/", "", cuobjdump(cubin, "-sass")).splitlines()
                     if line.strip())
    usage = cuobjdump(cubin, "-res-usage")
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    print(json.dumps(dict(
        sass=sass, ptx=compiled.asm["ptx"], triton=triton.__version__,
        regs=int(regs.group(1)) if regs else 0, spills=int(stack.group(1)) if stack else 0,
        instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[@A-Z]", sass)))))


if __name__ == "__main__":
    _child()
