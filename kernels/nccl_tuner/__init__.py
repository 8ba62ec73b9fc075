"""commtune's NCCL tuner plugin (``tuner.c``): NCCL's algorithm, protocol and channel
count per call, read from a table (``table``) that ``python -m autotune nccl`` measures.

    python -m kernels build-tuner                 # cc -> kernels/nccl_tuner/build/libnccl-tuner-commtune.so
    NCCL_TUNER_PLUGIN=<that .so> COMMTUNE_NCCL_TUNER_TABLE=<table.csv> <any NCCL job>
"""
