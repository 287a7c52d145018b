"""MXNet 1.9.1 alone, no gluon_syncbn: operations failing on several CPU
contexts at the same moment, then ``waitall``, in fresh processes. Counts the
runs that died (a corrupted list of pending engine errors: see
docs/findings.md, 2026-11-24). Not a test; run it by hand:

    python tests/mxnet_error_list_race.py --runs 40
"""
import argparse
import os
import subprocess
import sys

# One process: every device's take waits on the same input, so they fail together.
ONE_RUN = '''
import mxnet as mx
ctxs = [mx.cpu(i) for i in range(%(devices)d)]
src = [mx.nd.zeros((1,), ctx=c) for c in ctxs]
bad = [mx.nd.ones((64,), ctx=c) for c in ctxs]
gate = mx.nd.zeros((1,))
mx.nd.waitall()
for _ in range(%(steps)d):
    outs = [mx.nd.take(s, b + gate.as_in_context(b.context), mode='raise')
            for s, b in zip(src, bad)]
    for o in outs:
        try:
            o.wait_to_read()
        except mx.base.MXNetError:
            pass
    try:
        mx.nd.waitall()
    except mx.base.MXNetError:
        pass
print('done')
'''


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--runs', type=int, default=40)
    parser.add_argument('--devices', type=int, default=4)
    parser.add_argument('--steps', type=int, default=20)
    args = parser.parse_args(argv)
    code = ONE_RUN % dict(devices=args.devices, steps=args.steps)
    died = 0
    for _ in range(args.runs):
        try:
            proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                                  timeout=120, env=dict(os.environ, MXNET_CPU_TEMP_COPY='16'))
            died += proc.returncode != 0 or 'done' not in proc.stdout
        except subprocess.TimeoutExpired:
            died += 1
    print('%d of %d runs died' % (died, args.runs))


if __name__ == '__main__':
    main()
