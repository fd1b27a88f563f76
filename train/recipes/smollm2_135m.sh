#!/usr/bin/env bash
# The shipped default draft for SmolLM2-135M-Instruct (longspec_jax/drafts/smollm2-135m):
# one pretrain stage on one GPU, distilling the target's next-token distribution, with
# anchor-offset positions up to the target's 8k context and flash noisy training.
#
# Training text is this machine's installed packages: their Python sources and their
# Markdown/reST docs. Held out: the standard library's top-level modules (the code
# prompts of infer.prompts and infer.benchmark) and /usr/share's documents (the docs
# prompts); the first are the eval set.
#
#   train/recipes/smollm2_135m.sh runs/smollm2 [more train.run flags]
set -euo pipefail
out=${1:?usage: train/recipes/smollm2_135m.sh OUT_DIR [train.run flags]}
shift
packages=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
python3 -m train.run --stage pretrain --target smollm2-135m \
  --data "$packages/**/*.py" "$packages/**/*.md" "$packages/**/*.rst" --max-tokens 80000000 \
  --eval "$stdlib/*.py" --eval-rows 8 \
  --length 1024 --batch 16 --steps 6000 --warmup-steps 200 --learning-rate 1e-3 --save-every 1000 \
  --out "$out" "$@"
