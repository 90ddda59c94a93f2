#!/bin/bash
# GPU call 1 (nvidia-h200-x2): GPU0 = small target pipeline, GPU1 = kernel tests and benchmarks
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpus.txt 2>&1
python3 -c "import torch,triton,transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpus.txt 2>&1
git log -1 --format='%H %s' >> $R/gpus.txt 2>/dev/null
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  local t0=$(date +%s)
  python3 benchmarks/targets/train_target.py --preset small --corpus .data/corpus --tokenizer .data/tokenizer \
      --out /tmp/small --time-budget ${TRAIN_BUDGET:-230} > $R/train.log 2>&1
  cp /tmp/small/training.json $R/small-training.json 2>/dev/null
  echo "train done at $(( $(date +%s) - t0 )) s" >> $R/pipeline.log
  python3 -m specla.cli train-drafter --model /tmp/small --data .data/corpus/*.xz --out /tmp/small-eagle \
      --steps 2000 --batch-windows 32 --window 128 --max-tokens 400000 --distill-prompts 256 --ce-weight 1.0 \
      --device cuda > $R/drafter.log 2>&1
  cp /tmp/small-eagle/training.json $R/drafter-training.json 2>/dev/null
  echo "drafter done at $(( $(date +%s) - t0 )) s" >> $R/pipeline.log
  python3 benchmarks/acceptance.py --model /tmp/small --drafter /tmp/small-eagle --prompts .data/prompts \
      --out $R/acceptance.json --time-per-run ${RUN_S:-10} --batch-size 16 --max-new-tokens 128 \
      --runs ${RUNS:-gsm8k/eagle-tree,gsm8k/eagle-chain,gsm8k/ngram,humaneval/eagle-tree,mixed/eagle-tree,gsm8k/eagle-tree/triton,gsm8k/eagle-tree/t0.7} \
      > $R/acceptance.log 2>&1
  echo "acceptance done at $(( $(date +%s) - t0 )) s" >> $R/pipeline.log
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1 TRITON_INTERPRET=0
  timeout 200 python3 -m pytest -q -x tests/test_gpu.py tests/test_gdn_kernels.py tests/test_ops_conv.py \
      tests/test_gla.py tests/test_mamba2.py -k "gpu or cuda or kernel or 13b or beyond or flush or conv" \
      -p no:cacheprovider > $R/gpu-tests.log 2>&1
  timeout 100 python3 benchmarks/kernels.py --plugin gla --batches 1,8,64 --out $R/gla.json > $R/gla.log 2>&1
  timeout 100 python3 benchmarks/kernels.py --plugin mamba2 --batches 1,8,64 --out $R/mamba2.json > $R/mamba2.log 2>&1
  timeout 150 python3 benchmarks/kernels.py --only verify --batches 1,8,64 --out $R/gdn-verify.json > $R/gdn-verify.log 2>&1
}
gpu0 & gpu1 & wait
