#!/usr/bin/env bash
# Wait for a background job on this machine: until DIR/DONE exists or SECONDS have passed, then copy the named
# files of DIR (names or globs, each at most 16 MiB, what a returned file may have: warm-start pieces are 15) to
# $OUT and print DIR/timeline.txt and the last lines of DIR/*.log.
# A job started with `setsid nohup ... &` outlives the command that started it; a later command on the same
# machine calls this to collect what it wrote.
#   usage: scripts/wait_for_files.sh DIR DONE SECONDS [FILE ...]
set -u
dir=$1; done_file=$2; wait_s=$3; shift 3
end=$((SECONDS + wait_s))
while [ ! -e "$dir/$done_file" ] && [ $SECONDS -lt "$end" ]; do sleep 5; done
[ -e "$dir/$done_file" ] && echo "$done_file: there" || echo "$done_file: not yet after $wait_s s"
mkdir -p "${OUT:-/tmp/out}"
for pat in "$@"; do
  for f in "$dir"/$pat; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -le 16777216 ] && cp "$f" "${OUT:-/tmp/out}/"
  done
done
cat "$dir/timeline.txt" 2>/dev/null
for f in "$dir"/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 6 "$f" | cut -c1-400; }; done
exit 0
