"""transformers config.json files for the GPU scripts, as transformers saves them, with max_position_embeddings
POSITIONS: Llama (a 1.5 B and Llama 3 8B's shape), and the held-out shapes of reports/records/plans_h200x2.md's
session 27 (a Qwen2 1.5 B as Qwen publishes it, a Mistral of 16 layers of Mistral 7B's width, GPT-2 medium) and
session 30 (Llama 3.2 3B's published shape, tied; GPT-2 large), the two declared in session 31 (Qwen2.5 3B's and
Mistral 7B v0.3's published shapes), the two declared in session 32 (Qwen2.5 7B's, GPT-2 XL's) and the two
declared in session 33 (SmolLM2 1.7B's, Qwen2.5 0.5B's: seen before, withdrawn in session 34) and the one
declared in session 34 in its place (SmolLM2 360M's).

    python3 tests/gpu/hf_configs.py OUT_DIR POSITIONS     # OUT_DIR/NAME.json for every NAME below
"""
import json
import sys


def decoder(arch, kind, layers, hidden, heads, kv, ffn, vocab, tied, theta):
    """A Llama-style config (Llama, Qwen2, Mistral)."""
    return lambda positions: {
        "architectures": [arch], "model_type": kind, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv, "num_hidden_layers": layers, "intermediate_size": ffn, "vocab_size": vocab,
        "max_position_embeddings": positions, "rope_theta": theta, "tie_word_embeddings": tied}


SHAPES = {"llama1.5b": decoder("LlamaForCausalLM", "llama", 16, 2048, 32, 8, 8192, 128256, False, 500000.0),
          "llama8b": decoder("LlamaForCausalLM", "llama", 32, 4096, 32, 8, 14336, 128256, False, 500000.0),
          "qwen1.5b": decoder("Qwen2ForCausalLM", "qwen2", 28, 1536, 12, 2, 8960, 151936, True, 1000000.0),
          "llama3b": decoder("LlamaForCausalLM", "llama", 28, 3072, 24, 8, 8192, 128256, True, 500000.0),
          "mistral16": decoder("MistralForCausalLM", "mistral", 16, 4096, 32, 8, 14336, 32768, False, 1000000.0),
          "qwen3b": decoder("Qwen2ForCausalLM", "qwen2", 36, 2048, 16, 2, 11008, 151936, True, 1000000.0),
          "mistral7b": decoder("MistralForCausalLM", "mistral", 32, 4096, 32, 8, 14336, 32768, False, 1000000.0),
          "qwen7b": decoder("Qwen2ForCausalLM", "qwen2", 28, 3584, 28, 4, 18944, 152064, False, 1000000.0),
          "smollm2": decoder("LlamaForCausalLM", "llama", 24, 2048, 32, 32, 8192, 49152, True, 130000.0),
          "qwen0.5b": decoder("Qwen2ForCausalLM", "qwen2", 24, 896, 14, 2, 4864, 151936, True, 1000000.0),
          "smollm2-360m": decoder("LlamaForCausalLM", "llama", 32, 960, 15, 5, 2560, 49152, True, 100000.0),
          "gpt2-medium": lambda positions: {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 1024,
                                            "n_layer": 24, "n_head": 16, "n_positions": positions,
                                            "vocab_size": 50257, "tie_word_embeddings": True},
          "gpt2-large": lambda positions: {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 1280,
                                           "n_layer": 36, "n_head": 20, "n_positions": positions,
                                           "vocab_size": 50257, "tie_word_embeddings": True},
          "gpt2-xl": lambda positions: {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 1600,
                                        "n_layer": 48, "n_head": 25, "n_positions": positions,
                                        "vocab_size": 50257, "tie_word_embeddings": True}}

if __name__ == "__main__":
    out, positions = sys.argv[1], int(sys.argv[2])
    for name, config in SHAPES.items():
        with open(f"{out}/{name}.json", "w") as f:
            json.dump(config(positions), f)
