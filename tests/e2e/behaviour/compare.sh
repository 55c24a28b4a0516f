#!/usr/bin/env bash
# Compare two captures of capture.py:  compare.sh [-v] DIR_A DIR_B
#
# One verdict line per part (help, data, losses, export/fresh, export/top10), then, for the parts
# that differ, which files and which JSON keys (paths like losses/hstu_plain.json:losses[3]) differ.
# -v also prints the unified diffs. DIR/work and DIR/meta.json (timings, paths) are not compared.
# Exit status: 0 when every part present in both is identical and none is missing from one side.
set -u
verbose=0
if [ "${1:-}" = "-v" ]; then verbose=1; shift; fi
if [ $# -ne 2 ]; then echo "usage: $0 [-v] DIR_A DIR_B" >&2; exit 2; fi
A=${1%/}; B=${2%/}
status=0
details=""

# part NAME then a list of relative globs (files within A or B)
compare_part() {
    local name=$1; shift
    local files_a files_b all f diffs="" missing="" n=0
    files_a=$(cd "$A" 2>/dev/null && for g in "$@"; do compgen -G "$g"; done | sort -u)
    files_b=$(cd "$B" 2>/dev/null && for g in "$@"; do compgen -G "$g"; done | sort -u)
    if [ -z "$files_a" ] && [ -z "$files_b" ]; then
        printf '%-13s SKIPPED (captured in neither)\n' "$name:"; return
    fi
    if [ -z "$files_a" ] || [ -z "$files_b" ]; then
        printf '%-13s MISSING in %s (captured only in %s)\n' "$name:" \
            "$([ -z "$files_a" ] && echo "$A" || echo "$B")" "$([ -z "$files_a" ] && echo "$B" || echo "$A")"
        status=1; return
    fi
    all=$(printf '%s\n%s\n' "$files_a" "$files_b" | sort -u)
    for f in $all; do
        n=$((n + 1))
        if [ ! -e "$A/$f" ]; then missing+=" +$f"; continue; fi
        if [ ! -e "$B/$f" ]; then missing+=" -$f"; continue; fi
        if ! cmp -s "$A/$f" "$B/$f"; then diffs+=" $f"; fi
    done
    if [ -z "$diffs$missing" ]; then
        printf '%-13s IDENTICAL (%d files)\n' "$name:" "$n"
    else
        status=1
        printf '%-13s DIFFERENT:%s%s\n' "$name:" "${diffs:+ changed$diffs}" "${missing:+ only-in-one$missing}"
        for f in $diffs; do
            details+="--- $f"$'\n'
            details+=$(python3 - "$A/$f" "$B/$f" <<'EOF'
import json, sys

def walk(a, b, path, out):
    if type(a) is not type(b):
        out.append(f"{path}: {json.dumps(a)[:120]} -> {json.dumps(b)[:120]}")
    elif isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a:
                out.append(f"{path}.{k}: only in B")
            elif k not in b:
                out.append(f"{path}.{k}: only in A")
            else:
                walk(a[k], b[k], f"{path}.{k}" if path else k, out)
    elif isinstance(a, list):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} -> {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {json.dumps(a)[:120]} -> {json.dumps(b)[:120]}")

try:
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
except ValueError:
    import difflib
    a, b = (open(p, errors="replace").read().splitlines() for p in sys.argv[1:3])
    lines = list(difflib.unified_diff(a, b, "A", "B", lineterm="", n=1))[2:]
    for line in lines[:40]:
        print("  " + line)
    if len(lines) > 40:
        print(f"  ... {len(lines) - 40} more diff lines (-v shows them all)")
    sys.exit()
out = []
walk(a, b, "", out)
for line in out[:40]:
    print("  " + line)
if len(out) > 40:
    print(f"  ... {len(out) - 40} more")
EOF
)$'\n'
            if [ $verbose = 1 ]; then details+=$(diff -u "$A/$f" "$B/$f" | head -200)$'\n'; fi
        done
    fi
}

compare_part help 'help/*'
compare_part data 'data/*'
compare_part losses 'losses/*'
compare_part export/fresh 'export/fresh_*'
compare_part export/top10 'export/top10.json'

if [ -n "$details" ]; then
    echo
    echo "details (A=$A, B=$B):"
    printf '%s' "$details"
fi
exit $status
