"""What pagedkv_np says during a long wait: the ``pagedkv_np`` logger.

Library calls that can take seconds log one INFO line when they start, saying
what they do and how long it usually takes, and one when they are done:
compiling the Numba kernels (:func:`pagedkv_np.warmup`, or their first use
when nothing is cached yet), importing a GGUF file (the tokenizer is built
then too), hashing a model's files for the storage tiers. Every module logs
under the ``pagedkv_np`` logger (``logging.getLogger(__name__)``), and Python
shows nothing below WARNING until the application asks, so a library call
stays silent unless you want the lines::

    import logging
    logging.basicConfig(level=logging.INFO)   # every library's INFO lines, or
    logging.getLogger("pagedkv_np").setLevel(logging.INFO)   # with a handler of yours

The ``pagedkv`` command shows them on stderr (:func:`show_progress`), and
``--quiet`` hides them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

__all__ = ["LOGGER_NAME", "long_wait", "show_progress"]

LOGGER_NAME = "pagedkv_np"

_HANDLER_NAME = "pagedkv-cli"


@contextmanager
def long_wait(logger: logging.Logger, what: str, estimate: str) -> Iterator[None]:
    """Log ``what`` and ``estimate`` at INFO before the block, and its time after.

    Parameters
    ----------
    logger : logging.Logger
        The calling module's logger (a child of ``pagedkv_np``).
    what : str
        What the block does, as a clause: ``"importing model.gguf"``.
    estimate : str
        How long it usually takes and whether it happens again:
        ``"about 20 s on 2 cores, once; then cached"``.
    """
    logger.info("%s (%s) ...", what, estimate)
    start = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - start)


def show_progress(quiet: bool = False, stream: IO[str] | None = None) -> logging.Handler:
    """Print the ``pagedkv_np`` logger's lines on ``stream`` (stderr), as the
    ``pagedkv`` command does; with ``quiet``, only warnings and errors.

    Calling it again replaces the handler it added before, so a process that
    runs the command twice prints each line once.

    Returns
    -------
    logging.Handler
        The handler added to the ``pagedkv_np`` logger.
    """
    logger = logging.getLogger(LOGGER_NAME)
    for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("pagedkv: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    return handler
