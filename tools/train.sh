#!/usr/bin/env bash
# Launch FILE with CONFIG on NPROC processes per node through torchrun:
#   bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 [key=value ...]
# or with a Megatron-LM pretrain_gpt.py command line in place of CONFIG (each rank translates it):
#   bash tools/train.sh tools/train_net.py --megatron-args "--num-layers 24 ..." 8 [key=value ...]
# or a fairseq-train command line:  bash tools/train.sh tools/train_net.py --fairseq-args "data-bin --arch ..." 8
# A DeepSpeed ds_config.json goes after NPROC: ... CONFIG 8 --deepspeed_config ds_config.json [key=value ...]
# Several machines: NODE (nodes), NODE_RANK (this node), ADDR and PORT (node 0's address); the nodes meet
# there before torchrun starts, each saying whom it waits for, and give up after RDZV_TIMEOUT seconds (900).
# MAX_RESTARTS=n lets torchrun restart failed workers; a restarted job resumes from its last checkpoint.
set -euo pipefail
if [ $# -lt 3 ] || { { [ "$2" = "--megatron-args" ] || [ "$2" = "--fairseq-args" ]; } && [ $# -lt 4 ]; }; then
  echo "usage: bash tools/train.sh FILE CONFIG NPROC [key=value ...]" >&2
  echo "       bash tools/train.sh FILE --megatron-args \"FLAGS\" NPROC [key=value ...]" >&2
  echo "       bash tools/train.sh FILE --fairseq-args \"DATA FLAGS\" NPROC [key=value ...]" >&2
  exit 2
fi
FILE=$1
if [ "$2" = "--megatron-args" ] || [ "$2" = "--fairseq-args" ]; then
  CONFIG_ARGS=("$2" "$3")
  NPROC=$4
  shift 4
else
  CONFIG_ARGS=(--config-file "$2")
  NPROC=$3
  shift 3
fi
NODE=${NODE:-1}
NODE_RANK=${NODE_RANK:-0}
ADDR=${ADDR:-127.0.0.1}
PORT=${PORT:-12345}
MAX_RESTARTS=${MAX_RESTARTS:-0}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-900}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# The launcher's arguments are checked before torchrun starts: its own answers to them are assertions
# and tracebacks (NPROC=0), or a wait for nodes that never come.
refuse() {
  echo "error: $1" >&2
  exit 1
}
# An integer from $3 to $4 (10# so that a leading zero is not read as octal).
in_range() {
  [[ $2 =~ ^[0-9]+$ ]] && [ ${#2} -le 9 ] && (( 10#$2 >= $3 )) && { [ -z "${4:-}" ] || (( 10#$2 <= $4 )); }
}
[ -f "$FILE" ] ||
  refuse "$FILE not found (relative paths start at $(pwd)); FILE is the script to launch, e.g. tools/train_net.py"
in_range NPROC "$NPROC" 1 ||
  refuse "NPROC=$NPROC is not a number of processes: give a positive integer, the processes per node (e.g. 1, or 8 for eight GPUs)"
in_range NODE "$NODE" 1 ||
  refuse "NODE=$NODE is not a number of nodes: give a positive integer (1 on one machine)"
in_range NODE_RANK "$NODE_RANK" 0 $((10#$NODE - 1)) ||
  refuse "NODE_RANK=$NODE_RANK is not a node of NODE=$NODE: give an integer from 0 to $((10#$NODE - 1)) (0 on the node at ADDR)"
in_range PORT "$PORT" 1 65535 ||
  refuse "PORT=$PORT is not a port number: give an integer from 1 to 65535, a free port on node 0 (e.g. PORT=29500)"
in_range MAX_RESTARTS "$MAX_RESTARTS" 0 ||
  refuse "MAX_RESTARTS=$MAX_RESTARTS is not a number of restarts: give an integer >= 0"
in_range RDZV_TIMEOUT "$RDZV_TIMEOUT" 1 ||
  refuse "RDZV_TIMEOUT=$RDZV_TIMEOUT is not a number of seconds: give a positive integer, how long the nodes wait for each other (900 by default)"

if (( 10#$NODE_RANK == 0 )); then
  # torchrun's own message for a taken port is a long traceback; say it in one line first, with the
  # real reason. The check binds as torchrun's store does (SO_REUSEADDR), so the TIME_WAIT
  # connections a killed job leaves do not make a --resume on the same port look refused.
  "$PYTHON" -c '
import errno, socket, sys
addr, port = sys.argv[1], int(sys.argv[2])
try:
    found = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
except socket.gaierror as e:
    sys.exit(f"error: ADDR={addr} cannot be resolved ({e.strerror}); give node 0'"'"'s address or host name")
errors = []
for family, kind, proto, _, where in found:  # a name may resolve to IPv6 and IPv4: one of them will do
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(where)
            s.listen()
        sys.exit(0)
    except OSError as e:
        errors.append(e)
e = next((e for e in errors if e.errno == errno.EADDRINUSE), errors[0])
if e.errno == errno.EADDRINUSE:
    sys.exit(f"error: port {port} on {addr} is already in use (another job?); pick a free one with "
             f"PORT=... bash tools/train.sh ...")
if e.errno == errno.EADDRNOTAVAIL:
    sys.exit(f"error: ADDR={addr} is not an address of this machine, which is node 0 (NODE_RANK=0); give "
             f"its own address (127.0.0.1 on one machine)")
sys.exit(f"error: cannot listen on port {port} of {addr} ({e.strerror}); pick another with PORT=...")
' "$ADDR" "$PORT" || exit 1
fi

# torchrun's own rendezvous waits for missing nodes in silence and ends in a traceback: the nodes meet first,
# saying whom they wait for, and a node missing after RDZV_TIMEOUT ends the wait in one line.
if (( 10#$NODE > 1 )); then
  "$PYTHON" -m libai_lite.engine.nodes "$((10#$NODE))" "$((10#$NODE_RANK))" "$ADDR" "$((10#$PORT))" "$((10#$RDZV_TIMEOUT))" ||
    exit $?
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
  "$FILE" "${CONFIG_ARGS[@]}" "$@" 2> >(filter_report >&2) &
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
