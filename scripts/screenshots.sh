#!/usr/bin/env bash
# Render the HTML reports in a real headless browser and keep the screenshots: a small campaign
# (heatmaps, tables) and the training demo (story, loss plot with deaths / rollbacks /
# corrections, fault plan, events). Needs Chromium (Debian: apt-get install chromium).
# Usage: scripts/screenshots.sh [out-dir]   (default docs/screenshots; `make screenshots`)
set -euo pipefail
out=${1:-docs/screenshots}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
    echo "screenshots: no Chromium on PATH (Debian: apt-get install chromium)" >&2
    exit 2
fi
runs=runs/screenshots
mkdir -p "$out" "$runs"
.venv/bin/attnchecker campaign --out "$runs/campaign" --families gpt2 llama \
    --sites q scores context dk dw.q --kinds nan inf,-inf exponent_flip --trials 2 --steps 2
.venv/bin/attnchecker demo --out "$runs/demo"
for name in campaign demo; do
    "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1200,3000 \
        --screenshot="$PWD/$out/$name.png" "file://$PWD/$runs/$name/report.html" 2>/dev/null
    echo "screenshots: $out/$name.png"
done
