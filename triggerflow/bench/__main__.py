"""``python -m triggerflow.bench sdk-worker ...``: the SDK process of the defer scenario."""

import sys

from triggerflow.bench.defer import _worker_main

if sys.argv[1:2] != ["sdk-worker"]:
    sys.exit("usage: python -m triggerflow.bench sdk-worker ...  (run `triggerflow bench`)")
sys.exit(_worker_main(sys.argv[2:]))
