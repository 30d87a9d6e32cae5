# each step's wall time, so the next change to CI knows where its minutes go. The status is
# returned explicitly: inside `a && b` bash ignores `set -e` in a function's body, and a
# failed step would otherwise report success.
timed() {
    local started=$SECONDS status=0
    "$@" || status=$?
    local failed=""
    [ "$status" -eq 0 ] || failed=", FAILED with exit $status"
    echo "[ci] $* took $((SECONDS - started)) s (at $((SECONDS / 60)) min$failed)"
    return "$status"
}
