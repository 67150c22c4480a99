"""Would one GEMV over sibling weights beat one GEMV per weight? (a decode step's q/k/v, gate/up)

    python extensions/quant_gemv/diagnostics/sibling_gemvs.py

In a Llama layer the query, key and value projections read the same normed activation, and so
do the MLP's gate and up projections. fusec runs one GEMV kernel per weight: the narrow key and
value GEMVs (1024 x 4096 at bf16, 8 MB each) are too small to reach the memory's speed on their
own. This script measures the most a horizontal fusion could win, on the step's real shapes
(M = 1, bf16), with each program compiled by fusec (CUDA graphs on, as in decode):

* `per weight`: `F.linear(x, w)` once per weight, as the model is written, with the pass
  extensions/quant_gemv/sibling_gemvs.py taken out of the pipeline: one GEMV kernel per weight;
* `joined`: the same program with fusec's pipeline as it is: one GEMV over the weights, each
  read where it lies;
* `one weight`: `F.linear(x, w_cat)` over the weights concatenated once, ahead of time (what
  gpt-fast does by hand), then split: the floor for `joined`;
and beside them cuBLAS (eager) for both. Prints microseconds and weight bytes per second.
"""
from __future__ import annotations

import os

os.environ["FUSEC_SAVED_PROGRAMS"] = "0"  # a saved program would ignore the pipeline's change

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusec  # noqa: E402
from fusec import passes  # noqa: E402
from fusec.timing import median_ms  # noqa: E402

SETS = {"q/k/v": [4096, 1024, 1024], "gate/up": [11008, 11008], "k/v": [1024, 1024]}
K = 4096


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    for name, widths in SETS.items():
        torch.manual_seed(0)
        ws = [(torch.randn(n, K, device="cuda") / K ** 0.5).to(torch.bfloat16) for n in widths]
        w_cat = torch.cat(ws)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        nbytes = w_cat.numel() * 2

        def separate(v, ws=ws):
            return tuple(F.linear(v, w) for w in ws)

        def one_weight(v, w_cat=w_cat, widths=widths):
            return F.linear(v, w_cat).split(widths, dim=-1)

        print(f"{name} ({' + '.join(str(n) for n in widths)}) x {K}, {nbytes / 1e6:.1f} MB", flush=True)
        for label, fn, registered in (("per weight", separate, [p for p in passes.REGISTERED
                                                                 if p.name != "sibling_gemvs"]),
                                      ("joined", separate, passes.REGISTERED),
                                      ("one weight", one_weight, passes.REGISTERED)):
            default, passes.REGISTERED = passes.REGISTERED, registered
            with torch.no_grad():
                cf = fusec.compile(fn)
                got = cf(x)
                want = fn(x)
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
                us_f = median_ms(cf, x, device="cuda") * 1e3
                us_e = median_ms(fn, x, device="cuda") * 1e3
            passes.REGISTERED = default
            print(f"  {label:10s} fusec {us_f:7.2f} us {nbytes / us_f / 1e6:5.3f} TB/s "
                  f"({len(cf.kernels)} kernels, max diff to cuBLAS {err:.3g}) | cuBLAS {us_e:7.2f} us "
                  f"{nbytes / us_e / 1e6:5.3f} TB/s", flush=True)


if __name__ == "__main__":
    main()
