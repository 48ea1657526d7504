"""``ksim verify``: the differential test (``ksim.differential``) as campaigns over
whole kernels, on local processes or a Ray cluster (docs/verify.md).

* ``cases``: the image, the points a campaign selects and its cases, named by ids;
* ``worker``: a process's harness for an image, each case's record;
* ``engines``: local processes (fork) and Ray (the image and the analysis store
  put into the object store once, tasks of chunks of cases);
* ``campaign``: results written as they come, resumed, summed up and digested;
* ``program``: the points a ksim trace program's kprobe and kretprobe probes splice.
"""

from ksim.campaign.campaign import Outcome, digest, reproducer
from ksim.campaign.cases import (
           ImageSource,
           Target,
           VerifyCase,
           image_source,
           make_cases,
           parse_case,
           select,
)
from ksim.campaign.engines import LocalEngine, RayEngine, engine_for

__all__ = ["ImageSource", "LocalEngine", "Outcome", "RayEngine", "Target", "VerifyCase", "digest",
           "engine_for", "image_source", "make_cases", "parse_case", "reproducer", "select"]
