"""CPU kernels on several threads, in a process of their own.

The suite's other tests run under pytest-xdist with one thread per worker (conftest.py: two
workers of two threads each on a 2-core machine made every thread pool wait for a core). So a
kernel's parallel loop (the C++ backend's `#pragma omp parallel for`, the LLVM backend's parts
handed to OpenMP) would run on one thread there, and a wrong split (a row block counted twice, a
chunk left out, partial sums combined wrongly) would pass. Here a fresh Python runs programs whose
kernels have work enough for all threads (codegen/cpu_plan.py's PARALLEL_WORK) with three
threads (more than this machine's cores, and a count that splits no size below evenly), and
compares them with eager: pointwise, broadcast and strided inputs, row reductions, a column
reduction, a softmax and a layer norm (and a whole-tensor sum), on both CPU backends.
"""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import torch, fusec
    from fusec.codegen.cpu_plan import thread_choice
    torch.set_num_threads(3)  # (torch caps its OMP_NUM_THREADS at the cores; the kernels' runtime does not)
    torch.manual_seed(0)
    backend = {backend!r}
    x = torch.randn(1031, 523)
    cases = [
        ("pointwise", lambda a: torch.exp(a) * 2 - a, (x,)),
        ("broadcast", lambda a, b: torch.sigmoid(a + b), (x, torch.randn(523))),
        ("strided", lambda a: torch.tanh(a) * a, (torch.randn(523, 1031).t(),)),
        ("int", lambda a: (a * 3) // 2 + 1, (torch.randint(-99, 99, (1031, 523)),)),
        ("rows", lambda a: a.sum(-1) + a.amax(-1), (x,)),
        ("columns", lambda a: a.sum(0), (x,)),
        ("softmax", lambda a: torch.softmax(a, -1), (x,)),
        ("layer norm", lambda a: torch.nn.functional.layer_norm(a, (523,)), (x,)),
    ]
    for name, fn, args in cases:
        cf = fusec.compile(fn, backend=backend)
        with torch.no_grad():
            got, want = cf(*args), fn(*args)
        exact = not want.is_floating_point()
        torch.testing.assert_close(got, want, rtol=0 if exact else 1e-4,
                                   atol=0 if exact else 1e-4, msg=name)
        assert any(thread_choice(k.ir)[0] for k in cf.kernels), (name, "no kernel on all threads")
    whole = fusec.compile(lambda a: (a * a).sum(), backend=backend)  # (one row: however it splits)
    torch.testing.assert_close(whole(x), (x * x).sum(), rtol=1e-4, atol=1e-3)
    print("ok", len(cases))
''')


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_kernels_on_three_threads_match_eager(backend):
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(backend=backend)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", "8"], out.stdout
