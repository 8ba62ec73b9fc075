"""The SBP search's commands: ``python -m autotune`` (the search, ``search.py``),
``autotune validate`` (``validate.py``), ``autotune reproduce`` (``reproduce.py``) and
``autotune explain`` (``explain.py``); the library they drive is ``autotune.sbp``."""
