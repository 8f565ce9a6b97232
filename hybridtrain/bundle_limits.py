"""How large a code bundle may unpack: the agents refuse to launch from a bundle beyond these,
and the control plane refuses to store one (dependency-free, imported by both)."""

from __future__ import annotations

# Members (files and directories) of one bundle's tar.
MAX_MEMBERS = 100_000
# Bytes of the unpacked tree: a small archive can expand enormously (a "zip bomb").
MAX_UNPACKED_BYTES = 8 << 30
# Unpacked bytes per archive byte. Source trees compress 3-10x, text data 20-50x; a stream of
# zeros 1000x and more.
MAX_EXPANSION_RATIO = 200
# The ratio is not held against a tree this small, however well it compressed.
RATIO_EXEMPT_BYTES = 16 << 20


def expansion_refusal(*, unpacked_bytes: int, archive_bytes: int) -> str | None:
    """Why an archive of `archive_bytes` that unpacks to `unpacked_bytes` expands too much;
    None if it does not."""
    if unpacked_bytes > max(MAX_EXPANSION_RATIO * archive_bytes, RATIO_EXEMPT_BYTES):
        return (f"unpacks to more than {MAX_EXPANSION_RATIO} times its {archive_bytes} bytes "
                f"({unpacked_bytes} bytes)")
    return None


def unpack_refusal(*, members: int, unpacked_bytes: int, archive_bytes: int) -> str | None:
    """Why a bundle with these totals (so far) is refused; None while within every limit."""
    if members > MAX_MEMBERS:
        return f"more than {MAX_MEMBERS} members"
    if unpacked_bytes > MAX_UNPACKED_BYTES:
        return f"unpacks to more than {MAX_UNPACKED_BYTES} bytes"
    return expansion_refusal(unpacked_bytes=unpacked_bytes, archive_bytes=archive_bytes)
