"""The causes ``ksim verify`` refuses for, beside ksim's own (ksim.errors)."""

from __future__ import annotations

from ksim.errors import BadArgument, KsimError


class BadCase(BadArgument):
    """A case id (``--case``), a selection or an option that names no case: the
    message says what is wrong with it."""

    code = "bad-case"


class ClusterUnavailable(KsimError):
    """``--cluster``: Ray is not installed, or the cluster cannot be reached."""

    code = "cluster-unavailable"


class ResultsFileError(KsimError):
    """``--results``: the file cannot be read or written."""

    code = "results-file"
