"""Run 20's model: ``python3 scale_model.py SRC OUT [HIDDEN LAYERS HEADS KV_HEADS FFN]`` writes an
mlx-community directory shaped like a ~1B Llama (default 2048 hidden, 16 layers, 32 heads of 64,
8 KV heads, 8192 FFN: Llama 3.2 1B's shape) with random weights, quantized to 4 bits in groups
of 32 as the default model is, and SRC's tokenizer and chat template (SRC: ``stepserve convert``
of the default GGUF). Its answers are noise; its step times are a 1B model's. For timing only."""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama

src, out = Path(sys.argv[1]), Path(sys.argv[2])
hidden, layers, heads, kv_heads, ffn = (int(x) for x in (sys.argv[3:8] or (2048, 16, 32, 8, 8192)))
config = json.loads((src / "config.json").read_text())
config.update(
    hidden_size=hidden,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv_heads,
    head_dim=hidden // heads,
    intermediate_size=ffn,
    quantization={"group_size": 32, "bits": 4},
)
mx.random.seed(0)
model = llama.Model(llama.ModelArgs.from_dict(config))
model.set_dtype(mx.float16)
nn.quantize(model, group_size=32, bits=4)
out.mkdir(parents=True, exist_ok=True)
mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
(out / "config.json").write_text(json.dumps(config, indent=2))
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(src / name, out / name)
params = sum(v.size for _, v in tree_flatten(llama.Model(llama.ModelArgs.from_dict(config)).parameters()))
print(f"wrote {out}: {params / 1e9:.2f}B parameters")
