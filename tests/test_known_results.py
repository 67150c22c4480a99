"""Known results (fusec/runtime/fast_start/known_results.py): a fingerprint remembers what slow
fake calls (batch norm, convolutions, activations) returned, in the cache, and a later process is handed
that result instead of running the call. The fingerprint's text must not change by a character,
and calls that return an argument, or that the table cannot describe, must still run.

A "later process" here is a fresh table read from the same cache file (the process-wide tables
are cleared), and once a real subprocess.
"""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusec.runtime.fast_start import known_results
from fusec.runtime.fast_start.fingerprint import environment, trace_text

from conftest import TRITON_DEVICE

DEVICES = ["cpu"] + (["cuda"] if TRITON_DEVICE == "cuda" else [])


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    known_results._TABLES.clear()
    yield
    known_results._TABLES.clear()


class ConvNet(torch.nn.Module):
    """Conv, batch norm and the activations of MobileNet-like networks, in both layouts."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.dw = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
        self.bn2 = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        h = F.hardswish(self.bn(self.conv(x)))
        h = F.relu(self.bn2(self.dw(h)), inplace=True)  # in place: returns its argument
        s = F.hardsigmoid(F.adaptive_avg_pool2d(h, 1))
        return F.silu(h * s)


def later_process() -> None:
    """Forget the tables this process holds: the next fingerprint reads the file, as a new
    process would."""
    known_results._TABLES.clear()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_fingerprint_is_the_same_with_known_results(device, layout):
    model = ConvNet().to(device).eval()
    x = torch.randn(2, 3, 17, 13, device=device)
    if layout == "channels_last":
        model, x = model.to(memory_format=torch.channels_last), \
            x.to(memory_format=torch.channels_last)
    first = trace_text(model, (x,), {}, "cpp")
    assert first is not None
    table = known_results.known(environment("cpp"))
    assert table.hits == 0 and table.path.exists()
    # conv x2, batch norm x2, hardswish, adaptive pool, hardsigmoid, silu; not the in-place relu
    assert len(table.table) == 8, list(table.table)
    assert not any("relu" in key for key in table.table)

    later_process()
    second = trace_text(model, (x,), {}, "cpp")
    again = known_results.known(environment("cpp"))
    assert again is not table and again.hits == 8
    assert second == first  # not a character changed


def test_a_remembered_result_is_exactly_what_the_call_returned():
    """Each entry replays as a tensor of the shape, strides, dtype and device the call gave,
    including odd ones: a permuted input, a stride-2 slice, a size-1 dimension, half precision."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    table = known_results.known("test environment")
    with FakeTensorMode():
        cases = [
            (torch.conv2d, (torch.empty(1, 4, 9, 7).permute(0, 1, 3, 2), torch.empty(6, 4, 3, 3)),
             {}),
            (F.batch_norm, (torch.empty(3, 5, 8)[:, :, ::2], torch.empty(5), torch.empty(5)),
             {"training": False}),
            (F.gelu, (torch.empty(1, 7, 1, dtype=torch.float16).transpose(0, 2),), {}),
        ]
        for func, args, kwargs in cases:
            want = table.call(func, args, kwargs)
            got = table.call(func, args, kwargs)  # from the table now
            assert got is not want
            assert (got.shape, got.stride(), got.dtype, got.device) == \
                (want.shape, want.stride(), want.dtype, want.device)
    assert table.hits == len(cases)


def test_calls_the_table_cannot_describe_run_every_time():
    from torch._subclasses.fake_tensor import FakeTensorMode

    table = known_results.known("test environment")
    with FakeTensorMode():
        x = torch.empty(4, 6)
        assert table.call(F.relu, (x,), {"inplace": True}) is x  # returns its argument
        assert table.call(F.relu, (x, True), {}) is x
        table.call(torch.add, (x, x), {})  # not a function the table knows
        table.call(F.gelu, (torch.empty(4, 6, requires_grad=True),), {})  # autograd: not written
    assert table.table == {} and table.hits == 0
    real = torch.randn(3, 3)  # a real tensor (a closure's, say) is not fake: never remembered
    table.call(F.relu, (real,), {})
    assert table.table == {}


def test_a_damaged_table_is_read_as_empty(tmp_path):
    model, x = ConvNet().eval(), torch.randn(2, 3, 8, 8)
    first = trace_text(model, (x,), {}, "cpp")
    path = known_results.known(environment("cpp")).path
    path.write_text('{"torch.conv2d(broken": [1, 2')  # cut short
    later_process()
    assert trace_text(model, (x,), {}, "cpp") == first
    assert known_results.known(environment("cpp")).hits == 0
    assert len(known_results._read(path)) == 8  # written again, whole


def test_an_entry_that_describes_no_tensor_is_run_again():
    from torch._subclasses.fake_tensor import FakeTensorMode

    table = known_results.known("test environment")
    with FakeTensorMode():
        x = torch.empty(2, 5)
        want = table.call(F.gelu, (x,), {})
        [key] = table.table
        for damaged in ([[2, 5], [5, 1], "Tensor", "cpu"], [[2, 5]], "x", [[2, 5], [5, 1], 3, "cpu"]):
            table.table[key] = damaged
            got = table.call(F.gelu, (x,), {})
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
            assert table.table[key] == [[2, 5], [5, 1], "float32", "cpu"]  # written again
    assert table.hits == 0


def test_a_new_process_is_handed_the_known_results(tmp_path):
    """A real second process: same fingerprint, answered from the file."""
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from test_known_results import ConvNet
        from fusec.runtime.fast_start import known_results
        from fusec.runtime.fast_start.fingerprint import environment, fingerprint
        torch.manual_seed(0)
        print(fingerprint(ConvNet().eval(), (torch.randn(2, 3, 9, 9),), {}, "cpp"),
              known_results.known(environment("cpp")).hits)
    """)
    env = {**os.environ, "FUSEC_CACHE_DIR": str(tmp_path / "shared")}
    here = os.path.dirname(__file__)
    runs = [subprocess.run([sys.executable, "-c", code, here], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    (key1, hits1), (key2, hits2) = (r.stdout.split() for r in runs)
    assert key1 == key2 and key1 != "None"
    assert hits1 == "0" and hits2 == "8"


def test_the_switches_that_steer_a_call_are_part_of_its_key():
    """Autocast and the convolution libraries (on or off) can change what a call returns: a
    call made under other switches is not answered from the table."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    table = known_results.known("test environment")
    with FakeTensorMode():
        x, w = torch.empty(2, 3, 8, 8), torch.empty(4, 3, 3, 3)
        plain = table.call(torch.conv2d, (x, w), {})
        with warnings.catch_warnings():  # (flags() also sets oneDNN's TF32, and says so)
            warnings.simplefilter("ignore", UserWarning)
            with torch.backends.mkldnn.flags(enabled=False):
                table.call(torch.conv2d, (x, w), {})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = table.call(torch.conv2d, (x, w), {})
    assert table.hits == 0 and len(table.table) == 3
    assert plain.dtype == torch.float32 and cast.dtype == torch.bfloat16
