"""Schedule autotuner (``python -m autotune schedule``): per size band, choose the
GC3 program (algorithm, channels, instances, protocol) and the interpreter's
CUDA-block split from the cost simulation on a fitted profile and, on GPUs, from
measurement beside NCCL; write the tuned table for the interpreter and for NCCL's
tuner plugin."""
