#!/usr/bin/env bash
# SmolLM2-135M-Instruct in the Hugging Face form vLLM loads, converted once from the GGUF that
# `make model` fetches (transformers dequantizes its Q4_1 weights to f32 and writes
# model.safetensors, the tokenizer and the chat template) into .cachet/models/smollm2-hf/.
# A directory whose files match the recorded SHA-256 sums is reused.
#
#   scripts/vllm-model.sh [python of the vLLM venv]      (prints the directory)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$(scripts/vllm-env.sh)}
GGUF=${CACHET_MODEL_PATH:-.cachet/models/SmolLM2-135M-Instruct.Q4_1.gguf}
DEST=${CACHET_VLLM_MODEL_DIR:-.cachet/models/smollm2-hf}
# The conversion is deterministic: these are its outputs' sums (checked on two conversions).
SUMS=connectors/vllm/model.sha256
check() { [ -f "$DEST/model.safetensors" ] && (cd "$DEST" && sha256sum --quiet -c "$OLDPWD/$SUMS" >/dev/null 2>&1); }
if check; then echo "$DEST"; exit 0; fi
scripts/fetch-model.sh
rm -rf "$DEST.part"
"$PY" - "$GGUF" "$DEST.part" >&2 <<'PY'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32)
# save_pretrained refuses a "GGUF-quantized" model; the weights are plain f32 by now.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tok.save_pretrained(out)
PY
rm -rf "$DEST"
mv "$DEST.part" "$DEST"
if [ -f "$SUMS" ]; then
  check || { echo "vllm-model: converted files in $DEST do not match $SUMS" >&2; exit 1; }
fi
echo "$DEST"
