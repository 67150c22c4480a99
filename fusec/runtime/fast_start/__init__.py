"""Fast start: a second process runs a program without capturing or compiling it again.

The first time a process compiles a call, fusec captures it (make_fx under fake tensors), runs
the passes, lowers and renders the kernels and builds them. A second process given the same call
would arrive at the same program, so it skips all of that, and once running it launches each
kernel as cheaply as it can:

    fingerprint  ->  saved program  ->  bound launchers  (+ PDL: launches overlap)

1. **The fingerprint** (fingerprint.py): the call is run once more under fake tensors with a
   torch-function mode that writes down every torch call it makes; the hash of that list, with
   the versions, flags and settings that steer compilation, says "this call would capture the same
   graph", in a few percent of a capture's time. known_results.py hands it back what the fake calls
   that are slow the first time (a CUDA batch norm) returned in an earlier process.
2. **The saved program** (saved.py): after a compile, the program (kernel IRs, their sources, the
   steps, the memory plan) is pickled into the cache under the fingerprint, signed with this user's
   key; a later process with the same fingerprint loads it, binds its steps to kernels from the
   kernel cache, and runs. `FUSEC_SAVED_PROGRAMS=0` turns both off. (fusec/api.py,
   `CompiledFunction._compile`, asks for the fingerprint and loads or saves.)
3. **Bound launchers** (triton_launch.py): after its first launch through Triton's JIT, a Triton
   kernel is called as the compiled kernel with its grid fixed, skipping the JIT's per-call work.
   The Triton backend (codegen/triton/) wraps every kernel module it loads in a `TritonLauncher`.
4. **Programmatic dependent launch** (pdl.py): on sm_90 and newer each Triton kernel waits for the
   one before and lets the next one launch, first thing, so a launch overlaps the end of the kernel
   before it. Decided when a kernel is rendered (codegen/triton/ asks `pdl(arch)`).

Beside the room: codegen/triton/keys.py remembers Triton's own cache key between processes (a
hash of Triton's installation that Triton would otherwise compute in every process).

Nothing is re-exported here: each module is imported by its own name
(`from fusec.runtime.fast_start import saved`, `from fusec.runtime.fast_start.pdl import pdl`).
"""
