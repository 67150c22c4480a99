"""Train a model through fusec beside its eager copy and check that every step agrees: the
same loss, the same gradients (None where eager's is None), the same parameters and buffers
after the optimizer's step. The training tests share these checks."""
import torch


def same_step(loss, ref_loss, model, ref, label: str = "") -> None:
    """`loss` (fusec's) and `ref_loss` (eager's) agree, and so do the gradients the backward
    left on `model`'s and `ref`'s parameters (shapes included)."""
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{label} loss: {m}")
    for (name, want), got in zip(ref.named_parameters(), model.parameters()):
        if want.grad is None:
            assert got.grad is None, f"{label} {name}: eager has no gradient, fusec has one"
        else:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{label} {name}: {m}")


def same_state(model, ref, label: str = "") -> None:
    """Every parameter and buffer of `model` equals `ref`'s."""
    for (name, want), got in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{label} {name}: {m}")


def train_alongside(run, model, ref, batches, loss_fn, *, lr=0.1, momentum=0.0, step=True):
    """One step per batch through `run` (fusec's compile of `model`) and eagerly on `ref` (a
    copy of `model`): `loss_fn(run_or_ref, batch)` is backpropagated on both and checked with
    same_step; then SGD steps both (unless step=False) and same_state checks them."""
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in (model, ref)]
    for batch in batches:
        label = str([tuple(t.shape) for t in batch] if isinstance(batch, (tuple, list))
                    else tuple(batch.shape))
        losses = [loss_fn(r, batch) for r in (run, ref)]
        for loss in losses:
            if loss.requires_grad:
                loss.backward()
        same_step(losses[0].detach(), losses[1].detach(), model, ref, label)
        for opt in opts:
            if step:
                opt.step()
            opt.zero_grad(set_to_none=True)
        same_state(model, ref, label)
