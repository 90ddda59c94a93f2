#!/bin/bash
# GPU call 2 (nvidia-h200-x2): both GPUs rebuild the small target and its drafter by the same recipe,
# then split the acceptance runs; GPU1 also finishes the GPU tests while it trains.
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpus.txt 2>&1
pipeline() {  # $1 = GPU index, $2 = runs
  export CUDA_VISIBLE_DEVICES=$1
  local t0=$(date +%s) D=/tmp/g$1
  python3 benchmarks/targets/train_target.py --preset small --corpus .data/corpus --tokenizer .data/tokenizer \
      --out $D/small --steps 434 > $R/train$1.log 2>&1
  cp $D/small/training.json $R/small-training$1.json 2>/dev/null
  echo "gpu$1 train done at $(( $(date +%s) - t0 )) s" >> $R/pipeline.log
  python3 -m specla.cli train-drafter --model $D/small --data .data/corpus/*.xz --out $D/eagle \
      --steps 1500 --batch-windows 32 --window 128 --max-tokens 400000 --distill-prompts 256 --ce-weight 1.0 \
      --device cuda 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" > $R/drafter$1.log
  cp $D/eagle/training.json $R/drafter-training$1.json 2>/dev/null
  echo "gpu$1 drafter done at $(( $(date +%s) - t0 )) s" >> $R/pipeline.log
  python3 benchmarks/acceptance.py --model $D/small --drafter $D/eagle --prompts .data/prompts \
      --out $R/acceptance$1.json --time-per-run 5 --batch-size 32 --max-new-tokens 128 --runs $2 \
      2>&1 | tr '\r' '\n' | grep -v "batch/s\]$" > $R/acceptance$1.log
  echo "gpu$1 acceptance done at $(( $(date +%s) - t0 )) s" >> $R/pipeline.log
}
tests() {
  export CUDA_VISIBLE_DEVICES=1 TRITON_INTERPRET=0
  timeout 330 python3 -m pytest -v -x tests/test_gpu.py tests/test_gdn_kernels.py tests/test_ops_conv.py \
      tests/test_gla.py tests/test_mamba2.py -k "gpu or cuda or kernel or 13b or beyond or flush or conv" \
      -p no:cacheprovider --durations=15 > $R/gpu-tests.log 2>&1
}
pipeline 0 gsm8k/eagle-tree,gsm8k/eagle-chain,gsm8k/ngram,humaneval/eagle-tree,humaneval/eagle-chain,humaneval/ngram,gsm8k/eagle-tree/reference &
pipeline 1 mixed/eagle-tree,mixed/eagle-chain,mixed/ngram,gsm8k/eagle-tree/t0.7,mixed/eagle-tree/t0.7,gsm8k/eagle-tree/t1.0,mixed/eagle-tree/t1.0,gsm8k/eagle-tree/bf16 &
tests &
wait
