"""What a long command is doing: the library's INFO records (logger "superneurons": capture,
planning, host memory, calibration) as timed lines on stderr, and a bar over steps below them.
tqdm draws the bar where installed (the `cli` extra); without it, plain lines say the same."""

import logging
import sys
import time


class Progress:
    """``with Progress() as progress:`` shows the library's phases until the block ends;
    ``steps(n)`` then ``step(loss=...)`` n times for a bar. ``enabled=False`` shows nothing
    (a data-parallel rank other than 0)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.began = time.perf_counter()
        self.bar = self.total = None
        self.done, self.unit = 0, "step"
        self._handler = _Phases(self)
        self._logger = logging.getLogger("superneurons")

    def __enter__(self):
        if self.enabled:
            # the lines are shown here once, not again by a handler the application configured
            self._saved = (self._logger.level, self._logger.propagate)
            self._logger.setLevel(logging.INFO)
            self._logger.propagate = False
            self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._logger.removeHandler(self._handler)
            self._logger.level, self._logger.propagate = self._saved
        self.finish()

    def say(self, text: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.perf_counter() - self.began:7.1f} s] {text}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)      # above the bar, which is drawn again
        else:
            print(line, file=sys.stderr, flush=True)

    def steps(self, total: int, unit: str = "step") -> None:
        """Start a bar over ``total`` steps (the previous one, if any, ends)."""
        self.finish()
        self.total, self.done, self.unit = total, 0, unit
        if not self.enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, unit=unit, file=sys.stderr)

    def step(self, **postfix) -> None:
        """One step done; ``postfix``: what to show beside the bar (loss, speed)."""
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update()
        elif self.total is None or self.done == self.total or \
                self.done % max(1, self.total // 10) == 0:
            # without tqdm: about ten lines a run, not one a step
            shown = ", ".join(f"{k} {v}" for k, v in postfix.items())
            of = f"/{self.total}" if self.total is not None else ""
            self.say(f"{self.unit} {self.done}{of}"
                     + (f": {shown}" if shown else ""))

    def finish(self) -> None:
        """End the bar (before a summary is printed)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _Phases(logging.Handler):
    def __init__(self, progress: Progress):
        super().__init__(logging.INFO)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.say(record.getMessage())
