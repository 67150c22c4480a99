#!/usr/bin/env bash
# Everything fusec checks on a GPU, in one device call: install, Triton tests on CUDA (several
# pytest processes side by side: Triton compiles are single-threaded), then the benchmarks.
# Results land in $OUT (the device tool fetches them); docs/performance.md holds the current tables.
# SKIP_TESTS, SKIP_POINTWISE, SKIP_MODELS, SKIP_GRAPHS, SKIP_QUANT, SKIP_DECODE leave a part out;
# PROFILE=1 adds a profile.
set -uo pipefail
OUT=${OUT:-/tmp/fusec-gpu}; mkdir -p "$OUT"
python -m pip install --no-deps --no-build-isolation -q -e . > "$OUT/install.log" 2>&1 || exit 1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/versions.txt"
export PYTHONUNBUFFERED=1
groups=("tests/test_ops.py extensions/quant_gemv/tests/test_small_matmul.py tests/test_constant_gathers.py tests/test_layout.py tests/test_cat.py extensions/quant_gemv/tests/test_sibling_gemvs.py extensions/quant_gemv/tests/test_refine_views.py tests/test_computed_pieces.py tests/test_indexed_write.py tests/test_triton_pdl.py tests/test_llama_fit.py" "tests/test_reductions.py tests/test_online_softmax.py tests/test_build.py tests/test_split_reductions.py tests/test_pooling.py tests/test_known_results.py tests/test_saved_programs.py tests/test_cache.py extensions/quant_gemv/tests/test_int4_words.py extensions/quant_gemv/tests/test_int4_mma.py tests/test_triton_target.py"
        "tests/test_graph_breaks.py tests/models tests/test_kernelbench.py tests/test_externs.py tests/test_check_gathers.py"
        "tests/test_views.py tests/test_smoke.py tests/test_schedule.py tests/test_examples.py tests/test_triton_launch.py tests/test_tiled_pointwise.py tests/test_unfuse_bias.py tests/test_inplace.py"
        "tests/test_training.py tests/test_api.py tests/test_cuda_graphs.py tests/test_explain.py tests/test_profile.py tests/test_runtime_fastpath.py tests/test_wrapper.py tests/test_memory_plan.py"
        "tests/test_fuse_pointwise.py tests/test_dce.py tests/test_cse.py tests/test_property.py tests/test_property_reductions.py tests/test_autograd_functions.py tests/test_opinfo.py tests/test_families.py tests/test_extending.py")
i=0
[ -n "${SKIP_TESTS:-}" ] && groups=()
for g in "${groups[@]}"; do
  files=$(for f in $g; do [ -e "$f" ] && echo "$f"; done)
  timeout "${TEST_TIMEOUT:-450}" python -m pytest -q -n 0 -k "triton or cuda" -p no:cacheprovider $files > "$OUT/tests_$i.log" 2>&1 &
  i=$((i+1))
done
wait
if [ -z "${SKIP_TESTS:-}" ]; then  # one log (the device tool returns at most 8 files)
  tail -n 3 "$OUT"/tests_*.log; tail -n +1 "$OUT"/tests_*.log > "$OUT/tests.log"; rm "$OUT"/tests_*.log
fi
rm -f "$OUT/install.log"
[ -n "${SKIP_POINTWISE:-}" ] || timeout 200 python benchmarks/pointwise.py --json "$OUT/pointwise.json" 2>&1 | tail -6
[ -n "${SKIP_MODELS:-}" ] || timeout "${BENCH_TIMEOUT:-240}" python benchmarks/models.py --json "$OUT/models.json" 2>&1 | tail -12
[ -n "${SKIP_GRAPHS:-}" ] || timeout "${GRAPHS_TIMEOUT:-300}" python benchmarks/cuda_graphs.py --json "$OUT/cuda_graphs.json" > "$OUT/cuda_graphs.txt" 2>&1; tail -17 "$OUT/cuda_graphs.txt"
[ -n "${PROFILE:-}" ] && timeout 150 python -m fusec.cli profile gpt2_block --device cuda --iters 5 > "$OUT/profile_gpt2.txt" 2>&1
[ -n "${SKIP_QUANT:-}" ] || timeout "${QUANT_TIMEOUT:-240}" python benchmarks/quant_linear.py --sweep --int4-paths --in-a-row 8 --json "$OUT/quant_linear.json" 2>&1 | grep -v -i warn | tail -40
[ -n "${SKIP_DECODE:-}" ] || timeout "${DECODE_TIMEOUT:-400}" python benchmarks/decode.py --layers 2 --json "$OUT/decode.json" 2>&1 | tail -18
