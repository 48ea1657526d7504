"""Structural analysis of kernel code: CFG, points, call graph, liveness.

``analyze(image, function)`` is the entry point; the result is cached per
(image, function).  ``analyze_image(image)`` analyses every function of an image
at once (over all cores) into a store kept on disk for the next process
(``ksim.analysis.store``); ``analyze`` and liveness then read from it.
"""

from ksim.analysis.callgraph import CallGraph, call_graph, callees
from ksim.analysis.cfg import CFG, Block, Edge, EdgeKind, JumpTable, build_cfg
from ksim.analysis.function import CallSite, FunctionAnalysis, analyze, classify_target
from ksim.analysis.liveness import Liveness
from ksim.analysis.points import FunctionPoints, Point, PointKind
from ksim.analysis.store import Store, analyze_image, store_for

__all__ = [
    "CFG",
    "Block",
    "CallGraph",
    "CallSite",
    "Edge",
    "EdgeKind",
    "FunctionAnalysis",
    "FunctionPoints",
    "JumpTable",
    "Liveness",
    "Point",
    "PointKind",
    "Store",
    "analyze",
    "analyze_image",
    "build_cfg",
    "call_graph",
    "callees",
    "classify_target",
    "store_for",
]
