"""``python -m tests.scenarios NAME JSON_KWARGS``: run one scenario (see the
package's docstring); ``--batch JSON_LIST`` runs several in order."""
import json
import os
import sys
import time

import mxnet as mx

from tests.scenarios import SCENARIOS
# Every family, for the scenarios it registers.
from tests.scenarios import (amp, convert, empty_slices, faults, gpu_path, head_dtypes, layer,
                             native, native_transport, networks, numpy_mode, precise_bn, run_ahead,
                             sync_groups, threads)

FAMILIES = (amp, convert, empty_slices, faults, gpu_path, head_dtypes, layer, native,
            native_transport, networks, numpy_mode, precise_bn, run_ahead, sync_groups, threads)


def run(name, kwargs):
    start = time.time()
    result = SCENARIOS[name](**kwargs)
    mx.nd.waitall()
    result.setdefault('seconds', time.time() - start)
    return result


def main():
    """``NAME JSON`` runs one scenario; ``--batch JSON_LIST`` runs ``[[name, kwargs], ...]``
    in order, printing ``RESULT <index> {...}`` after each."""
    if os.environ.get('SCENARIO_TRACEBACK_AFTER'):
        # A scenario that hangs prints where every thread waits before it is killed.
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ['SCENARIO_TRACEBACK_AFTER']))
    if sys.argv[1] == '--batch':
        for i, (name, kwargs) in enumerate(json.loads(sys.argv[2])):
            print('RESULT %d %s' % (i, json.dumps(run(name, kwargs))))
            sys.stdout.flush()
        return
    kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print('RESULT ' + json.dumps(run(sys.argv[1], kwargs)))
    sys.stdout.flush()


if __name__ == '__main__':
    main()
