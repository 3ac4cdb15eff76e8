"""The journal's exceptions: a tiny public surface an agent can catch."""


class JournalError(Exception):
    """Base of the journal's own errors."""


class StepMismatch(JournalError):
    """A saved step has another name than the one now asked for: the agent is no longer deterministic."""

    def __init__(self, run_id: str, step: int, saved: str, asked: str) -> None:
        super().__init__(
            f"run {run_id} step {step} was saved as {saved!r} but is now asked for as {asked!r}: the agent "
            "no longer calls its steps in the same order (put anything variable inside a step)"
        )
        self.run_id, self.step, self.saved, self.asked = run_id, step, saved, asked


class NotJSON(JournalError):
    """A step returned something that cannot be saved as JSON; nothing was saved."""

    def __init__(self, step: int, name: str, reason: str) -> None:
        super().__init__(
            f"step {step} ({name!r}) returned output that is not JSON ({reason}); nothing was saved"
        )
        self.step, self.name = step, name


class RunFinished(JournalError):
    """Steps were asked of a run that already completed."""
