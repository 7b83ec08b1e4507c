"""Topology files: YAML -> validated, typed `Topology`, and the values derived from it.

Public entry points: `load_file`, `load_text`, `Topology`, `TopologyError`, `Issue`.
This package knows no engine's command line and starts nothing.
"""

from pdctl.topology.issues import Issue, TopologyError
from pdctl.topology.load import LoadedTopology, load_file, load_text
from pdctl.topology.model import Topology

__all__ = ["Issue", "LoadedTopology", "Topology", "TopologyError", "load_file", "load_text"]
