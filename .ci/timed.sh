# each step's wall time, so the next change to CI knows where its minutes go
timed() {
    local started=$SECONDS
    "$@"
    echo "[ci] $* took $((SECONDS - started)) s (at $((SECONDS / 60)) min)"
}
