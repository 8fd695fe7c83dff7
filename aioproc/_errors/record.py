"""The worker side of failures: ``@record`` and ``ErrorHandler`` write error.json.

Runs inside workers: standard library only, no asyncio.
"""

from __future__ import annotations

import faulthandler
import functools
import inspect
import json
import logging
import os
import sys

from .._child import errorfile as _errorfile
from .._child.errorfile import MAX_ERROR_FILE_SIZE
from .failure import NOT_AVAILABLE, too_large
from .summary import ChildFailedError

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar, overload

    _F = TypeVar("_F", bound=Callable[..., Any])

logger = logging.getLogger("aioproc.errors")  # the public module's name, as before


class ErrorHandler:
    """Writes a process's failure to its error.json, in torchelastic's layout.

    The file is named by the ``TORCHELASTIC_ERROR_FILE`` environment
    variable; without it nothing is written. Subclass it and override
    :meth:`initialize` and :meth:`record_exception` to report elsewhere.
    """

    _entrypoint_fn_name: str | None = None

    def set_entrypoint_fn_name(self, fn_name: str) -> None:
        """Name the entrypoint this handler reports for (newer torch's method).

        ``@record`` calls it with the decorated function's name. The base
        handler only logs the name (at DEBUG, with a success or an
        exception); it is never written into the error file, whose
        ``extraInfo`` holds strings that downstream readers know.

        Args:
            fn_name: the entrypoint's name.
        """
        self._entrypoint_fn_name = fn_name

    def record_success(self) -> None:
        """Note that the entrypoint returned normally (newer torch's method).

        Writes no error file. The base handler logs the entrypoint's name at
        DEBUG, and does nothing when no name was set; subclasses report
        successes elsewhere.
        """
        if self._entrypoint_fn_name is not None:
            logger.debug("entrypoint %s succeeded", self._entrypoint_fn_name)

    def _get_error_file_path(self) -> str | None:
        """Return where this process's error.json goes, or None for nowhere."""
        return os.environ.get(_errorfile.ERROR_FILE_ENV) or None

    def initialize(self) -> None:
        """Prepare to capture failures: dump Python stacks on fatal signals.

        Enables :mod:`faulthandler` on stderr for all threads, as torch does,
        also when it is already enabled (it then writes to stderr, for all
        threads). A failure to enable it is a warning, never an error: it
        must not stop the worker.
        """
        try:
            faulthandler.enable(all_threads=True)
        except Exception as e:  # e.g. sys.stderr is None or has no fd
            import warnings

            warnings.warn(
                f"could not enable faulthandler: {type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=2,
            )

    def record_exception(self, e: BaseException) -> None:
        """Write ``e`` and its traceback to this process's error file.

        Byte-compatible with torch's ``ErrorHandler.record_exception``. When
        no error file is configured, a warning is logged instead. Write
        errors are reported on stderr and swallowed, so that the original
        exception is the one that propagates.

        Args:
            e: The exception to record.
        """
        if self._entrypoint_fn_name is not None:
            logger.debug("entrypoint %s raised %s", self._entrypoint_fn_name, type(e).__name__)
        path = self._get_error_file_path()
        if not path:
            logger.warning(
                "%s is not set, so %s was not written to an error file",
                _errorfile.ERROR_FILE_ENV,
                type(e).__name__,
            )
            return
        _errorfile.write_error_file(path, e)

    def override_error_code_in_rootcause_data(
        self,
        rootcause_error_file: str,
        rootcause_error: dict[str, Any],
        error_code: int = 0,
    ) -> None:
        """Set ``errorCode`` in a child's error data to its real exit code.

        A child killed by a signal cannot record its own exit code. Only the
        ``@record`` layout (a dict ``message``) has room for it; other
        layouts are left unchanged, with a warning.

        Args:
            rootcause_error_file: Where the data came from, for the warning.
            rootcause_error: The parsed error file, modified in place.
            error_code: The exit code to record.
        """
        message = rootcause_error.get("message")
        if isinstance(message, dict):
            message["errorCode"] = error_code
        else:
            logger.warning(
                "child error file %s has no dict 'message' to hold errorCode %d; "
                "copying it unchanged",
                rootcause_error_file,
                error_code,
            )

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a child's error file to this process's error file.

        Lets a launcher report its failed child's root cause as its own.
        An existing error file of ours is logged and replaced.

        Args:
            rootcause_error_file: The child's error.json.
            error_code: The child's exit code, written as ``errorCode``
                when nonzero.

        Raises:
            OSError: The child's error file cannot be read.
            ValueError: The child's error file is not a JSON object, or is
                larger than ``MAX_ERROR_FILE_SIZE``.
        """
        content, size = _errorfile.read_capped(rootcause_error_file)
        if size > MAX_ERROR_FILE_SIZE:
            raise ValueError(
                f"child error file {rootcause_error_file} is {size} bytes, over the "
                f"{MAX_ERROR_FILE_SIZE}-byte limit (aioproc.errors.MAX_ERROR_FILE_SIZE)"
            )
        rootcause_error = json.loads(content)
        if not isinstance(rootcause_error, dict):
            raise ValueError(
                f"child error file {rootcause_error_file} holds "
                f"{type(rootcause_error).__name__}, not a JSON object"
            )
        if error_code:
            self.override_error_code_in_rootcause_data(
                rootcause_error_file, rootcause_error, error_code
            )
        my_error_file = self._get_error_file_path()
        if not my_error_file:
            logger.error(
                "%s is not set, so child error file %s was not copied",
                _errorfile.ERROR_FILE_ENV,
                rootcause_error_file,
            )
            return
        self._discard_existing(my_error_file)
        try:
            _errorfile.dump_error_data(my_error_file, rootcause_error)
        except OSError as e:
            logger.warning("could not write error file %s: %s", my_error_file, e)
        else:
            logger.info("copied child error file %s to %s", rootcause_error_file, my_error_file)

    def _discard_existing(self, path: str) -> None:
        # A child that inherited our TORCHELASTIC_ERROR_FILE may have written
        # to it before getting its own; log what is lost, then replace it.
        if not os.path.isfile(path):
            return
        try:
            content, size = _errorfile.read_capped(path)
            if size > MAX_ERROR_FILE_SIZE:
                original = too_large(path, content, size)
            else:
                original = content.decode("utf-8", errors="replace")
            logger.warning("error file %s exists and is replaced; it held:\n%s", path, original)
            os.remove(path)
        except OSError as e:
            logger.warning("could not replace existing error file %s: %s", path, e)


def get_error_handler() -> ErrorHandler:
    """Return the handler ``@record`` uses when given none (torch's name).

    Returns:
        A new :class:`ErrorHandler`.
    """
    return ErrorHandler()


if TYPE_CHECKING:

    @overload
    def record(fn: _F, error_handler: ErrorHandler | None = None) -> _F: ...

    @overload
    def record(
        fn: None = None, error_handler: ErrorHandler | None = None
    ) -> Callable[[_F], _F]: ...


def record(
    fn: _F | None = None, error_handler: ErrorHandler | None = None
) -> _F | Callable[[_F], _F]:
    """Record an uncaught exception of ``fn`` in this process's error.json.

    Use it once per process, on the entrypoint: ``@record``, ``@record()``
    or ``@record(error_handler=...)``. Coroutine functions are supported.
    The call:

    - names the entrypoint to the handler (``set_entrypoint_fn_name``) and
      initializes it (faulthandler on);
    - on a normal return, calls the handler's ``record_success()``;
    - on :class:`ChildFailedError`, copies the root cause's error file into
      this process's, with its exit code, so the child's traceback is what
      reaches the scheduler;
    - on any other ``Exception``, records it with
      :meth:`ErrorHandler.record_exception`;
    - always re-raises, except ``SystemExit`` with code ``0``, which returns
      None as in torch (so a ``runpy``-run script's ``sys.exit(0)`` does not
      end its launcher). Other ``BaseException`` subclasses (another
      ``SystemExit``, including ``sys.exit()`` with no code as in torch,
      ``KeyboardInterrupt``, cancellation) pass through and write nothing.

    Args:
        fn: The function to wrap; omit it to get a decorator.
        error_handler: Handler to use; :func:`get_error_handler` if None.

    Returns:
        The wrapped function, or a decorator when ``fn`` is None.
    """
    # looked up on the public module, as torch's record does: code that
    # replaces ``aioproc.errors.get_error_handler`` changes what it uses
    face = sys.modules.get("aioproc.errors")
    factory = getattr(face, "get_error_handler", get_error_handler)
    handler = error_handler if error_handler is not None else factory()

    # The ignores below: functools.wraps keeps f's signature, mypy cannot tell.
    def decorate(f: _F) -> _F:
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                _name_entrypoint(handler, f)
                handler.initialize()
                try:
                    value = await f(*args, **kwargs)
                except SystemExit as e:
                    if e.code == 0:  # torch's test, so False counts and None does not
                        _record_success(handler)
                        return None
                    raise
                except ChildFailedError as e:
                    _dump_root_cause(handler, e)
                    raise
                except Exception as e:
                    handler.record_exception(e)
                    raise
                _record_success(handler)
                return value

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _name_entrypoint(handler, f)
            handler.initialize()
            try:
                value = f(*args, **kwargs)
            except SystemExit as e:
                if e.code == 0:  # torch's test, so False counts and None does not
                    _record_success(handler)
                    return None
                raise
            except ChildFailedError as e:
                _dump_root_cause(handler, e)
                raise
            except Exception as e:
                handler.record_exception(e)
                raise
            _record_success(handler)
            return value

        return wrapper  # type: ignore[return-value]

    if fn is None:
        return decorate
    return decorate(fn)


def _name_entrypoint(handler: ErrorHandler, f: Callable[..., Any]) -> None:
    # torch 2.13's handlers (which record also accepts) have no such method
    setter = getattr(handler, "set_entrypoint_fn_name", None)
    if setter is not None:
        setter(getattr(f, "__name__", repr(f)))


def _record_success(handler: ErrorHandler) -> None:
    success = getattr(handler, "record_success", None)
    if success is not None:
        success()


def _dump_root_cause(handler: ErrorHandler, error: ChildFailedError) -> None:
    # Problems copying are logged, never raised: they must not replace the
    # ChildFailedError that is propagating.
    rank, failure = error.get_first_failure()
    if failure.error_file == NOT_AVAILABLE:
        logger.info(
            "rank %d (local_rank %d) failed without an error file; decorate its "
            "entrypoint with @aioproc.record to capture its traceback",
            rank,
            failure.local_rank,
        )
        return
    try:
        handler.dump_error_file(failure.error_file, failure.exitcode)
    except (OSError, ValueError) as e:
        logger.warning("could not copy error file %s of rank %d: %s", failure.error_file, rank, e)
