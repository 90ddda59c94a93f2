#!/bin/bash
# fifth session, call C (x2, ~9 min). GPU 0: the small target and its drafter again (same recipe as
# s6b), then the temperature-1.0 rows and batch-1 rows. GPU 1: the 1.3B-shape e2e oracle study and
# baselines (batches 1 and 64) after the norm fusion, with the attention EAGLE head's cost and the
# s6b acceptance profiles.
R=/tmp/res; mkdir -p $R
D=/tmp/small
acc() { # runs, seconds per run, batch size, name
  python3 benchmarks/acceptance.py --model $D --drafter /tmp/eagle --prompts .data/prompts \
    --out $R/$4.json --time-per-run $2 --batch-size $3 --max-new-tokens 128 --runs $1 \
    2>&1 | tr '\r' '\n' | grep -v "batch/s\]$" > $R/$4.log
}
(
  export CUDA_VISIBLE_DEVICES=0
  python3 benchmarks/targets/train_target.py --preset small --corpus .data/corpus --tokenizer .data/tokenizer \
      --out $D --steps 434 > $R/train.log 2>&1
  python3 -m specla.cli train-drafter --model $D --data .data/corpus/*.xz --out /tmp/eagle \
      --steps 3000 --batch-windows 32 --window 128 --max-tokens 400000 --distill-prompts 2048 --ce-weight 1.0 \
      --unroll 3 --device cuda 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -3 > $R/drafter.log
  cp /tmp/eagle/training.json $R/drafter-training.json
  acc gsm8k/eagle-tree/t1.0,mixed/eagle-tree/t1.0 25 32 acc-t1
  acc gsm8k/eagle-tree,gsm8k/ngram 25 1 acc-b1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  P=benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json
  PROF="--profile $P:gsm8k/eagle-tree --chain-profile $P:gsm8k/eagle-chain"
  timeout 265 python3 benchmarks/e2e.py --out $R/oracle --studies oracle $PROF > $R/oracle.log 2>&1
  timeout 240 python3 benchmarks/e2e.py --out $R/base --studies baselines --batches 1,64 $PROF > $R/base.log 2>&1
) &
wait
