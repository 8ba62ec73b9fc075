"""transformers' LlamaForCausalLM config.json files for the GPU scripts: a 1.5 B and Llama 3 8B's shape, as
transformers saves them, with max_position_embeddings POSITIONS.

    python3 tests/gpu/llama_configs.py OUT_DIR POSITIONS     # OUT_DIR/llama1.5b.json, OUT_DIR/llama8b.json
"""
import json
import sys

SHAPES = {"llama1.5b": (16, 2048, 32, 8, 8192), "llama8b": (32, 4096, 32, 8, 14336)}  # layers, hidden, heads, kv, ffn

if __name__ == "__main__":
    out, positions = sys.argv[1], int(sys.argv[2])
    for name, (layers, hidden, heads, kv, ffn) in SHAPES.items():
        with open(f"{out}/{name}.json", "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
                       "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": layers,
                       "intermediate_size": ffn, "vocab_size": 128256, "max_position_embeddings": positions,
                       "rope_theta": 500000.0, "tie_word_embeddings": False}, f)
