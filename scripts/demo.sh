#!/usr/bin/env bash
# The demo: set up, build, prepare the fortunes corpus (Debian's `fortunes` package, public-domain
# %-separated quotations) with the byte tokenizer, train a small GPT-2 for a few minutes on
# 2 threads, then sample from the checkpoint. Everything lands under runs/demo/; the checkpoints
# are runs/demo/checkpoint/step-N (every 200 steps and at the end; `latest` names the newest, which
# generate reads); the curves are runs/demo/curves.png (origami plot) and TensorBoard events in
# runs/demo/tensorboard (`tensorboard --logdir runs/demo/tensorboard`). `build/origami ckpt export runs/demo/checkpoint --hf DIR` makes a Hugging Face
# model directory of it.
set -euo pipefail
# Threads that wait sleep instead of spinning: on a shared or busy machine spinning costs up to 2x.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cd "$(dirname "$0")/.."
STEPS=${STEPS:-600}
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
ninja -C build origami
mkdir -p runs/demo
build/origami data prepare --input /usr/share/games/fortunes --output runs/demo/fortunes --tokenizer byte
build/origami data info --data runs/demo/fortunes
# A fresh run: one event file (an earlier run's would stay beside it, hidden), and a checkpoint
# directory of its own (train refuses to save over another run's steps without --resume).
rm -rf runs/demo/tensorboard runs/demo/checkpoint
build/origami train --config configs/demo_gpt2.json --data runs/demo/fortunes \
  --steps "$STEPS" --micro-batch 16 --seq-len 128 --lr 2e-3 --min-lr 2e-4 --warmup 100 \
  --lr-schedule cosine --weight-decay 0.1 --grad-clip 1.0 --data-order shuffled --threads 2 \
  --metrics runs/demo/metrics.jsonl --tensorboard runs/demo/tensorboard --save runs/demo/checkpoint \
  --save-every 200 --quiet
build/origami plot runs/demo/metrics.jsonl --out runs/demo/curves.png
for prompt in "Q: What is the meaning of life?
A:" "The computer"; do
  echo "---- origami generate --prompt \"$prompt\""
  build/origami generate --checkpoint runs/demo/checkpoint --prompt "$prompt" --max-new-tokens 300 \
    --temperature 0.8 --top-k 40 --seed 7 --threads 2
done
