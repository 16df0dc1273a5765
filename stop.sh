#!/usr/bin/env bash
# Stop the processes that ./run.sh started, from the PID files of its run folders.
#   ./stop.sh                     every run folder under ./runs
#   ./stop.sh runs/latest         one run folder (several may be given)
#   ./stop.sh --grace 5 DIR       seconds between SIGTERM and SIGKILL (default 15)
# A PID file holds "PID START": a process is signalled only while its start time
# still matches, so a PID reused by an unrelated process is never touched.
# Nothing is ever stopped by name.
set -euo pipefail
root="$(cd "$(dirname "$0")" && pwd)"   # folders given are taken from the caller's directory

grace=15
dirs=()
while [ $# -gt 0 ]; do
    case "$1" in
        --grace) [ $# -ge 2 ] || { echo "stop.sh: --grace needs a number of seconds" >&2; exit 2; }
                 grace="$2"; shift 2 ;;
        --grace=*) grace="${1#--grace=}"; shift ;;
        -h|--help) sed -n '2,8s/^# \{0,1\}//p' "$0"; exit 0 ;;
        -*) echo "stop.sh: unknown option $1 (see ./stop.sh --help)" >&2; exit 2 ;;
        *) dirs+=("$1"); shift ;;
    esac
done
case "$grace" in ''|*[!0-9]*) echo "stop.sh: --grace must be a whole number of seconds, got '$grace'" >&2; exit 2 ;; esac
if [ ${#dirs[@]} -eq 0 ]; then
    for d in "$root"/runs/*/; do
        d="${d%/}"
        [ -L "$d" ] || [ ! -d "$d/pids" ] || dirs+=("$d")   # runs/latest is a link to one of them
    done
fi

# The start time of process $1 as the launcher recorded it; empty if it is gone or a zombie.
start_of() {
    local stat rest
    if [ -r /proc/self/stat ]; then
        stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 0
        rest="${stat##*) }"            # the fields after "(command name) "
        set -- $rest                   # $1 = state, $20 = start time in clock ticks
        [ "$1" = Z ] || echo "${20}"
    else
        ps -o lstart= -p "$1" 2>/dev/null | tr -s ' ' '_' | sed 's/^_//;s/_$//' || true
    fi
}

targets=()   # "pid start label"
seen=()
for dir in "${dirs[@]}"; do
    [ -d "$dir/pids" ] || { echo "stop.sh: $dir is not a run folder (no pids/ in it)" >&2; exit 2; }
    for file in "$dir"/pids/*.pid; do
        [ -e "$file" ] || continue
        read -r pid start < "$file" || true
        case "$pid" in ''|*[!0-9]*) echo "stop.sh: $file: no PID in it, skipped" >&2; continue ;; esac
        label="$(basename "$file" .pid) ($dir, pid $pid)"
        case " ${seen[*]-} " in *" $pid "*) continue ;; esac   # the same run named twice
        seen+=("$pid")
        if [ -n "$start" ] && [ "$(start_of "$pid")" = "$start" ]; then
            targets+=("$pid $start $label")
        fi
    done
done
if [ ${#targets[@]} -eq 0 ]; then
    echo "stop.sh: nothing to stop (no live process in the PID files of: ${dirs[*]:-no run folders})"
    exit 0
fi

alive() {  # the targets whose process is still the one recorded
    local t pid start
    for t in "${targets[@]}"; do
        read -r pid start _ <<< "$t"
        [ "$(start_of "$pid")" = "$start" ] && echo "$t"
    done
    return 0
}

for t in "${targets[@]}"; do
    read -r pid start label <<< "$t"
    echo "stop.sh: SIGTERM to $label"
    kill -TERM "$pid" 2>/dev/null || true
done
deadline=$((SECONDS + grace))
while [ -n "$(alive)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
left="$(alive)"
if [ -n "$left" ]; then
    while read -r pid start label; do
        echo "stop.sh: $label still running after ${grace} s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    done <<< "$left"
    deadline=$((SECONDS + 5))
    while [ -n "$(alive)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    if [ -n "$(alive)" ]; then
        echo "stop.sh: could not stop: $(alive | cut -d' ' -f3- | tr '\n' ' ')" >&2
        exit 1
    fi
fi
echo "stop.sh: stopped ${#targets[@]} processes"
