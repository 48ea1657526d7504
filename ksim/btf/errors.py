"""The BTF reader's error: one class, each message naming what is wrong where."""

from __future__ import annotations

from ksim.errors import KsimError


class BTFError(KsimError):
    """BTF that cannot be used: malformed (bad magic, truncated, an id or a string
    offset out of range, a loop in a chain of types), a type or a member that is not
    there, or a kernel that has no BTF for what was asked."""

    code = "btf"
