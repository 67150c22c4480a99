python -m pip install --no-deps --no-build-isolation -q -e . > /dev/null 2>&1
timeout 120 python fp_cost.py mobilenet_v3_large 2>&1 | grep -v Warn | cut -c1-200
