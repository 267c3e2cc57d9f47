"""Fresh processes for the multi-process tests (DDP ranks, an isolated fit), without importing the training stack in
each.

A process spawned as a fresh interpreter imports torch, Lightning and vitrel again: about 8 s of CPU, most of what a
test of two tiny DDP ranks costs. Multiprocessing's ``forkserver`` start method starts one fresh interpreter (the
server) that imports :data:`PRELOAD` once; each process is then forked from it. Such a process starts as a spawned
one does, from an interpreter that has run no test (no autograd threads, which a fork of the pytest worker would
inherit in a bad state), with the modules already imported. The server lives as long as the pytest process.

A process gets the server's environment, taken when the first call in the pytest process started it, not the test
process's at the call: the tests' processes set what they need themselves (``MASTER_ADDR``, ``LOCAL_RANK`` ...).
"""

from __future__ import annotations

import multiprocessing

#: what the server imports once (the tests' own modules then import quickly in each process)
PRELOAD = ["vitrel.train.run", "tests.train_helpers"]


def preloaded() -> str:
    """The start method for ``torch.multiprocessing.start_processes`` (``multiprocessing.get_context``): the
    forkserver, set to import :data:`PRELOAD` when it starts."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def start(target, *args) -> multiprocessing.Process:
    """``target(*args)`` in a process forked from the server, started (the caller waits for it, or kills it)."""
    proc = multiprocessing.get_context(preloaded()).Process(target=target, args=args)
    proc.start()
    return proc


def run(target, *args, timeout: float = 300) -> None:
    """``target(*args)`` in a process forked from the server, waited for: it must end, with exit code 0, within
    ``timeout`` s (else it is killed and the test fails)."""
    proc = start(target, *args)
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"{target.__name__}{args} did not end within {timeout} s")
    assert proc.exitcode == 0, f"{target.__name__}{args} failed (exit code {proc.exitcode}; its error is above)"


def run_ranks(target, *args, nprocs: int = 2) -> None:
    """``target(rank, port, *args)`` in ``nprocs`` processes forked from the server (``torch.multiprocessing``), with a
    free local port for their process group (``MASTER_PORT``), waited for."""
    import socket

    import torch.multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(target, args=(port, *args), nprocs=nprocs, start_method=preloaded())
