"""The answering side of the trigger runtime: a child process of ``consume --airflow`` that
serves trigger code's requests as Airflow's triggerer supervisor does.

Why a process of its own: Airflow's server-side code (the execution API's routes,
``Connection.get_connection_from_secrets``, ``Variable.get``) takes the Task SDK path, back
through ``SUPERVISOR_COMMS``, whenever ``task_runner.SUPERVISOR_COMMS`` exists in its
process, which it must in the consumer for trigger code. Airflow splits the two the same way
(triggerer supervisor / trigger runner subprocess). Here ``_AIRFLOW_PROCESS_CONTEXT=server``
gives Airflow's server secrets chain (``airflow.cfg``: environment, custom backends,
metastore), and the database work never runs on the consumer's event loop.

Every answer is Airflow's own code: the request is decoded with the triggerer's
``ToTriggerSupervisor`` and handled by ``TriggerRunnerSupervisor._handle_request`` (the
``request_handlers`` functions on an execution API ``Client`` over Airflow's in-process
transport, with its retries); errors are mapped by ``WatchedSubprocess.handle_requests``
(``ErrorResponse(API_SERVER_ERROR)`` for a server error or any exception, so a database
outage fails that request, never this process). Requests run on ``WORKERS`` threads, so a
slow one does not hold the others; frames are Airflow's (``_RequestFrame`` in,
``_ResponseFrame`` out, length-prefixed msgpack).

Run as ``python -m triggerflow.airflow.runtime_server FD`` (``runtime.RuntimeProcess``
starts it); it exits when the consumer's end of the socket closes.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import structlog
from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor
from airflow.sdk.api.client import Client
from airflow.sdk.execution_time.comms import _RequestFrame
from airflow.sdk.execution_time.supervisor import WatchedSubprocess

WORKERS = 4  # Airflow's SQLAlchemy pool holds 5 connections by default
IN_PROCESS_URL = "http://in-process.invalid./"  # what the triggerer's make_client sets

log = logging.getLogger("triggerflow.airflow.runtime")


class LockedSocket:
    """The ``stdin`` Airflow's ``send_msg`` writes whole frames to, shared by the workers."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()

    def sendall(self, data: bytes) -> None:
        with self._lock:
            self._sock.sendall(data)


class Answerer:
    """The part of a ``TriggerRunnerSupervisor`` that answers trigger code, one per worker
    thread: Airflow's methods, bound to what they read of ``self``."""

    decoder = TriggerRunnerSupervisor.decoder
    _subprocess_schema_version = None  # the trigger code runs this very Airflow
    _handle_request: Any = TriggerRunnerSupervisor._handle_request
    handle_requests: Any = WatchedSubprocess.handle_requests
    # Airflow 3.3's request/response schema migration; 3.2's handle_requests calls neither.
    _deserialize_request: Any = getattr(WatchedSubprocess, "_deserialize_request", None)
    _serialize_response: Any = getattr(WatchedSubprocess, "_serialize_response", None)
    send_msg: Any = WatchedSubprocess.send_msg

    def __init__(self, client: Client, stdin: LockedSocket) -> None:
        self.client = client
        self.stdin = stdin
        self._last_runner_comms = 0.0
        self.requests: Generator[None, _RequestFrame, None] = self.handle_requests(
            structlog.get_logger("triggerflow.airflow.runtime"))
        next(self.requests)

    def answer(self, frame: _RequestFrame) -> None:
        self.requests.send(frame)


class RuntimeServer:
    def __init__(self, sock: socket.socket, workers: int = WORKERS) -> None:
        self.sock = sock
        self.stdin = LockedSocket(sock)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="airflow-runtime")
        self.local = threading.local()
        self.decoder = msgspec.msgpack.Decoder(_RequestFrame)
        from airflow.jobs.triggerer_job_runner import in_process_api_server

        self.transport = in_process_api_server().transport  # the app built before serving

    def _answerer(self) -> Answerer:
        answerer: Answerer | None = getattr(self.local, "answerer", None)
        if answerer is None:
            # One client per thread over the one in-process app, as the triggerer builds it.
            client = Client(base_url=None, token="", dry_run=True, transport=self.transport)
            client.base_url = IN_PROCESS_URL
            answerer = self.local.answerer = Answerer(client, self.stdin)
        return answerer

    def _answer(self, frame: _RequestFrame) -> None:
        try:
            self._answerer().answer(frame)
        except Exception:  # handle_requests answers every error; this is a write failure
            log.exception("could not answer trigger request %s", frame.id)

    def _read_exactly(self, n: int) -> bytes | None:
        chunks = bytearray()
        while len(chunks) < n:
            chunk = self.sock.recv(n - len(chunks))
            if not chunk:
                return None
            chunks.extend(chunk)
        return bytes(chunks)

    def serve(self) -> None:
        while (header := self._read_exactly(4)) is not None:
            body = self._read_exactly(int.from_bytes(header, "big"))
            if body is None:
                break
            self.pool.submit(self._answer, self.decoder.decode(body))
        self.pool.shutdown(wait=True, cancel_futures=True)


def main(argv: list[str]) -> int:
    # Read at each secrets lookup: the server chain, metastore included.
    os.environ["_AIRFLOW_PROCESS_CONTEXT"] = "server"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s airflow-runtime %(message)s")
    server = RuntimeServer(socket.socket(fileno=int(argv[1])))
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
