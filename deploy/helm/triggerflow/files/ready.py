"""`helm test`: exit 0 once every URL (argv[2:]) answered 200, retrying for argv[1] seconds."""

import http.client
import sys
import time
import urllib.request

deadline = time.monotonic() + float(sys.argv[1])
pending = sys.argv[2:]
while True:
    for url in list(pending):
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                print(url, reply.status, reply.read(500).decode(errors="replace"), flush=True)
            pending.remove(url)
        # Refused, timed out, or an HTTP error (503: not ready).
        except (OSError, http.client.HTTPException) as exc:
            print(url, exc, flush=True)
    if not pending or time.monotonic() >= deadline:
        break
    time.sleep(2)
sys.exit(1 if pending else 0)
