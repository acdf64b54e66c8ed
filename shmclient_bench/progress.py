"""Progress lines of a run on stderr: ``Progress``.

Each line is stamped with the seconds since the run began; on a terminal a ticker adds
a line when a long block has printed nothing for a while. Output only: it imports
nothing of the benchmark.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any


class Progress:
    """Progress lines on stderr, each stamped with the seconds since the run began.

    ``start_ticker()`` adds, when the stream is a terminal, a line every ``every_s``
    seconds that nothing else was printed (a long block is still running); it prints
    nothing when the stream is a file or a pipe.
    """

    def __init__(self, stream: Any = None, every_s: float = 10.0) -> None:
        self.t0 = time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.phase = ""
        self._last = self.t0
        self._phase_t = self.t0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        now = time.perf_counter()
        with self._lock:
            self.phase, self._phase_t, self._last = msg, now, now
            print(f"[bench {now - self.t0:6.1f}s] {msg}", file=self.stream, flush=True)

    def is_terminal(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except (AttributeError, ValueError):
            return False

    def start_ticker(self) -> None:
        if self._ticker is not None or not self.is_terminal():
            return
        self._ticker = threading.Thread(target=self._tick, name="bench-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 2)):
            now = time.perf_counter()
            with self._lock:
                if now - self._last < self.every_s or not self.phase:
                    continue
                self._last = now
                print(
                    f"[bench {now - self.t0:6.1f}s] ... still at: {self.phase} "
                    f"({now - self._phase_t:.0f} s)",
                    file=self.stream,
                    flush=True,
                )

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(5)
            self._ticker = None
