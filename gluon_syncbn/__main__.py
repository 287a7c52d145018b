"""``python -m gluon_syncbn [--selftest]``: see :mod:`gluon_syncbn.report`."""
from gluon_syncbn.report import main

main()
