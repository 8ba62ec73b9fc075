#!/usr/bin/env bash
# The allocator setting end to end on one GPU (nvidia-h200, about 2 minutes): calibrate module under expandable
# segments records them with its fragmentation; a search with --expandable-segments takes that figure and records
# the allocator in its plan; execute refuses the plan in one line without the setting and runs it with it.
#   OUT=$OUT bash tests/gpu/allocator_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/allocator-out}
W=out/gpu/alloc
mkdir -p "$W" "$OUT"
python3 -c "import json; json.dump({'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 512,
  'num_attention_heads': 8, 'num_key_value_heads': 4, 'head_dim': 64, 'num_hidden_layers': 4,
  'intermediate_size': 1536, 'vocab_size': 32000, 'max_position_embeddings': 1024, 'tie_word_embeddings': False},
  open('$W/cfg.json', 'w'))"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 python3 -m calibrate module --model "$W/cfg.json" \
  --profile h200-nvlink --tensor 1 --micro-batches 2 --sequence 1024 --out "$W/profile.json" > "$OUT/module.log" 2>&1
echo "calibrate module: exit $?"
python3 -c "import json; print('module memory:', json.load(open('$W/profile.json'))['module'].get('memory'))"
timeout 120 python3 -m autotune --model "$W/cfg.json" --batch 4 --micro-batch 2 --sequence 1024 --nodes 1 \
  --gpus-per-node 1 --profile "$W/profile.json" --expandable-segments --compare none --out "$W/plan" \
  > "$OUT/search.log" 2>&1
echo "search: exit $?"; grep -E "^cluster|measure it" "$OUT/search.log"
python3 -c "import json; print('plan allocator:', json.load(open('$W/plan/plan.json'))['best']['allocator'])"
timeout 120 torchrun --nproc-per-node 1 -m autotune execute "$W/plan/plan.json" --steps 4 --warmup 1 --profile-steps 0 > "$OUT/exec-plain.log" 2>&1
echo "execute without the setting: exit $? (want 1 or 2, one line)"; tail -2 "$OUT/exec-plain.log"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 120 torchrun --nproc-per-node 1 -m autotune execute \
  "$W/plan/plan.json" --steps 4 --warmup 1 --profile-steps 0 > "$OUT/exec-expandable.log" 2>&1
echo "execute under the setting: exit $? (want 0)"; tail -3 "$OUT/exec-expandable.log"
