#!/bin/bash
# Run one CI test command the way vLLM's .buildkite/scripts/hardware_ci/run-cpu-test.sh
# does (same signature: <timeout> "<command>"), but decide about reruns from what the
# log says rather than from a grep:
#
#   attempt 1 runs with HF_HUB_OFFLINE=1 (a warm cache never touches the network);
#   on failure, scripts/classify_failure.py labels the attempt's log:
#     cache-miss  -> rerun once with HF_HUB_OFFLINE=0
#     transient   -> rerun online with exponential backoff, at most
#                    SPECGATE_MAX_TRANSIENT_RETRIES (default 2) times,
#                    waiting SPECGATE_RETRY_BACKOFF_S (default 10) * 2^(n-1) seconds
#     anything else (failure, auth, env-blocked) -> no rerun
#   a timeout is a failure and is never rerun: exit 124, or 137 when the command was
#   still running SPECGATE_KILL_AFTER (default 30s) after the SIGTERM and was SIGKILLed.
# The script exits with the last attempt's exit code. SPECGATE_NO_RETRY=1 disables reruns.
# Each attempt sees SPECGATE_ATTEMPT=<n> (specgate.contract.summary records reruns by it).
#
# No process outlives its attempt. GNU timeout makes itself a process-group leader and
# signals the group; a process that left the group (setsid) still carries the attempt's
# SPECGATE_STEP_MARKER=<random> in its environment. When the attempt ends (it returned,
# timed out, or this script was signalled) every process carrying the marker gets
# SIGTERM, then SIGKILL SPECGATE_SWEEP_GRACE_S (default 5) seconds later.
#
# Echoed commands are masked by the sessions' own rule (python3 -m specgate.core.secrets):
# credential values such as HF_TOKEN's and the user:password of URLs, never a value just
# because its variable's name contains KEY.
#
# With SPECGATE_DOCKER_IMAGE set, the command runs inside `docker run --rm` with the
# variables and cache mounts upstream uses, plus ~/.cache/specgate and the repository
# as the working directory. HF_TOKEN is passed by name only. SPECGATE_DOCKER_DRY_RUN=1
# prints that docker command (secret values masked) instead of running it.
set -euo pipefail

usage() {
    echo "usage: run-cpu-test.sh <timeout, e.g. 30m> \"<command>\"" >&2
    exit 2
}
bad() {
    echo "run-cpu-test: $*" >&2
    exit 2
}

