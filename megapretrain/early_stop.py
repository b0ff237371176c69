"""A stop signal that arrives while a training process starts, kept instead of killing it.

SIGTERM and SIGUSR1 (SLURM's pre-emption warning) by default end a process at once. During a
training's start-up — importing torch, building the model, joining the process group, loading the
checkpoint — that death is a failure to torchrun, which restarts the job instead of stopping it.
:class:`EarlyStop` keeps such a signal until the trainer takes it over (``hand_over``); the
trainer then stops before its first step, exit status 0.

Importing this module installs it when the process is ``python -m megapretrain.train`` (the
module run as the main program imports it first, before torch: the window left is the
interpreter's own start); anywhere else importing it changes nothing. It imports no more than the
standard library.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

TRAINING_MAIN = "megapretrain.train"


class EarlyStop:
    """SIGTERM and SIGUSR1 from its creation until :meth:`hand_over` (or :meth:`release`)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.name: str | None = None
        self.trainer = None
        self.installed = threading.current_thread() is threading.main_thread()
        if self.installed:  # signals can be caught on the main thread only
            for s in self.SIGNALS:
                signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.trainer is not None:
            self.trainer.request_stop(signal.Signals(signum).name)
        self.name = self.name or signal.Signals(signum).name

    def hand_over(self, trainer) -> None:
        """From now on a stop signal (and the one kept, if any) is ``trainer``'s."""
        self.trainer = trainer
        if self.name is not None:
            trainer.request_stop(self.name)

    def release(self) -> None:
        """The signals' default action again (a process that will not train: ``--check``,
        ``--help``); a signal kept meanwhile takes effect now."""
        if not self.installed:
            return
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        self.installed = False
        if self.name is not None:
            os.kill(os.getpid(), signal.Signals[self.name])


def _training_main() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == TRAINING_MAIN


PENDING: EarlyStop | None = EarlyStop() if _training_main() else None
