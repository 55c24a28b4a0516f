"""Paths as the jobs pass them around, and the one place a path becomes a URI.

The jobs hand paths to Spark and Hadoop as *Hadoop path strings*: a plain local
path (``/data/with space/ä%``) or a qualified one as Hadoop prints it
(``file:/data/with space/ä%``, ``hdfs://nn:8020/x y``). Hadoop never
percent-encodes these strings, and reads ``%`` in them literally. A real URI
(RFC 3986, what pyarrow's ``FileSystem.from_uri`` and other URI parsers want)
quotes the path; gluing a path into ``file://...`` instead breaks on a space, a
non-ASCII character or ``%``. :func:`to_uri` is the only conversion.

Standard library only: the jobs check paths before Spark starts.
"""
from __future__ import annotations

import os
import posixpath
import re
from urllib.parse import quote

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(.*)$", re.DOTALL)
# Characters RFC 3986 allows unquoted in a path segment (pchar) besides the unreserved
# ones quote() always keeps; everything else (space, %, non-ASCII as UTF-8) is quoted.
_PATH_SAFE = "/:@!$&'()*+,;="


def split_path(path: str | os.PathLike[str]) -> tuple[str | None, str | None, str]:
    """``(scheme, authority, path)`` of a Hadoop path string, as Hadoop's ``Path`` parses it.

    No scheme: ``(None, None, path)``. ``file:/x`` and ``file:///x``: ``("file", None, "/x")``.
    """
    text = os.fspath(path)
    match = _SCHEME.match(text)
    # A single letter before ':' is a Windows drive, as in Hadoop; not a scheme.
    if match is None or len(match.group(1)) == 1:
        return None, None, text
    scheme, rest = match.group(1).lower(), match.group(2)
    authority = None
    if rest.startswith("//"):
        authority, slash, tail = rest[2:].partition("/")
        rest = slash + tail
        authority = authority or None
    return scheme, authority, rest


def to_uri(path: str | os.PathLike[str]) -> str:
    """A Hadoop path string (or a local path) as a correctly quoted absolute URI.

    ``/tmp/with space`` and ``file:/tmp/with space`` give ``file:///tmp/with%20space``;
    ``hdfs://nn/a b`` gives ``hdfs://nn/a%20b``. A relative local path is made absolute
    against the working directory. ``%`` in the path is a literal character (as for
    Hadoop), so it is quoted as ``%25``.
    """
    scheme, authority, rest = split_path(path)
    if scheme is None or scheme == "file":
        if scheme is None:
            rest = os.path.abspath(rest)
        return "file://" + (authority or "") + quote(rest, safe=_PATH_SAFE)
    return f"{scheme}://{authority or ''}{quote(rest, safe=_PATH_SAFE)}"


def local_path(path: str | os.PathLike[str]) -> str | None:
    """The local file system path of a plain path or a ``file:`` path string; None for
    any other scheme (HDFS, S3, ...), which only Spark can check."""
    scheme, authority, rest = split_path(path)
    if scheme is None:
        return rest
    if scheme == "file" and authority in (None, "localhost"):
        return rest
    return None


def _canonical(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(filesystem, absolute normalised path)``; local paths with symbolic links resolved."""
    local = local_path(path)
    if local is not None:
        return "file", os.path.realpath(local)
    scheme, authority, rest = split_path(path)
    return f"{scheme}://{authority or ''}", posixpath.normpath("/" + rest.lstrip("/"))


def overlap(output: str | os.PathLike[str], other: str | os.PathLike[str]) -> str | None:
    """How ``output`` overlaps ``other``: ``"is"``, ``"is inside"``, ``"contains"``, or None.

    Local paths are compared after resolving symbolic links; remote ones by
    normalised path on the same scheme and authority.
    """
    fs_a, a = _canonical(output)
    fs_b, b = _canonical(other)
    if fs_a != fs_b:
        return None
    if a == b:
        return "is"
    if a.startswith(b.rstrip("/") + "/"):
        return "is inside"
    if b.startswith(a.rstrip("/") + "/"):
        return "contains"
    return None
