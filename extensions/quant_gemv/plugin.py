"""What the quantized-GEMV extension brings to the core, registered through the core's doors.

fusec/__init__.py imports the `plugin.py` of every folder of extensions/ when the core's
registries are first imported (the first compile, or an import of fusec.passes); this one registers, by name (nothing here imports the rest of the folder):

* the kernel family (codegen/families.py): its door, family.py, loads when a backend first
  offers it a kernel that computes a matmul as a sum (`ReductionKernel.matmul`);
* its graph rewrites (passes/__init__.py, `register`), just before the core's pad_matmul:
  matmuls that read one activation row joined over their weights (sibling_gemvs.py), then
  small-M matmuls with a computed weight written as sums over K (small_matmul.py). Both rewrite
  only mm and addmm, so a graph without one never imports them.
"""
from __future__ import annotations

import torch

from fusec import passes
from fusec.codegen import families

aten = torch.ops.aten

families.register(families.Family("quantized GEMV", "fusec.extensions.quant_gemv.family",
                                  ("triton", "cpp"), wants=families.has("matmul")))

for name in ("sibling_gemvs", "small_matmul"):
    passes.register(passes.ExtensionPass(name, f"fusec.extensions.quant_gemv.{name}",
                                         before="pad_matmul",
                                         looks_for=frozenset({aten.mm.default, aten.addmm.default})))
