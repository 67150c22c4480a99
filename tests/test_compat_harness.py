"""benchmarks/compat.py's verdict: fusec's outputs against eager's and a float64 copy's."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from compat import close  # noqa: E402


def test_no_further_from_float64_than_twice_eager():
    ref = torch.linspace(-1, 1, 100, dtype=torch.float64)
    eager = ref.float() + 1e-6
    assert close([eager], [ref.float() + 1e-6], [ref], 1e-5)[0]
    ok, why = close([eager], [ref.float() + 1e-2], [ref], 1e-5)
    assert not ok and "(float64 reference)" in why


def test_a_float64_copy_that_overflows_leaves_eager_as_the_reference():
    eager = torch.randn(2, 12, 32)
    ref = eager.double()
    ref[0, 0, 0] = float("nan")  # the float64 model's own overflow (CANINE's, in a sweep)
    assert close([eager], [eager + 1e-7], [ref], 1e-5) == (True, "")
    ok, why = close([eager], [eager + 1.0], [ref], 1e-5)
    assert not ok and "eager's output: float64 gave nan/inf" in why


def test_nan_in_eager_itself_is_not_papered_over():
    eager = torch.tensor([1.0, float("nan")])
    ref = eager.double()
    assert not close([eager], [torch.tensor([1.0, 2.0])], [ref], 1e-5)[0]
    assert not close([torch.tensor([1, 2])], [torch.tensor([1, 3])], [None], 0)[0]  # integers: equal
