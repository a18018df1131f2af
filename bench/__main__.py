"""``python -m bench sdk-worker|reference-worker ...``: the helper processes
of the defer scenario and of the burst reference."""

import sys

if sys.argv[1:2] == ["sdk-worker"]:
    from bench.defer import _worker_main
elif sys.argv[1:2] == ["reference-worker"]:
    from bench.reference import _worker_main
else:
    sys.exit("usage: python -m bench sdk-worker|reference-worker ...  "
             "(run `triggerflow bench`)")
sys.exit(_worker_main(sys.argv[2:]))
