#!/usr/bin/env bash
# The rows behind --kernel-cache's default (docs/bench/README.md, Kernel cache
# default): buffered fio psync over a 1 GiB raw image exported writable with
# --kernel-cache off, auto and on, caches dropped before each run, the order
# reversed every other round, REPS rounds; one line per run. As root, on an
# otherwise idle machine, after make build.
set -euo pipefail
BIN=${BIN:-bin/blockexport}
REPS=${REPS:-3}
d=$(mktemp -d /var/tmp/kcb.XXXX)
img=$d/img.raw; mnt=$d/mnt
dd if=/dev/urandom of=$img bs=1M count=1024 status=none
touch $mnt
run() { # mode job
  local mode=$1 rw=$2 bs=$3 extra=${4:-}
  $BIN fuse -w -f raw --log-level warn --kernel-cache $mode $img $mnt & local pid=$!
  for i in $(seq 50); do mountpoint -q $mnt 2>/dev/null && break; grep -q " $mnt " /proc/mounts && break; sleep 0.1; done
  sync; echo 3 > /proc/sys/vm/drop_caches
  local v
  v=$(fio --name=t --filename=$mnt --rw=$rw --bs=$bs --ioengine=psync --size=1G $extra --output-format=json 2>/dev/null | python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; k="write" if j["write"]["bw"]>0 else "read"; print(round(j[k]["bw"]/1024))')
  kill $pid; wait $pid || true
  echo "$mode $rw $bs $v"
}
for rep in $(seq $REPS); do
  for job in "write 4k --end_fsync=1" "read 4k" "read 1M" "randread 4k --runtime=10 --time_based"; do
    set -- $job
    modes="off auto on"; [ $((rep % 2)) = 0 ] && modes="on auto off"
    for m in $modes; do run $m $1 $2 "${3:-} ${4:-}"; done
  done
done
rm -rf $d
