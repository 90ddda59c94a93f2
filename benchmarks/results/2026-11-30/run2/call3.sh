#!/bin/bash
R=/tmp/res; mkdir -p $R
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  local t0=$(date +%s) D=/tmp/g0
  python3 benchmarks/targets/train_target.py --preset small --corpus .data/corpus --tokenizer .data/tokenizer \
      --out $D/small --steps 434 > $R/train0.log 2>&1
  echo "train done at $(( $(date +%s) - t0 )) s" >> $R/pipeline.log
  python3 -m specla.cli train-drafter --model $D/small --data .data/corpus/*.xz --out $D/eagle \
      --steps 1500 --batch-windows 32 --window 128 --max-tokens 400000 --distill-prompts 256 --ce-weight 1.0 \
      --device cuda 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" > $R/drafter0.log
  echo "drafter done at $(( $(date +%s) - t0 )) s" >> $R/pipeline.log
  python3 benchmarks/acceptance.py --model $D/small --drafter $D/eagle --prompts .data/prompts \
      --out $R/acceptance-ref.json --time-per-run 3 --batch-size 32 --max-new-tokens 128 \
      --runs mixed/eagle-tree/reference,mixed/eagle-chain/reference,mixed/ngram/reference,gsm8k/eagle-tree/t0.7/reference,mixed/eagle-tree/t0.7/reference,gsm8k/eagle-tree/t1.0/reference,mixed/eagle-tree/t1.0/reference,gsm8k/eagle-chain/reference,gsm8k/ngram/reference,humaneval/eagle-tree/reference,humaneval/ngram/reference \
      2>&1 | tr '\r' '\n' | grep -v "batch/s\]$" > $R/acceptance-ref.log
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1 TRITON_INTERPRET=0
  timeout 150 python3 -m pytest -v -x tests/test_gdn_kernels.py -k "13b_layer_shape_bf16 and parallel" \
      -p no:cacheprovider -o faulthandler_timeout=120 --durations=5 > $R/hang-test.log 2>&1
  timeout 300 python3 .runs/e2e_probe.py $R > $R/e2e-probe.log 2>&1
  timeout 200 python3 -m pytest -v tests/test_gpu.py tests/test_gla.py tests/test_mamba2.py tests/test_ops_conv.py \
      -k "gpu or cuda or 13b or beyond or kernel or flush" -p no:cacheprovider --durations=10 > $R/gpu-tests2.log 2>&1
}
gpu0 & gpu1 & wait
