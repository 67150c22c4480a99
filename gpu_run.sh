#!/bin/bash
python -m pip install --no-deps --no-build-isolation -q -e . > /dev/null 2>&1
python -m pip install --no-deps -q .wheels/expecttest-*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/env.txt
S=$(date +%s)
timeout 150 python -m pytest -q -p no:cacheprovider -x tests/test_int4_words.py tests/test_small_matmul.py tests/test_saved_programs.py -k "triton or cuda or saved or int4 or tritons" > $OUT/tests.txt 2>&1
echo "tests $(( $(date +%s) - S )) s" >> $OUT/env.txt; S=$(date +%s)
timeout 60 python benchmarks/quant_linear.py --m 1,4,16 --int4-paths --no-compile > $OUT/quant.txt 2>&1
timeout 60 python benchmarks/diagnostics/int4_words_variants.py > $OUT/variants.txt 2>&1
echo "quant $(( $(date +%s) - S )) s" >> $OUT/env.txt; S=$(date +%s)
timeout 200 python benchmarks/compile_time.py --models bert_base,vit_base,t5_encoder,resnet50,mobilenet_v3,efficientnet_b0 --systems fusec --timeout 60 > $OUT/ct.txt 2>&1
echo "ct $(( $(date +%s) - S )) s" >> $OUT/env.txt; S=$(date +%s)
timeout 120 python benchmarks/decode.py --layers 4 --formats int4,int8 --systems reduce-overhead,fusec > $OUT/decode.txt 2>&1
echo "decode $(( $(date +%s) - S )) s" >> $OUT/env.txt
