#!/usr/bin/env bash
# Set up a fresh virtual environment and run the main job: train a small Llama on real text with
# GoCkpt checkpoints, kill the run for real, resume with ckpt_path="last", finish.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[lightning,accelerate,examples]"
exec .venv/bin/python examples/train_lightning.py --demo "$@"
