#!/bin/bash
python -m pip install --no-deps --no-build-isolation -q -e . > /dev/null 2>&1
python -m pip install --no-deps -q .wheels/expecttest-*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/env.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt
S=$(date +%s)
timeout 280 python benchmarks/compile_time.py --models bert_base,vit_base,t5_encoder,resnet50,mobilenet_v3,efficientnet_b0 --systems fusec --timeout 60 > $OUT/ct.txt 2>&1
echo "ct $(( $(date +%s) - S )) s" >> $OUT/env.txt; S=$(date +%s)
timeout 100 python -m pytest -q -p no:cacheprovider tests/test_saved_programs.py tests/test_cache.py > $OUT/tests.txt 2>&1
echo "tests $(( $(date +%s) - S )) s" >> $OUT/env.txt
