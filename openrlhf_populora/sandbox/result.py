"""What one sandboxed job returns."""

from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The verdict of one ``(code, expr)`` job.

    status: "ok"           expr evaluated; ``value`` is ``repr()`` of it (a str of at most max_output_chars)
            "error"        code or expr raised (SyntaxError included); ``error`` is "ExceptionType: message"
            "timeout"      the wall-clock deadline (timeout_s) or the CPU-seconds limit was hit; killed from outside
            "memory"       MemoryError under the address-space limit (memory_mb)
            "output_limit" the repr exceeded max_output_chars, or printed output exceeded max_stdout_chars
            "killed"       the job process ended without a verdict (os._exit, a signal, its worker died)
    wall_s: seconds the job occupied its worker (for jobs sharing one ``code``, the code's single exec is
            counted in the first of them).
    """

    status: str
    value: str | None = None
    error: str | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"
