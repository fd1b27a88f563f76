#!/usr/bin/env bash
# A draft trained on everything the machine has, in stages that each resume:
# run it again with the same OUT (e.g. once per device call, OUT carried between calls as
# a tar) and it goes on where it stopped, each call spending at most SECONDS.
#
#   1. corpus:   python -m train.corpus (held out by package; never /usr/include or Perl)
#   2. pretrain: the corpus, anchor-offset positions, delays over every tree depth,
#                held-out agreement per depth every 500 steps
#   3. long:     the same text in sequences of the target's full context (8k), flash
#                attention in the draft's passes (the paper's stage 2)
#   4. self:     the target's own continuations and answers on corpus documents
#   5. sft:      the long stage's draft on the target's text
#   6. vocab:    the corpus's token ranking stored with the block draft (train.rank_vocab),
#                which then scores its 8,192 most frequent tokens
#
# A stage is done once train.run marks it `complete` (all its steps taken; a stage that
# --time-limit stopped has a draft and eval.json too, and resumes). The corpus is rebuilt
# where it is missing (seconds; deterministic on one machine
# image), so a carried OUT may leave out $OUT/corpus and the finished stages' checkpoints.
#
# DRAFT_KIND=glide trains GLIDE's draft the same way (give it --draft-layers; its self
# text is decoded with --method glide).
#
# EXTRA_DATA adds text to the pretrain, long and self-text stages (JSONL or files, as
# train.run --data takes them): e.g. another machine's corpus, carried over, where this
# one has little of some kinds of text.
#
#   SECONDS_PER_CALL=480 train/recipes/broad.sh runs/broad [more train.run flags]
#   DRAFT_KIND=glide train/recipes/broad.sh runs/glide --draft-layers 2
#   EXTRA_DATA=other/train.jsonl train/recipes/broad.sh runs/broad
#
# Sizes (defaults in brackets): PRETRAIN_STEPS [20000], LONG_STEPS [600], SELF_SAMPLES
# [4000] of SELF_NEW_TOKENS [768], SFT_STEPS [3000]; FINETUNE_LR [1e-4] is the long and
# SFT stages' learning rate (the paper's 5e-6, for 7B drafts, barely moved this 4M-
# parameter draft in 600 long steps), LONG_LR the long stage's alone (GLIDE's
# shipped draft: 3e-4, its full attention first meeting contexts past 1k there).
#
# The shipped drafts for SmolLM2-135M (docs/training.md):
#   PRETRAIN_STEPS=9000 LONG_STEPS=200 SELF_SAMPLES=1024 SELF_NEW_TOKENS=512 SFT_STEPS=400 \
#     EXTRA_DATA=extra.jsonl train/recipes/broad.sh runs/broad
#   DRAFT_KIND=glide PRETRAIN_STEPS=9000 LONG_STEPS=725 LONG_LR=3e-4 SELF_SAMPLES=1024 \
#     SELF_NEW_TOKENS=512 SFT_STEPS=400 EXTRA_DATA=extra.jsonl train/recipes/broad.sh runs/glide --draft-layers 1
set -euo pipefail
out=${1:?usage: train/recipes/broad.sh OUT_DIR [train.run flags]}
shift
kind=${DRAFT_KIND:-longspec}
set -- --draft-kind "$kind" "$@"
budget=${SECONDS_PER_CALL:-480}
read -r -a extra <<< "${EXTRA_DATA:-}"
self_samples=${SELF_SAMPLES:-4000}
finetune_lr=${FINETUNE_LR:-1e-4}
started=$(date +%s)
left() { echo $((budget - ($(date +%s) - started))); }
resume() { [ -d "$1/checkpoints" ] && echo --resume || true; }

if [ ! -f "$out/corpus/manifest.json" ]; then
  python3 -m train.corpus --out "$out/corpus" --max-chars-per-domain 40000000
fi
if [ ! -f "$out/pretrain/complete" ] && [ "$(left)" -gt 60 ]; then
  python3 -m train.run --stage pretrain --target smollm2-135m --data "$out/corpus/train.jsonl" "${extra[@]}" \
    --max-tokens 200000000 --eval "$out/corpus/heldout.jsonl" --eval-rows 8 --eval-length 4096 --eval-every 500 \
    --length 1024 --batch 16 --steps "${PRETRAIN_STEPS:-20000}" --warmup-steps 300 --learning-rate 1e-3 --save-every 250 \
    --time-limit "$(left)" --out "$out/pretrain" $(resume "$out/pretrain") "$@"
fi
if [ -f "$out/pretrain/complete" ] && [ ! -f "$out/long/complete" ] && [ "$(left)" -gt 60 ]; then
  python3 -m train.run --stage long --target smollm2-135m --data "$out/corpus/train.jsonl" "${extra[@]}" \
    --init-draft "$out/pretrain/draft" --max-tokens 20000000 --eval "$out/corpus/heldout.jsonl" --eval-rows 8 \
    --eval-length 8192 --eval-every 100 --steps "${LONG_STEPS:-600}" --learning-rate "${LONG_LR:-$finetune_lr}" --save-every 100 --time-limit "$(left)" --out "$out/long" \
    $(resume "$out/long") "$@"
fi
if [ -f "$out/long/complete" ] && [ ! -f "$out/self.jsonl.done" ] && [ "$(left)" -gt 60 ]; then
  python3 -m train.self_text --data "$out/corpus/train.jsonl" "${extra[@]}" --out "$out/self.jsonl" \
    $([ -f "$out/self.jsonl" ] && echo --resume) --time-limit "$(left)" \
    --method "$kind" --draft "$out/long/draft" --samples "$self_samples" --new-tokens "${SELF_NEW_TOKENS:-768}" --batch 16
  if [ "$(wc -l < "$out/self.jsonl")" -ge "$self_samples" ]; then touch "$out/self.jsonl.done"; fi
fi
if [ -f "$out/self.jsonl.done" ] && [ ! -f "$out/sft/complete" ] && [ "$(left)" -gt 60 ]; then
  python3 -m train.run --stage sft --target smollm2-135m --data "$out/self.jsonl" \
    --init-draft "$out/long/draft" --eval "$out/corpus/heldout.jsonl" --eval-rows 8 --eval-length 4096 \
    --eval-every 250 --steps "${SFT_STEPS:-3000}" --learning-rate "$finetune_lr" --save-every 250 --time-limit "$(left)" --out "$out/sft" $(resume "$out/sft") "$@"
fi
if [ -f "$out/sft/complete" ] && [ "$kind" != tokenswift ] && [ ! -f "$out/sft/draft/vocab_ranking.npy" ]; then
  python3 -m train.rank_vocab --target smollm2-135m --draft "$out/sft/draft" --data "$out/corpus/train.jsonl"
fi
