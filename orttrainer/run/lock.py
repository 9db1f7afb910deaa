"""One run per output folder: `orttrainer.lock` in the folder, holding the host and PID of its run.

The lock is an advisory `flock` on that file, held for the whole run: the kernel releases it when
the process dies in any way (SIGKILL included), so a lock file left behind by a dead run is stale
and the next run takes it over with a warning. Where the file system has no flock (some network
file systems), a lock naming this host is stale when its PID is gone; one naming another host is
refused (delete the file once that run is over). A lock file that is a link is refused: nothing
is written through it.
"""

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from orttrainer.run.recipe.spec import RecipeError

LOCK_FILE = "orttrainer.lock"
_NO_LINK = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)  # the lock is never written through a link


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def _describe(owner):
    if not owner:
        return "another process (the lock file does not say which)"
    return f"process {owner.get('pid')} on host {owner.get('host')} (started {owner.get('started')})"


class OutputLock:
    """`acquire()` or RecipeError naming the run that holds `folder`; `release()` at the end."""

    def __init__(self, folder, what="run.output_dir",
                 hint="wait for that run to end, or use --output-dir DIR for another run"):
        self.path = Path(folder) / LOCK_FILE
        self.what, self.hint = what, hint  # the error's subject and advice (`orttrainer data` builds too)
        self._fd = None

    def acquire(self, say):
        """Take the lock; `say` prints the warning when a dead run's lock is taken over."""
        me = (json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                          "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n").encode()
        for _ in range(5):  # retried when the holder removes the file while we lock it
            fd, links_work = self._create(me)
            created = fd is not None
            if not created:
                try:  # O_CREAT only where links fail: an empty file would name no holder
                    fd = os.open(self.path, os.O_RDWR | _NO_LINK | (0 if links_work else os.O_CREAT), 0o644)
                except FileNotFoundError:
                    continue  # its holder removed it meanwhile: create it
                except OSError as exc:
                    if exc.errno != errno.ELOOP:
                        raise
                    raise RecipeError(f"{self.what}: {self.path} is a link, not a lock file a run wrote (a run "
                                      "writes nothing through a link); remove it") from None
            try:
                owner = None if created else self._read(fd)
                if not self._lock(fd, owner):
                    owner = self._read(fd)  # read again: the holder may have written itself since
                    raise RecipeError(f"{self.what}: {self.path.parent} is in use by {_describe(owner)} "
                                      f"(lock file {self.path}); {self.hint}")
                if os.path.exists(self.path) and os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        else:
            raise RecipeError(f"{self.what}: could not take the lock {self.path}: it keeps changing")
        if owner:
            say(f"warning: taking over the stale lock {self.path} of {_describe(owner)}: that run is over "
                "(it did not exit cleanly)")
        if not created:  # write first, then cut: a reader never finds the file empty
            os.pwrite(fd, me, 0)
            os.ftruncate(fd, len(me))
        self._fd = fd

    def _create(self, me):
        """(fd, True): a new lock file that already names this process, locked; (None, True) when
        one exists; (None, False) where the file system has no hard links.

        It is written and locked under a private name, then linked into place: a run that
        finds the file can never find it empty (it would not know whom to name)."""
        tmp = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NO_LINK, 0o644)
        except FileExistsError:  # left by a killed process of this PID, or a link: never written through
            os.unlink(tmp)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NO_LINK, 0o644)
        try:
            os.pwrite(fd, me, 0)
            self._lock(fd, None)
            os.link(tmp, self.path)
            return fd, True
        except OSError as exc:
            os.close(fd)
            return None, exc.errno == errno.EEXIST
        finally:
            os.unlink(tmp)

    @staticmethod
    def _read(fd):
        try:
            text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            owner = json.loads(text) if text.strip() else None
        except (OSError, ValueError):
            return {"pid": "?", "host": "?", "started": "?"}
        return owner if isinstance(owner, dict) else None

    @staticmethod
    def _lock(fd, owner):
        """True when this process now holds the lock on `fd`."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        # No flock here: judge by the PID the file names.
        if not owner:
            return True
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
            return not _pid_alive(owner["pid"])
        return False

    def release(self):
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # before unlocking: a waiting run then finds no file, or its own
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
