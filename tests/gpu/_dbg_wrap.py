import faulthandler
import sys

faulthandler.dump_traceback_later(int(sys.argv[1]), exit=True)
from autotune.__main__ import main  # noqa: E402

sys.exit(main(sys.argv[2:]))
