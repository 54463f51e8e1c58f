#!/usr/bin/env bash
# Check and measure the project on one CUDA GPU, the mission's command first; --dry-run: the same
# steps on the CPU at tiny sizes. Everything is in bench/gpu.py (--help):
#   bash bench/gpu.sh --out DIR [--dry-run] [--only STEP,...] [--skip STEP,...] [--budget SECONDS]
# On a lent device with no pip: export PYTHONPATH=$PWD/.gpu/site PYTHON=python3 first
# (../shared/gpu/README.md); the checkout's root is added to PYTHONPATH here.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
exec "${PYTHON:-python3}" "$ROOT/bench/gpu.py" "$@"
