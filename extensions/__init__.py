"""fusec's extensions: code outside the core that plugs into it through a door the core defines.

`quant_gemv/` is the quantized-GEMV kernel family (codegen/families.py is its door) and its
graph rewrites (passes.register). The core never imports anything here by name
(tests/test_architecture.py): fusec/__init__.py imports each folder's `plugin.py`, which
registers what the extension brings by name, and its code loads when first asked.
"""