[ $# -eq 2 ] || usage
TIMEOUT_VAL=$1
TEST_COMMAND=$2
[ -n "$TEST_COMMAND" ] || usage
[[ $TIMEOUT_VAL =~ ^[0-9]+(\.[0-9]+)?[smhd]?$ ]] || bad "timeout '$TIMEOUT_VAL' is not a duration GNU timeout accepts (e.g. 90s, 30m, 2h)"

MAX_TRANSIENT=${SPECGATE_MAX_TRANSIENT_RETRIES:-2}
BACKOFF=${SPECGATE_RETRY_BACKOFF_S:-10}
KILL_AFTER=${SPECGATE_KILL_AFTER:-30s}
NO_RETRY=${SPECGATE_NO_RETRY:-0}
SWEEP_GRACE=${SPECGATE_SWEEP_GRACE_S:-5}
[[ $MAX_TRANSIENT =~ ^[0-9]+$ ]] || bad "SPECGATE_MAX_TRANSIENT_RETRIES='$MAX_TRANSIENT' is not a whole number"
[[ $BACKOFF =~ ^[0-9]+(\.[0-9]+)?$ ]] || bad "SPECGATE_RETRY_BACKOFF_S='$BACKOFF' is not a number of seconds"
[[ $KILL_AFTER =~ ^[0-9]+(\.[0-9]+)?[smhd]?$ ]] || bad "SPECGATE_KILL_AFTER='$KILL_AFTER' is not a duration"
[[ $SWEEP_GRACE =~ ^[0-9]+$ ]] || bad "SPECGATE_SWEEP_GRACE_S='$SWEEP_GRACE' is not a whole number of seconds"

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLASSIFY=$REPO_ROOT/scripts/classify_failure.py
WORKDIR=/workspace/specgate  # the repository inside the container
MARKER_VAR=SPECGATE_STEP_MARKER

# TEXT with credentials masked, by the same rule the sessions apply.
masked() {
    PYTHONPATH=$REPO_ROOT python3 -m specgate.core.secrets <<<"$1"
}

# The argv of one attempt: timeout around `bash -c COMMAND`, inside docker when asked.
# Only this argv carries the marker: the script itself, tee and the classifier never do.
attempt_argv() {
    local offline=$1
    # Sessions pin HF_HUB_OFFLINE from the manifest; SPECGATE_ONLINE=1 is how a rerun asks them to go online.
    local online=$((1 - offline))
    local vars=("HF_HUB_OFFLINE=$offline" "HF_DATASETS_OFFLINE=$offline" "SPECGATE_ONLINE=$online"
        "SPECGATE_ATTEMPT=$ATTEMPT" "$MARKER_VAR=$MARKER")
    local inner=(timeout --kill-after="$KILL_AFTER" "$TIMEOUT_VAL" bash -c "$TEST_COMMAND")
    if [ -z "${SPECGATE_DOCKER_IMAGE:-}" ]; then
        ARGV=(env "${vars[@]}" "${inner[@]}")
        return
    fi
    # The docker client carries the marker too, so a client left behind is swept.
    ARGV=(env "$MARKER_VAR=$MARKER" docker run --rm --privileged=true --shm-size=4g)
    [ -z "${CORE_RANGE:-}" ] || ARGV+=(--cpuset-cpus="$CORE_RANGE")
    [ -z "${NUMA_NODE:-}" ] || ARGV+=(--cpuset-mems="$NUMA_NODE")
    ARGV+=(
        -v "$HOME/.cache/huggingface:/root/.cache/huggingface"
        -v "$HOME/.cache/vllm:/root/.cache/vllm"
        -v "$HOME/.cache/specgate:/root/.cache/specgate"
        -v "$REPO_ROOT:$WORKDIR" -w "$WORKDIR"
        -e HF_TOKEN
        -e TERM=xterm-256color -e PY_COLORS=1 -e FORCE_COLOR=1 -e CLICOLOR_FORCE=1
    )
    local var name
    for var in "${vars[@]}"; do
        ARGV+=(-e "$var")
    done
    # Sharding and harness settings reach the sessions inside, by name only (not the
    # docker settings, nor what an outer wrapper set for its own attempt).
    for name in BUILDKITE_PARALLEL_JOB BUILDKITE_PARALLEL_JOB_COUNT $(compgen -e | grep '^SPECGATE_' || true); do
        case $name in
        SPECGATE_DOCKER_* | SPECGATE_ONLINE | SPECGATE_ATTEMPT | "$MARKER_VAR") ;;
        *) ARGV+=(-e "$name") ;;
        esac
    done
    ARGV+=("$SPECGATE_DOCKER_IMAGE" "${inner[@]}")
}

# A fresh marker per attempt: what one attempt leaves behind is found by it alone.
new_marker() {
    MARKER="$$-$ATTEMPT-$(</proc/sys/kernel/random/uuid)"
}
ATTEMPT=1
new_marker

if [ -n "${SPECGATE_DOCKER_IMAGE:-}" ] && [ "${SPECGATE_DOCKER_DRY_RUN:-0}" = 1 ]; then
    attempt_argv 1
    ARGV_TEXT=$(printf '%q ' "${ARGV[@]}")
    echo "run-cpu-test: dry run, attempt 1 would run: $(masked "${ARGV_TEXT% }")"
    exit 0
fi

LOG_DIR=$(mktemp -d)
CHILD=
cleanup() { rm -rf "$LOG_DIR"; }

