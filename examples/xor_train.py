"""Train the classic 2-2-1 XOR network (sigmoid activations, MSE loss, plain SGD) with fusec
compiling forward and backward, side by side with an eager copy: the losses agree to 1e-5 every
1000 epochs until both have learned XOR."""
import copy

import torch

import fusec
from fusec.demo import Example


def make_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sigmoid(), torch.nn.Linear(2, 1),
                               torch.nn.Sigmoid())


def train(epochs: int = 5000, lr: float = 2.0, backend: str = "auto", log_every: int = 1000):
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    y = torch.tensor([[0.0], [1.0], [1.0], [0.0]])
    model = make_model()
    eager = copy.deepcopy(model)
    compiled = fusec.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=lr)
    history = []
    for epoch in range(1, epochs + 1):
        losses = []
        for m, o in ((compiled, opt), (eager, eager_opt)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            losses.append(loss.item())
        if epoch % log_every == 0:
            history.append((epoch, *losses))
            print(f"epoch {epoch:>5}: fusec loss {losses[0]:.6f}   eager loss {losses[1]:.6f}   "
                  f"|diff| {abs(losses[0] - losses[1]):.1e}")
    with torch.no_grad():
        prediction = compiled(x).round().flatten().tolist()
    print(f"predictions {prediction} (want [0, 1, 1, 0]); {len(compiled.kernels)} kernels "
          f"(forward + backward): {', '.join(k.name for k in compiled.kernels)}")
    return history, prediction


def example(device: str = "cpu") -> Example:
    """The CLI's entry point (`fusec explain examples/xor_train.py`): the untrained network on
    the four XOR inputs, for inference. `train()` is the training loop itself."""
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]], device=device)
    return Example("xor_train", make_model().to(device).eval(), (x,),
                   "the XOR network's forward: bias adds and sigmoids fuse around two matmuls")


SMALL = dict()  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    train()
