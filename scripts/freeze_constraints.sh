#!/usr/bin/env bash
# Rewrites constraints.txt from the current environment after the test suite
# passed in it:  scripts/freeze_constraints.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python}"
HEADER="$(sed -n '/^#/p;/^#/!q' constraints.txt)"
{ printf '%s\n' "$HEADER"
  "$PY" -m pip freeze --exclude-editable | grep -v -i '^hypermixer' | grep -v '@ file'
} > constraints.txt.new
mv constraints.txt.new constraints.txt
