"""What a CPU training step spends around its kernels (issue 54, docs/training.md "Where a step's
time goes"): an embedding's backward adds into a fill it owns (passes/reinplace.py
`fresh_fill`), products' results are not settled (writer.py, Note (results that need no
settling)), and an LLVM kernel that runs on the calling thread is called as its C function
(writer.py `_serial_entry`). Each model trains beside its eager copy: the same losses,
gradients, parameters and buffers after every step."""
import pytest
import torch

import fusec
from conftest import CPU_BACKENDS
from fusec.record import record_of
from train_check import train_alongside


class Tagger(torch.nn.Module):
    """Two embeddings (one tied to the output layer, as BERT's word embedding is), a linear layer
    with layer norm, batch norm over the features (running statistics), cross-entropy."""

    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.words = torch.nn.Embedding(vocab, width)
        self.places = torch.nn.Embedding(8, width)
        self.mix = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.out = torch.nn.Linear(width, vocab)
        self.out.weight = self.words.weight

    def forward(self, ids, labels):
        h = self.words(ids) + self.places(torch.arange(ids.shape[1]))
        h = self.norm(torch.nn.functional.gelu(self.mix(h)))
        h = self.bn(h.flatten(0, 1))
        return torch.nn.functional.cross_entropy(self.out(h), labels.flatten())


def batches(n=3, vocab=32):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (2, 8), generator=gen),
             torch.randint(0, vocab, (2, 8), generator=gen)) for _ in range(n)]


def trained(backend):
    torch.manual_seed(0)
    model = Tagger()
    ref = Tagger()
    ref.load_state_dict(model.state_dict())
    run = fusec.compile(model, backend=backend)
    train_alongside(run, model, ref, batches(), lambda m, b: m(*b))
    return run, model, ref


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_tagger_trains_as_eager(backend):
    run, model, ref = trained(backend)
    assert model.bn.num_batches_tracked.item() == 3
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_embedding_backward_adds_into_its_own_zeros(backend):
    """The backward's `index_put(full, ...)` became `index_put_`: the fill is the table's own."""
    run, _, _ = trained(backend)
    backward = run._compiled.train_parts[1].last
    kept = record_of(backward.gm).reinplace
    assert any(r.in_place and "fill made for it alone" in r.why for r in kept), kept
    source = backward.program.run.source
    assert "index_put_" in source and "index_put_default" not in source.replace(
        "index_put__default", "")


def test_products_unsettled_and_llvm_kernels_called_directly():
    """mm/addmm results are used as ATen returns them (row-major, planned so), and every LLVM
    kernel of these small programs is called as its C function with its range of work."""
    run, _, _ = trained("llvm")
    for part in run._compiled.train_parts:
        source = part.last.program.run.source
        calls = [line for line in source.splitlines() if "_aten_mm_default" in line
                 or "_aten_addmm_default" in line]
        assert calls and not any("_settle(" in line for line in calls), calls
        kernels = [line for line in source.splitlines() if line.strip().startswith("_fused")]
        assert kernels and all("data_ptr(), 0, " in line for line in kernels), kernels


def test_serial_entry_only_for_serial_fixed_size_kernels():
    from fusec.runtime.writer import _serial_entry

    class Fake:
        n_sizes, parallel, work = 0, False, 7

        def fn(self):
            pass
    assert _serial_entry(Fake())[1] == 7
    threaded, sized = Fake(), Fake()
    threaded.parallel, sized.n_sizes = True, 1
    assert _serial_entry(threaded) is None and _serial_entry(sized) is None
    assert _serial_entry(object()) is None  # a C++ or Triton launcher: not this path
