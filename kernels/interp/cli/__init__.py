"""The interpreter's commands: ``python -m kernels bench`` (``bench.py``), ``peers``
(``peers.py``) and ``tp-mlp`` (``tp_mlp.py``); the library they drive is ``kernels.interp``."""
