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
  # torchrun's own message for a taken port is a long traceback; say it in one line first. The
  # check binds as torchrun's store does (SO_REUSEADDR), so the TIME_WAIT connections a killed job
  # leaves do not make a --resume on the same port look refused.
  if ! "$PYTHON" -c "import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('$ADDR', int('$PORT'))); s.listen()" 2>/dev/null; then
    echo "error: port $PORT on $ADDR is already in use (another job?); pick a free one with PORT=... bash tools/train.sh ..." >&2
    exit 1
  fi
fi

# A worker refusing bad input says why in one "error: ..." line; torchrun then adds a traceback
# and a failure report of its own, which only bury that line, so they are dropped after it.
# Any other failure (a crash, a signal) is shown in full.
# torchrun's own traceback for the stop signal it was sent (SignalException) is dropped as well: the
# workers' log says what they did with the signal.
filter_report() {
  awk '
    function flush_traceback() {
      if (tb != "" && !(last ~ /^torch\.distributed\.elastic\.multiprocessing\.api\.SignalException: /)) {
        printf "%s", tb; print last
      }
      tb = ""; fflush()
    }
    intb && /^(  |    )/ { tb = tb $0 "\n"; next }
    intb { intb = 0; last = $0; flush_traceback(); next }
    !seen && /^Traceback \(most recent call last\):$/ { intb = 1; tb = $0 "\n"; next }
    /^error: / { seen = 1; print; fflush(); next }
    seen && (/^Traceback \(most recent call last\):$/ || /^  File "/ || /^    / || /ChildFailedError/ ||
             /^=+$/ || /^-+$/ || / FAILED$/ || /^Failures:$/ || /^Root Cause/ || /^\[[0-9]+\]:$/ ||
             /^  (time|host|rank|exitcode|error_file|traceback) *:/ || /^  <NO_OTHER_FAILURES>$/ ||
             /^[EWI][0-9][0-9][0-9][0-9] / || /^ *\^+ *$/ || /^$/) { next }
    { print; fflush() }
    END { if (intb) printf "%s", tb }
  '
}

# torchrun runs in the background so this script, often PID 1 of a container or the step Slurm and
# Kubernetes signal, can pass SIGTERM/SIGINT/SIGHUP on to it: torchrun forwards them to the workers,
# which save a checkpoint at the next step boundary and stop. Waiting again after each signal keeps
# this script alive until torchrun has ended, so no worker trains on unsupervised.
set +e
# Workers end when this script does, however it ends (libai_lite.utils.process.die_with_parent).
export LIBAI_LITE_LAUNCHER_PID=$$
"$PYTHON" -m torch.distributed.run \
  --nproc_per_node "$NPROC" --nnodes "$NODE" --node_rank "$NODE_RANK" \
  --master_addr "$ADDR" --master_port "$PORT" --max-restarts "$MAX_RESTARTS" \
  "$FILE" --config-file "$CONFIG" "$@" 2> >(filter_report >&2) &
child=$!
received=""
forward() {
  received=$1
  kill -s "$1" "$child" 2>/dev/null
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward HUP' HUP
while :; do
  wait "$child"
  status=$?
  kill -0 "$child" 2>/dev/null || break
done
trap - TERM INT HUP
wait
# Stopped on request: the status of a process ended by that signal, so a scheduler (a Kubernetes
# Job, Slurm's requeue) does not take the run for finished.
if [ -n "$received" ]; then
  exit $((128 + $(kill -l "$received")))
fi
exit $status
