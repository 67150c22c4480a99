"""fusec's extensions: code outside the core that plugs into it through a door the core defines.

`quant_gemv/` is the quantized-GEMV kernel family (codegen/families.py is its door). The core
never imports anything here (tests/test_architecture.py); fusec/__init__.py registers each
extension by name, and its code loads when first asked.
"""
