#!/bin/bash
# fifth session, call B (x2, ~9.3 min): the small target once (GPU 0), its attention EAGLE drafter,
# the tiny target's drafter retrained (GPU 1), then the suites split over both GPUs.
R=/tmp/res; mkdir -p $R
D=/tmp/small
acc() { # GPU, runs, seconds per run, name
  CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/acceptance.py --model $D --drafter /tmp/eagle --prompts .data/prompts \
    --out $R/$4.json --time-per-run $3 --batch-size 32 --max-new-tokens 128 --runs $2 \
    2>&1 | tr '\r' '\n' | grep -v "batch/s\]$" > $R/$4.log
}
(
  export CUDA_VISIBLE_DEVICES=0
  python3 benchmarks/targets/train_target.py --preset small --corpus .data/corpus --tokenizer .data/tokenizer \
      --out $D --steps 434 > $R/train.log 2>&1
  touch /tmp/target.done
  python3 -m specla.cli train-drafter --model $D --data .data/corpus/*.xz --out /tmp/eagle \
      --steps 3000 --batch-windows 32 --window 128 --max-tokens 400000 --distill-prompts 2048 --ce-weight 1.0 \
      --unroll 3 --device cuda 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" > $R/drafter.log
  cp /tmp/eagle/training.json $R/drafter-training.json
  touch /tmp/drafter.done
  acc 0 gsm8k/eagle-tree,gsm8k/eagle-chain,gsm8k/eagle-tree/t0.7 48 acc-gpu0
) &
(
  export CUDA_VISIBLE_DEVICES=1
  python3 -m specla.cli train-drafter --model plugins/gdn/assets/tiny --data .data/corpus/*.xz --out $R/tiny-eagle \
      --steps 4000 --batch-windows 64 --window 128 --max-tokens 1000000 --distill-prompts 1024 --ce-weight 1.0 \
      --unroll 3 --device cuda 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" > $R/tiny-drafter.log
  rm -f $R/tiny-eagle/checkpoint.pt
  TRITON_INTERPRET=0 timeout 100 python3 -m pytest -v -p no:cacheprovider tests/test_graphs.py tests/test_eagle.py \
      -k "recorded or synchronisation or cache_follows" > $R/gpu-graph-eagle-tests.log 2>&1
  while [ ! -f /tmp/target.done ]; do sleep 2; done
  acc 1 humaneval/ngram,mixed/ngram 22 acc-gpu1-ngram
  while [ ! -f /tmp/drafter.done ]; do sleep 2; done
  acc 1 humaneval/eagle-tree,humaneval/eagle-chain,mixed/eagle-tree,mixed/eagle-chain,mixed/eagle-tree/t0.7,mixed/eagle-tree/t1.0,gsm8k/eagle-tree/t1.0 22 acc-gpu1
) &
wait
