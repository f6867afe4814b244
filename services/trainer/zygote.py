"""The zygote: one process per trainer that imports torch once and forks a training process
for each attempt, so an attempt starts in milliseconds instead of after a second or more of
imports — even when short jobs come faster than a process could import torch.

Why fork is safe here: the zygote has imported torch and nothing else has run — no model,
no tensor op, so no intra-op thread pool; torch's own fork handlers (the ones its DataLoader
workers rely on, forked the same way) cover what the import set up. CUDA is never touched
in the zygote: a forked child initialises it itself, after the fork.

The protocol, on a Unix socket pair with the trainer (bytes, never pickle):

    trainer -> zygote   b"fork\\n" with three descriptors (SCM_RIGHTS): the child's control
                        pipe in, its control pipe out, and its stdout/stderr
    zygote -> trainer   b"ready\\n"                  once, when torch is imported
                        b"forked <pid>\\n"           after each fork, in order
                        b"exited <pid> <code>\\n"    when a child ends (code < 0: a signal)

A forked child leads its own session (the trainer kills its process group) and dies with the
zygote, which dies with the trainer (parent-death signals all the way down). The zygote ends
when the trainer closes its end of the socket.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import socket
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
FORK = b"fork"


def serve(sock_fd: int, run: Callable[[int, int], int]) -> int:
    """Fork a child running `run(ctl_in, ctl_out)` for each request, until the trainer goes.
    Called once torch is imported (`child.main`)."""
    sock = socket.socket(fileno=sock_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    sock.sendall(b"ready\n")
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                request, fds, _flags, _addr = socket.recv_fds(sock, 64, 3)
                if not request:
                    return 0  # the trainer closed the socket: it is gone or stopping
                if request.strip() != FORK or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    _become_child(sock, (wake_r, wake_w), fds)
                    # `run` may end the process itself; if it returns, a normal exit.
                    sys.exit(run(fds[0], fds[1]))
                for fd in fds:
                    os.close(fd)
                sock.sendall(f"forked {pid}\n".encode())
            else:
                os.read(wake_r, 4096)
                _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.sendall(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _become_child(sock: socket.socket, wake: tuple[int, int], fds: list[int]) -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    for fd in wake:
        os.close(fd)
    os.setsid()  # its own process group: the trainer kills it and whatever it spawns
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the zygote died between the fork and the prctl
        os._exit(1)
    output = fds[2]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(devnull)
    os.close(output)
