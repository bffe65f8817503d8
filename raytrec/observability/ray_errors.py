"""Ray's error reports on the driver, while a run's output goes to its ``logs/``.

Ray's driver prints each error the cluster reports for the job as it comes: the raylet's "A
worker died or was killed while executing a task by an unexpected system error ..." block when
a process of the job dies, a task killed for memory. While
:class:`~raytrec.observability.run_logs.RunLogs` routes a run's output, :class:`RayErrors` writes
each report to the run's ``driver.log`` instead, and:

- a report of the death of a process raytrec ended on purpose shows nothing more: raytrec's own
  ``rank_died`` event says it. Such a process records itself first (:func:`mark_ending`, in
  Ray's key-value store: a rank carrying out an injected ``kill_rank`` or ``kill_process``
  fault); a rank raytrec releases with ``ray.kill`` exits as Ray intends and is not reported;
- any other report shows as one raytrec line: what Ray reported, and where its message is.

With ``verbose`` the report also shows as Ray prints it. Reports are taken where Ray's listener
prints them (``print_to_stdstream`` in ``ray._private.worker``, called by name from
``listen_error_messages``; Ray's version is pinned in requirements/base.lock).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RayErrors", "ended_on_purpose", "mark_ending", "report_line"]

#: The key-value namespace of the processes raytrec ends on purpose: ``<job>/<node>/<pid>``.
_NAMESPACE = "raytrec_ended"
_PID = re.compile(r"Worker PID: (\d+)")
_NODE = re.compile(r"Node ID: ([0-9a-f]+)")
_IP = re.compile(r"Worker IP address: (\S+)")
_EXIT = re.compile(r"Worker exit type: (\w+)")
_DETAIL = re.compile(r"Worker exit detail: (.+?\.)(?:\s|$)")
_SENTENCE = re.compile(r"(.+?\.)(?:\s|$)")


def _key(job: str, node: str, pid: int | str) -> str:
    return f"{job}/{node}/{pid}"


def mark_ending(why: str) -> None:
    """Records that raytrec ends this Ray worker process on purpose (called by the process just
    before), so that Ray's report of its death stays in the run's logs."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_put

    if not ray.is_initialized():  # not in a Ray worker: nothing reports the death (and asking
        return  # for the runtime context would start a Ray instance)
    with contextlib.suppress(Exception):  # never stands in the way of the ending itself
        context = ray.get_runtime_context()
        key = _key(context.get_job_id(), context.get_node_id(), os.getpid())
        _internal_kv_put(key, why, namespace=_NAMESPACE)


def ended_on_purpose(message: str) -> str | None:
    """Why raytrec ended the process whose death Ray's ``message`` reports (what
    :func:`mark_ending` recorded, taken once); None when it did not, or the message names no
    process."""
    pid, node = _PID.search(message), _NODE.search(message)
    if pid is None or node is None:
        return None
    import ray
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get

    with contextlib.suppress(Exception):
        key = _key(ray.get_runtime_context().get_job_id(), node.group(1), pid.group(1))
        why = _internal_kv_get(key, namespace=_NAMESPACE)
        if why:
            _internal_kv_del(key, namespace=_NAMESPACE)
            return why.decode()
    return None


def report_line(message: str, where: str) -> str:
    """Ray's report ``message`` in one raytrec line, saying that its message is in ``where``."""
    pid = _PID.search(message)
    if pid is None:
        first = _SENTENCE.match(" ".join(message.split()))
        text = first.group(1) if first else " ".join(message.split())
        what = f"an error ({text[:300].rstrip('.')})"
    else:
        ip, exit_type, detail = (p.search(message) for p in (_IP, _EXIT, _DETAIL))
        how = ": ".join(m.group(1).rstrip(".") for m in (exit_type, detail) if m is not None)
        on = f" at {ip.group(1)}" if ip else ""
        what = (
            f"that a process of this job died (pid {pid.group(1)}{on}{', ' + how if how else ''})"
        )
    return f"[raytrec] Ray reports {what}; its message is in {where}"


class RayErrors:
    """Takes Ray's error reports on the driver while installed (module doc). ``write`` gets each
    report as a log line; ``where`` names where they are written, for the console's line."""

    def __init__(
        self,
        write: Callable[[str], None],
        where: Callable[[], str],
        *,
        verbose: bool = False,
        ended: Callable[[str], str | None] = ended_on_purpose,
    ) -> None:
        self.verbose = verbose
        self._write, self._where, self._ended = write, where, ended
        self._ray_print: Callable[..., None] | None = None  # Ray's, once installed
        self._installed = False

    def install(self) -> None:
        """From now on, Ray's reports come here. Call once Ray is connected: Ray's handler of
        forwarded worker lines holds the same function, taken as it connected."""
        from ray._private import worker

        if not self._installed:
            self._ray_print = worker.print_to_stdstream
            worker.print_to_stdstream = self._print
            self._installed = True

    def uninstall(self) -> None:
        """Ray prints its reports again; what processes of this job recorded is dropped."""
        import ray
        from ray._private import worker
        from ray.experimental.internal_kv import _internal_kv_del

        if not self._installed:
            return
        self._installed = False
        if worker.print_to_stdstream == self._print:
            worker.print_to_stdstream = self._ray_print
        with contextlib.suppress(Exception):  # a process that was to end and did not
            if ray.is_initialized():
                job = ray.get_runtime_context().get_job_id()
                _internal_kv_del(f"{job}/", del_by_prefix=True, namespace=_NAMESPACE)

    def _print(self, data: Mapping[str, Any], ignore_prefix: bool = False) -> None:
        # Runs in Ray's listener thread, which ends at the first exception: none escapes.
        ray_print = self._ray_print
        assert ray_print is not None
        if data.get("pid") != "raylet" or not self._installed:  # not a report, or not ours
            ray_print(data, ignore_prefix)
            return
        try:
            for message in data.get("lines", []):
                self.report(message)
        except Exception:
            ray_print(data, ignore_prefix)
            return
        if self.verbose:
            ray_print(data, ignore_prefix)

    def report(self, message: str) -> None:
        """Writes one of Ray's reports, and shows the unexpected ones (module doc)."""
        why = self._ended(message)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        ended = f" (raytrec ended this process: {why})" if why else ""
        self._write(f"{stamp}\tERROR (raylet) -- {message}{ended}\n")
        if why is None and not self.verbose:
            print(report_line(message, self._where()), flush=True)
