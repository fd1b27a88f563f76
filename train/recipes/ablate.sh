#!/usr/bin/env bash
# The paper's training ablations at equal steps and data: anchor-offset vs vanilla
# positions (trained on 1k-token rows, evaluated on held-out 8k-token documents, where
# positions past 1k are unseen by the vanilla draft), and flash noisy training (delays
# 1 .. the tree's depth) against a fixed delay of one token (the fair baseline: a draft
# at inference never reads the target at its own position), evaluated at each tree
# depth's delay. Each arm writes OUT/ARM/eval.json.
#
#   train/recipes/ablate.sh runs/ablate [more train.run flags]
set -euo pipefail
out=${1:?usage: train/recipes/ablate.sh OUT_DIR [train.run flags]}
shift
packages=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
arm() {
  local name=$1
  shift
  python3 -m train.run --stage pretrain --target smollm2-135m \
    --data "$packages/**/*.py" "$packages/**/*.md" "$packages/**/*.rst" --max-tokens 20000000 \
    --eval "$stdlib/*.py" --eval-rows 8 \
    --length 1024 --batch 16 --steps 800 --warmup-steps 100 --learning-rate 1e-3 --save-every 800 \
    --out "$out/$name" "$@"
}
arm anchor_offset --positions anchor_offset "$@"
arm vanilla --positions vanilla "$@"
arm fixed_delay --positions anchor_offset --delays 1 "$@"
