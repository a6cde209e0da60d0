"""Text from users' data (prompt ids, paths, error messages) made safe for a terminal: control characters (ESC
sequences included) are shown escaped, never sent raw. Rich renders it with markup off (rich_view, status)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 (but tab and newline), DEL, C1


def printable(s: object) -> str:
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(s))
