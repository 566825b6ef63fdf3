"""Silencing dp-accounting's ``absl`` log messages while adaclip calls into it.

dp-accounting's RDP code reports numerical trouble through the ``absl`` logger (``WARNING``
level), e.g. ``_compute_log_a_frac failed to converge ... Excluding this order from the epsilon
computation``; the order is then dropped, which can only make ε larger. A calibration can emit
thousands of these, so every part of :mod:`adaclip.accounting` that composes or converts with
dp-accounting (the composers ``_rdp`` and ``_pld``, the calibration) does so inside
:func:`_quiet_dp_accounting_logs`. Python warnings and exceptions are untouched. Importing this
module does not load dp-accounting; the block does, before it looks the logger up, so that
``absl.logging`` has made ``"absl"`` its own logger class by then.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

_ABSL_LOGGER_NAME = "absl"
_QUIET_LEVEL = logging.ERROR
_quiet_lock = threading.Lock()
_quiet_depth = 0  # how many _quiet_dp_accounting_logs blocks are open, in all threads
_quiet_restore: int | None = None  # level to restore when the outermost block exits (None: untouched)


@contextlib.contextmanager
def _quiet_dp_accounting_logs() -> Iterator[None]:
    """Hide the ``absl`` logger's warnings (dp-accounting's) for the duration of the block.

    dp-accounting logs ``_compute_log_a_frac failed to converge ...`` (and a few other
    numerical notices) through ``logging.getLogger("absl")`` at level ``WARNING``; a
    calibration can emit thousands of them. Inside the block that logger's level is raised
    to ``ERROR`` (if it is lower). Blocks nest and may be open in several threads at once: a
    lock and a counter track them, and when the outermost open block exits the level the
    logger had before is restored — unless something else set another level meanwhile, which
    is then kept. Records at ``ERROR`` and above still pass; :func:`warnings.warn` warnings
    and exceptions are untouched (only the ``absl`` logger's level changes). A ``WARNING``
    that another thread logs to ``absl`` while a block is open is hidden as well.
    """
    global _quiet_depth, _quiet_restore
    # lazy: dp-accounting loads SciPy (1-2 s); imported before the lookup so "absl" stays absl's ABSLLogger
    import dp_accounting  # noqa: F401

    logger = logging.getLogger(_ABSL_LOGGER_NAME)
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_restore = None
            if logger.getEffectiveLevel() < _QUIET_LEVEL:
                _quiet_restore = logger.level
                logger.setLevel(_QUIET_LEVEL)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0 and _quiet_restore is not None:
                if logger.level == _QUIET_LEVEL:
                    logger.setLevel(_quiet_restore)
                _quiet_restore = None
