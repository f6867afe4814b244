"""A hardware fault told from the run's own code failing, by how its process ended."""

from __future__ import annotations

import signal

from services.trainer.faults import HARDWARE, fault_of


def test_a_sigbus_or_the_cuda_runtimes_words_for_failed_hardware_are_a_hardware_fault() -> None:
    assert fault_of(-signal.SIGBUS, "") == HARDWARE
    ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
    assert fault_of(1, ecc) == HARDWARE
    assert fault_of(1, "... GPU has fallen off the bus ...") == HARDWARE


def test_the_runs_own_failures_are_its_own() -> None:
    for code, tail in (
        (1, "RuntimeError: CUDA error: an illegal memory access was encountered"),
        (1, "torch.OutOfMemoryError: CUDA out of memory."),
        (-signal.SIGKILL, ""),  # the OOM killer, or an operator: not a hardware fault
        (-signal.SIGSEGV, ""),
    ):
        assert fault_of(code, tail) == "", (code, tail)
