"""Typed errors. Input errors subclass TypeError/ValueError so callers can catch the builtin kind."""


class KernelsError(Exception):
    """Base of every error this package raises on purpose."""


class InputTypeError(KernelsError, TypeError):
    """A tensor argument has the wrong type or dtype."""


class InputValueError(KernelsError, ValueError):
    """A tensor argument has the wrong shape, device or stride."""


class BuildError(KernelsError):
    """A candidate failed to render or compile. `log_path` points at the compiler output when there is one."""

    def __init__(self, message: str, log_path: str | None = None):
        super().__init__(message if log_path is None else f"{message} (see {log_path})")
        self.log_path = log_path


class VerificationError(KernelsError):
    """A candidate computed a wrong result."""


class NoCandidateError(KernelsError):
    """Every candidate failed; carries the per-choice failures."""

    def __init__(self, problem_key: str, failures: dict[str, str]):
        lines = "\n".join(f"  {name}: {why}" for name, why in failures.items())
        super().__init__(f"no candidate could run {problem_key}:\n{lines}")
        self.failures = failures
