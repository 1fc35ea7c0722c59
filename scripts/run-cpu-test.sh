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
#   a timeout (exit 124) is a failure and is never rerun.
# The script exits with the last attempt's exit code. SPECGATE_NO_RETRY=1 disables reruns.
#
# The timeout covers the command's whole process group: GNU timeout makes itself a
# process-group leader and signals the group, then SIGKILLs it SPECGATE_KILL_AFTER
# (default 30s) later if anything is left.
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
[[ $MAX_TRANSIENT =~ ^[0-9]+$ ]] || bad "SPECGATE_MAX_TRANSIENT_RETRIES='$MAX_TRANSIENT' is not a whole number"
[[ $BACKOFF =~ ^[0-9]+(\.[0-9]+)?$ ]] || bad "SPECGATE_RETRY_BACKOFF_S='$BACKOFF' is not a number of seconds"
[[ $KILL_AFTER =~ ^[0-9]+(\.[0-9]+)?[smhd]?$ ]] || bad "SPECGATE_KILL_AFTER='$KILL_AFTER' is not a duration"

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLASSIFY=$REPO_ROOT/scripts/classify_failure.py
WORKDIR=/workspace/specgate  # the repository inside the container

# Print TEXT with the values of secret-named variables masked (as specgate.envpin does).
masked() {
    local line=$1 name value
    for name in $(compgen -e); do
        if [[ ${name^^} =~ TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH ]]; then
            value=${!name}
            if [ ${#value} -ge 4 ]; then
                line=${line//"$value"/***}
                line=${line//"$(printf '%q' "$value")"/***}
            fi
        fi
    done
    echo "$line"
}

# The argv of one attempt: timeout around `bash -c COMMAND`, inside docker when asked.
attempt_argv() {
    local offline=$1
    # Sessions pin HF_HUB_OFFLINE from the manifest; SPECGATE_ONLINE=1 is how a rerun asks them to go online.
    local online=$((1 - offline))
    local inner=(timeout --kill-after="$KILL_AFTER" "$TIMEOUT_VAL" bash -c "$TEST_COMMAND")
    if [ -z "${SPECGATE_DOCKER_IMAGE:-}" ]; then
        ARGV=(env "HF_HUB_OFFLINE=$offline" "HF_DATASETS_OFFLINE=$offline" "SPECGATE_ONLINE=$online" "${inner[@]}")
        return
    fi
    ARGV=(docker run --rm --privileged=true --shm-size=4g)
    [ -z "${CORE_RANGE:-}" ] || ARGV+=(--cpuset-cpus="$CORE_RANGE")
    [ -z "${NUMA_NODE:-}" ] || ARGV+=(--cpuset-mems="$NUMA_NODE")
    ARGV+=(
        -v "$HOME/.cache/huggingface:/root/.cache/huggingface"
        -v "$HOME/.cache/vllm:/root/.cache/vllm"
        -v "$HOME/.cache/specgate:/root/.cache/specgate"
        -v "$REPO_ROOT:$WORKDIR" -w "$WORKDIR"
        -e HF_TOKEN
        -e "HF_HUB_OFFLINE=$offline" -e "HF_DATASETS_OFFLINE=$offline" -e "SPECGATE_ONLINE=$online"
        -e TERM=xterm-256color -e PY_COLORS=1 -e FORCE_COLOR=1 -e CLICOLOR_FORCE=1
    )
    # Sharding and harness settings reach the sessions inside, by name only.
    local name
    for name in BUILDKITE_PARALLEL_JOB BUILDKITE_PARALLEL_JOB_COUNT $(compgen -e | grep '^SPECGATE_' || true); do
        [[ $name == SPECGATE_DOCKER_* ]] || ARGV+=(-e "$name")
    done
    ARGV+=("$SPECGATE_DOCKER_IMAGE" "${inner[@]}")
}

if [ -n "${SPECGATE_DOCKER_IMAGE:-}" ] && [ "${SPECGATE_DOCKER_DRY_RUN:-0}" = 1 ]; then
    attempt_argv 1
    ARGV_TEXT=$(printf '%q ' "${ARGV[@]}")
    echo "run-cpu-test: dry run, attempt 1 would run: $(masked "${ARGV_TEXT% }")"
    exit 0
fi

LOG_DIR=$(mktemp -d)
CHILD=
cleanup() { rm -rf "$LOG_DIR"; }
# Once timeout has returned (it returns as soon as its direct child dies), kill what is
# left of the command's process group, e.g. a grandchild that ignores SIGTERM. On a
# bare host the group id is timeout's pid; in docker mode no such group exists and
# `docker run --rm` removes the container.
end_group() {
    kill -KILL -- "-$1" 2>/dev/null || true
}
on_signal() {
    # Buildkite cancels a job by signalling this script: timeout relays the signal to
    # the command's group and SIGKILLs it SPECGATE_KILL_AFTER later if it lingers.
    if [ -n "$CHILD" ]; then
        kill -TERM "$CHILD" 2>/dev/null || true
        wait "$CHILD" 2>/dev/null || true
        end_group "$CHILD"
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
    end_group "$CHILD"
    CHILD=
    exec {fd}>&-
    wait "$tee_pid" || true
}

ATTEMPT=1
OFFLINE=1
CACHE_RERUNS=0
TRANSIENT_RERUNS=0
while true; do
    run_attempt "$OFFLINE"
    if [ "$RC" -eq 0 ]; then
        [ "$ATTEMPT" -eq 1 ] || echo "run-cpu-test: attempt $ATTEMPT passed"
        exit 0
    fi
    if [ "$RC" -eq 124 ]; then
        echo "run-cpu-test: failure -> not rerunning: timed out after $TIMEOUT_VAL (exit 124)"
        exit 124
    fi
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
done
