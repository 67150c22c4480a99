"""passes/picks.py: a gather from one row (source and index of size 1 along every dim but the
picked one) is an index_select that kernels read in place, and passes/check_gathers.py checks an
index once when another gather reads a view of it (BERT's token types, gathered by position ids
that an embedding also reads). Eager's answers over odd sizes, several dtypes and dims, eager's
error for a position out of range, and the BERT-like embeddings with no gather call left."""
import pytest
import torch

import fusec
from train_check import train_alongside

aten = torch.ops.aten


def _calls(cf, name: str) -> list[str]:
    run = cf.source().split("def run(inputs):", 1)[1].split("\ndef ", 1)[0]
    return [line for line in run.splitlines() if name in line]


CASES = {  # name: (source shape, dim, index shape)
    "a row, dim 1": ((1, 13), 1, (1, 7)),
    "a column, dim 0": ((11, 1), 0, (5, 1)),
    "three dims, the middle": ((1, 9, 1), 1, (1, 17, 1)),
    "negative dim": ((1, 1, 6), -1, (1, 1, 4)),
    "one dim": ((10,), 0, (23,)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_a_gather_from_one_row(backend, case, dtype):
    shape, dim, index_shape = CASES[case]
    torch.manual_seed(0)
    x = (torch.randn(shape) * 100).to(dtype)
    size = shape[dim]
    index = torch.randint(0, size, index_shape)

    def fn(x, index):
        return torch.gather(x * 2, dim, index) + 1

    cf = fusec.compile(fn, backend=backend)
    torch.testing.assert_close(cf(x, index), fn(x, index))
    assert not _calls(cf, "_aten_gather"), cf.source()


def test_a_position_out_of_range_raises_as_eager():
    x, index = torch.randn(1, 8), torch.tensor([[1, 8, 2]])
    with pytest.raises(RuntimeError):
        torch.gather(x, 1, index)
    with pytest.raises(RuntimeError, match="out of range"):
        fusec.compile(lambda x, i: torch.gather(x, 1, i), backend="cpp")(x, index)
    with pytest.raises(RuntimeError, match="out of range"):  # gather refuses negative positions
        fusec.compile(lambda x, i: torch.gather(x, 1, i), backend="cpp")(x, -index)


def test_several_rows_stay_a_gather():
    x, index = torch.randn(3, 8), torch.randint(0, 8, (3, 5))
    fn = lambda x, i: torch.gather(x, 1, i) * 3  # noqa: E731
    cf = fusec.compile(fn, backend="cpp")
    torch.testing.assert_close(cf(x, index), fn(x, index))


class Embeddings(torch.nn.Module):
    """BERT's embeddings: words, token types gathered from a buffer by the position ids, and
    positions, summed and normalized, at odd sizes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.words = torch.nn.Embedding(37, 24)
        self.types = torch.nn.Embedding(3, 24)
        self.positions = torch.nn.Embedding(19, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.register_buffer("position_ids", torch.arange(19).view(1, -1))
        self.register_buffer("token_type_ids", torch.tensor([[0] * 9 + [1] * 8 + [2] * 2]))

    def forward(self, ids):
        n = ids.shape[1]
        positions = self.position_ids[:, :n]
        types = torch.gather(self.token_type_ids.expand(1, -1), 1, positions)
        types = types.expand(ids.shape[0], n)
        h = self.words(ids) + self.types(types) + self.positions(positions)
        return self.norm(h).square().mean()


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_bert_like_embeddings_train_with_no_gather_call(backend):
    model, ref = Embeddings(), Embeddings()
    ids = torch.randint(0, 37, (3, 17))
    compiled = fusec.compile(model, backend=backend)
    train_alongside(compiled, model, ref, [ids, ids], lambda m, x: m(x), step=False)
    forward = compiled._compiled.train_parts[0]
    assert not _calls(forward, "_aten_gather"), forward.source()
    # the position ids are checked once, though two gathers read them (one through a view)
    checks = [k.name for k in forward.last.kernels if k.name.startswith("fused_ge_lt")]
    assert len(checks) <= 2, checks
