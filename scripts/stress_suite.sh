#!/usr/bin/env bash
# The test suite under load: ROUNDS runs of the suite, each while a second copy of the suite
# runs beside it (restarted whenever it ends, until the round ends). Both copies run both
# dialects: each has a Postgres database of its own (and its SQLite files in its own
# temporary directory). Failures are collected per round into a summary.
#
#   scripts/stress_suite.sh                       # 3 rounds of the whole suite (hours)
#   ROUNDS=1 PYTEST_ARGS="tests/test_store.py tests/test_lifecycle.py" scripts/stress_suite.sh
#
# Environment:
#   ROUNDS         rounds of the measured copy (default 3)
#   PYTEST_ARGS    what each copy runs (default: tests)
#   BESIDE_ARGS    what the copy beside runs (default: PYTEST_ARGS)
#   STRESS_PG      Postgres server URL without a database
#                  (default postgresql+asyncpg://postgres@127.0.0.1:5432)
#   STRESS_DB      database prefix (default stress): <prefix>_main and <prefix>_beside are
#                  created if missing; the suite recreates their schemas
#   STRESS_OUT     where logs and the summary go (default: a new directory under /tmp)
#   PYTHON         the interpreter with the project installed (default .venv/bin/python)
# Exit status: 0 when no round of the measured copy failed, 1 otherwise.
set -u -o pipefail

cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
PYTEST_ARGS=${PYTEST_ARGS:-tests}
BESIDE_ARGS=${BESIDE_ARGS:-$PYTEST_ARGS}
STRESS_PG=${STRESS_PG:-postgresql+asyncpg://postgres@127.0.0.1:5432}
STRESS_DB=${STRESS_DB:-stress}
STRESS_OUT=${STRESS_OUT:-$(mktemp -d /tmp/stress-suite.XXXXXX)}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$STRESS_OUT"
SUMMARY="$STRESS_OUT/summary.txt"
export PYTHONPATH="$PWD:$PWD/clients/python/src${PYTHONPATH:+:$PYTHONPATH}"

# psql speaks libpq URLs: the same server without the driver name.
pg_libpq=${STRESS_PG/postgresql+asyncpg/postgresql}
for name in main beside; do
    db="${STRESS_DB}_$name"
    if ! psql "$pg_libpq/postgres" -tAc "select 1 from pg_database where datname = '$db'" |
        grep -q 1; then
        psql "$pg_libpq/postgres" -qc "create database $db" || exit 2
    fi
done

# One copy of the suite: its own database, temporary directory and log.
copy() { # name log [pytest args...]
    local name=$1 log=$2
    shift 2
    # The copy beside leaves out the test that restarts the Postgres server: the measured
    # copy's tests would fail with it (the measured copy's restart is the beside's to bear).
    local shared=""
    [ "$name" = beside ] && shared=1
    # shellcheck disable=SC2086
    TRAINYARD_TEST_DATABASE_URL="$STRESS_PG/${STRESS_DB}_$name" \
        TRAINYARD_TEST_SHARED_POSTGRES="$shared" \
        "$PYTHON" -m pytest -q -p no:cacheprovider -rfE \
        --basetemp="$STRESS_OUT/tmp-$name" "$@" >"$log" 2>&1
}

export -f copy
export STRESS_PG STRESS_DB STRESS_OUT PYTHON

beside_pid=""
stop_beside() {
    if [ -n "$beside_pid" ] && kill -0 "$beside_pid" 2>/dev/null; then
        kill -TERM -- "-$beside_pid" 2>/dev/null
        wait "$beside_pid" 2>/dev/null
    fi
    beside_pid=""
}
trap 'stop_beside; exit 130' INT TERM

{
    echo "stress run: $ROUNDS round(s) of: pytest $PYTEST_ARGS"
    echo "beside it:  pytest $BESIDE_ARGS (restarted until the round ends)"
    echo "databases:  ${STRESS_DB}_main, ${STRESS_DB}_beside on $STRESS_PG"
    echo "machine:    $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg) at start"
    echo "started:    $(date -u '+%F %T') UTC"
} >"$SUMMARY"

failed_rounds=0
for round in $(seq 1 "$ROUNDS"); do
    # The copy beside: a loop of its own in a process group of its own (stopped as one).
    # shellcheck disable=SC2016,SC2086
    ROUND=$round setsid bash -c '
        n=0
        while true; do
            n=$((n + 1))
            copy beside "$STRESS_OUT/round$ROUND-beside-$n.log" "$@"
        done' beside $BESIDE_ARGS &
    beside_pid=$!
    started=$(date +%s)
    # shellcheck disable=SC2086
    copy main "$STRESS_OUT/round$round-main.log" $PYTEST_ARGS
    status=$?
    took=$(($(date +%s) - started))
    stop_beside
    log="$STRESS_OUT/round$round-main.log"
    failures=$(grep -E '^(FAILED|ERROR) tests/' "$log" || true)
    count=$(printf '%s' "$failures" | grep -c . || true)
    [ "$status" -ne 0 ] && failed_rounds=$((failed_rounds + 1))
    {
        echo
        echo "round $round: exit $status, $count failed, ${took}s, load $(cut -d' ' -f1-3 /proc/loadavg)"
        echo "  $(tail -n 1 "$log")"
        [ -n "$failures" ] && printf '%s\n' "$failures" | sed 's/^/  /'
        for beside in "$STRESS_OUT"/round"$round"-beside-*.log; do
            [ -e "$beside" ] || continue
            extra=$(grep -E '^(FAILED|ERROR) tests/' "$beside" || true)
            last=$(tail -n 1 "$beside")
            grep -qE ' in [0-9.]+s' <<<"$last" || last="stopped when the round ended"
            echo "  beside $(basename "$beside"): $last"
            [ -n "$extra" ] && printf '%s\n' "$extra" | sed 's/^/    /'
        done
    } >>"$SUMMARY"
done

{
    echo
    echo "finished: $(date -u '+%F %T') UTC; rounds with failures: $failed_rounds of $ROUNDS"
    echo "logs: $STRESS_OUT"
} >>"$SUMMARY"
cat "$SUMMARY"
[ "$failed_rounds" -eq 0 ]
