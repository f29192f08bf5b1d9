"""The one rule for the folders moetune writes whole: exports (adapter, merged), the run's adapter/ and a rebuilt
random base. Such a folder appears complete, or not at all.

    with atomic_output_dir("out/merged", label="--out out/merged") as tmp:
        ... write every file into tmp ...
    # on success tmp was renamed to out/merged; on any failure (or a signal, or a kill) out/merged is untouched

- One writer per folder: an exclusive flock on the sibling ``.NAME.lock``, taken before anything is checked or
  written and held until the folder is in place; a second writer fails at once with an OutputError naming the
  holder. (The kernel drops the lock when its process dies, however it dies.)
- What may be replaced: a folder that does not exist, an empty one, or one holding only ``replaceable`` names (an
  earlier output of the same kind). Anything else is the user's and is refused (ExportError), nothing written.
- Atomic: files go into a hidden temporary sibling ``.NAME.tmp-XXXX`` that is renamed into place once complete;
  a replaced folder is renamed aside first and removed afterwards. A writer that was killed leaves only hidden
  temporaries, which the next writer of the same folder removes (it holds the lock, so they are nobody's).
- A symlink as the folder means the directory it points to: the output replaces that directory (the temporary
  sits beside it, so every rename stays within its file system) and the link is kept, pointing to the new output.
  A link to something that is not a directory is refused.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moetune.errors import ExportError, OutputError

ANY = ("*",)  # replaceable: a folder that is moetune's own whatever it holds (a rebuilt base under RUN/base)


def output_target(out: str | os.PathLike) -> Path:
    """The directory that writing `out` replaces: `out` itself, or the directory a symlink `out` points to."""
    out = Path(os.path.abspath(out))
    return Path(os.path.realpath(out)) if out.is_symlink() else out


def check_replaceable(out: str | os.PathLike, replaceable: tuple[str, ...] = (), label: str | None = None) -> None:
    """Refuse (ExportError) an `out` that exists and holds anything but `replaceable` names (glob patterns)."""
    label = label or str(out)
    target = output_target(out)
    if Path(out).is_symlink() and not target.exists():
        return  # a dangling link: its target is created
    if not target.exists():
        return
    if not target.is_dir():
        raise ExportError(f"{label}: exists and is not a directory")
    try:
        names = [p.name for p in target.iterdir()]
    except OSError as e:
        raise OutputError(f"{label}: cannot read it ({e.strerror})") from None
    foreign = sorted(n for n in names if not any(fnmatch.fnmatch(n, pat) for pat in replaceable))
    if foreign:
        raise ExportError(f"{label}: exists and holds other files ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new directory")


@contextmanager
def atomic_output_dir(out: str | os.PathLike, replaceable: tuple[str, ...] = (),
                      label: str | None = None) -> Iterator[str]:
    """Yield a temporary directory to write the folder `out` into; see the module docstring for the rule."""
    label = label or str(out)
    target = output_target(out)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{label}: cannot create {target.parent} ({e.strerror})") from None
    with _writer_lock(target, label):
        check_replaceable(out, replaceable, label)
        _remove_debris(target)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        except OSError as e:
            raise OutputError(f"{label}: cannot write in {target.parent} ({e.strerror})") from None
        try:
            yield str(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; an output is meant to be shared
            _publish(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _publish(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)  # new, or an empty directory: replaced in one step
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.trash-", dir=target.parent))
    os.rename(target, trash / target.name)
    os.rename(tmp, target)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_debris(target: Path) -> None:
    """Temporaries of writers of `target` that died (the caller holds the lock, so no live writer owns them)."""
    for p in target.parent.iterdir():
        if is_writer_file(p.name, target.name) and p.is_dir():  # the lock file is ours now
            shutil.rmtree(p, ignore_errors=True)


def is_writer_file(name: str, folder: str) -> bool:
    """Whether `name`, beside the folder `folder`, is this rule's lock or temporary for it (a killed writer's)."""
    return name == f".{folder}.lock" or name.startswith((f".{folder}.tmp-", f".{folder}.trash-"))


@contextmanager
def _writer_lock(target: Path, label: str) -> Iterator[None]:
    path = target.with_name(f".{target.name}.lock")
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"{label}: cannot create the lock {path} ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputError(f"{label}: another process (pid {holder or '?'}) is writing it now; wait for it, "
                                  "or write elsewhere") from None
            raise OutputError(f"{label}: cannot lock {path} ({e.strerror})") from None
        try:  # the previous holder may have removed the file after we opened it: lock the file that is there now
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)  # while still holding it: a waiting opener then sees another inode and retries
        except OSError:
            pass
        os.close(fd)
