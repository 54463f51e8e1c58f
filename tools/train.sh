#!/usr/bin/env bash
# Launch FILE with CONFIG on NPROC processes per node through torchrun:
#   bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 [key=value ...]
# Several machines: NODE (nodes), NODE_RANK (this node), ADDR and PORT (node 0's address).
# MAX_RESTARTS=n lets torchrun restart failed workers; a restarted job resumes from its last checkpoint.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: bash tools/train.sh FILE CONFIG NPROC [key=value ...]" >&2
  exit 2
fi
FILE=$1
CONFIG=$2
NPROC=$3
shift 3
NODE=${NODE:-1}
NODE_RANK=${NODE_RANK:-0}
ADDR=${ADDR:-127.0.0.1}
PORT=${PORT:-12345}
MAX_RESTARTS=${MAX_RESTARTS:-0}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ "$NODE_RANK" = "0" ]; then
  # torchrun's own message for a taken port is a long traceback; say it in one line first.
  if ! "$PYTHON" -c "import socket,sys; s=socket.socket(); s.bind(('$ADDR', int('$PORT')))" 2>/dev/null; then
    echo "error: port $PORT on $ADDR is already in use (another job?); pick a free one with PORT=... bash tools/train.sh ..." >&2
    exit 1
  fi
fi

# A worker refusing bad input says why in one "error: ..." line; torchrun then adds a traceback
# and a failure report of its own, which only bury that line, so they are dropped after it.
# Any other failure (a crash, a signal) is shown in full.
filter_report() {
  awk '
    /^error: / { seen = 1; print; fflush(); next }
    seen && (/^Traceback \(most recent call last\):$/ || /^  File "/ || /^    / || /ChildFailedError/ ||
             /^=+$/ || /^-+$/ || / FAILED$/ || /^Failures:$/ || /^Root Cause/ || /^\[[0-9]+\]:$/ ||
             /^  (time|host|rank|exitcode|error_file|traceback) *:/ || /^  <NO_OTHER_FAILURES>$/ ||
             /^[EWI][0-9][0-9][0-9][0-9] / || /^ *\^+ *$/ || /^$/) { next }
    { print; fflush() }
  '
}

set +e
"$PYTHON" -m torch.distributed.run \
  --nproc_per_node "$NPROC" --nnodes "$NODE" --node_rank "$NODE_RANK" \
  --master_addr "$ADDR" --master_port "$PORT" --max-restarts "$MAX_RESTARTS" \
  "$FILE" --config-file "$CONFIG" "$@" 2> >(filter_report >&2)
status=$?
wait
exit $status