# Pids of the processes whose environment carries this attempt's marker (pure bash: no
# helper process of ours may carry it or slow the sweep down).
marked_pids() {
    local environ entry
    for environ in /proc/[0-9]*/environ; do
        while IFS= read -r -d '' entry; do
            if [ "$entry" = "$MARKER_VAR=$MARKER" ]; then
                environ=${environ#/proc/}
                echo "${environ%/environ}"
                break
            fi
        done 2>/dev/null <"$environ" || true # gone, or another user's
    done
}

# End every process of this attempt, wherever it went: SIGTERM, then SIGKILL after the
# grace period. Says how many it found, as nothing should be left.
sweep() {
    local pids waited=0
    mapfile -t pids < <(marked_pids)
    [ ${#pids[@]} -gt 0 ] || return 0
    echo "run-cpu-test: ending ${#pids[@]} process(es) left by attempt $ATTEMPT"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    while [ -n "$(marked_pids)" ] && [ "$waited" -lt $((SWEEP_GRACE * 10)) ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    # Repeat: a process may have forked between a scan and its kill.
    for _ in 1 2 3; do
        mapfile -t pids < <(marked_pids)
        [ ${#pids[@]} -gt 0 ] || return 0
        kill -KILL "${pids[@]}" 2>/dev/null || true
        sleep 0.1
    done
}

# After timeout has returned (as soon as its direct child dies), end what is left of the
# attempt: the marked processes, then the command's process group for one that cleared
# its environment. On a bare host the group id is timeout's pid; in docker mode no such
# group exists and `docker run --rm` removes the container.
end_attempt() {
    sweep
    kill -KILL -- "-$1" 2>/dev/null || true
}
on_signal() {
    # Buildkite cancels a job by signalling this script, then SIGKILLs it after its grace
    # period: end the attempt now rather than wait for timeout's own --kill-after.
    if [ -n "$CHILD" ]; then
        kill -TERM "$CHILD" 2>/dev/null || true
        end_attempt "$CHILD"
    fi
    exit 143
}
trap cleanup EXIT
trap on_signal TERM INT HUP

# Run one attempt with its output on our stdout and in $LOG; sets RC.
run_attempt() {
    local offline=$1 tee_pid fd
    LOG=$LOG_DIR/attempt-$ATTEMPT.log
    attempt_argv "$offline"
    echo "run-cpu-test: attempt $ATTEMPT with HF_HUB_OFFLINE=$offline: $(masked "$TEST_COMMAND")" | tee "$LOG"
    exec {fd}> >(tee -a "$LOG")
    tee_pid=$!
    "${ARGV[@]}" >&"$fd" 2>&1 &
    CHILD=$!
    RC=0
    wait "$CHILD" || RC=$?
    end_attempt "$CHILD"
    CHILD=
    exec {fd}>&-
    wait "$tee_pid" || true
}

OFFLINE=1
CACHE_RERUNS=0
TRANSIENT_RERUNS=0
while true; do
    run_attempt "$OFFLINE"
    if [ "$RC" -eq 0 ]; then
        [ "$ATTEMPT" -eq 1 ] || echo "run-cpu-test: attempt $ATTEMPT passed"
        exit 0
    fi
    case $RC in
    124)
        echo "run-cpu-test: failure -> not rerunning: timed out after $TIMEOUT_VAL (exit 124)"
        exit 124
        ;;
    137)
        echo "run-cpu-test: failure -> not rerunning: timed out after $TIMEOUT_VAL, killed $KILL_AFTER later (exit 137)"
        exit 137
        ;;
    esac
    if VERDICT=$(python3 "$CLASSIFY" "$LOG" 2>&1); then
        LABEL=$(tail -n 1 <<<"$VERDICT")
        REASON=$(tail -n 2 <<<"$VERDICT" | head -n 1)
    else
        LABEL=failure
        REASON="the log could not be classified: $(tail -n 1 <<<"$VERDICT")"
    fi
    if [ "$NO_RETRY" = 1 ]; then
        echo "run-cpu-test: $LABEL -> not rerunning (SPECGATE_NO_RETRY=1): $REASON"
        exit "$RC"
    fi
    case $LABEL in
    cache-miss)
        if [ "$CACHE_RERUNS" -ge 1 ] || [ "$OFFLINE" = 0 ]; then
            echo "run-cpu-test: cache-miss -> not rerunning (already ran online): $REASON"
            exit "$RC"
        fi
        echo "run-cpu-test: cache-miss -> rerunning once online: $REASON"
        CACHE_RERUNS=1
        ;;
    transient)
        if [ "$TRANSIENT_RERUNS" -ge "$MAX_TRANSIENT" ]; then
            echo "run-cpu-test: transient -> not rerunning ($TRANSIENT_RERUNS of $MAX_TRANSIENT reruns used): $REASON"
            exit "$RC"
        fi
        TRANSIENT_RERUNS=$((TRANSIENT_RERUNS + 1))
        WAIT_S=$(awk -v b="$BACKOFF" -v n="$TRANSIENT_RERUNS" 'BEGIN { print b * 2 ^ (n - 1) }')
        echo "run-cpu-test: transient -> rerunning online in ${WAIT_S}s ($TRANSIENT_RERUNS of $MAX_TRANSIENT): $REASON"
        sleep "$WAIT_S" &  # in the background so a cancel is not held up by the wait
        wait $!
        ;;
    *)
        echo "run-cpu-test: $LABEL -> not rerunning: $REASON"
        exit "$RC"
        ;;
    esac
    OFFLINE=0
    ATTEMPT=$((ATTEMPT + 1))
    new_marker
done
