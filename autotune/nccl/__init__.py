"""``python -m autotune nccl``: stock NCCL tuned through commtune's tuner plugin
(kernels/nccl_tuner): measure NCCL's settings per collective and size, choose per size
band, write the plugin's table and env file, re-measure NCCL default against tuned."""
