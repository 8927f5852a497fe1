"""An older version of swarm, importable beside this one: to measure today's code against it in the same run.

`git archive` writes the tree of a commit to a temporary folder, laid out as the installed package is
(`swarm/`, with `peer/`, `compression/` and `proto/` inside it as `swarm.peer` and so on). A process started
with that folder first on PYTHONPATH imports the older swarm: the editable install's finder comes after
the path entries.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
SUBPACKAGES = {"peer": "peer", "compression": "compression", "proto": "proto"}


def export_tree(ref: str) -> Path:
    """A folder holding the `swarm` package as it was at `ref`; raises CalledProcessError for an unknown ref."""
    archive = subprocess.run(
        ["git", "-C", str(REPOSITORY), "archive", "--format=tar", ref, "swarm", *SUBPACKAGES],
        check=True,
        capture_output=True,
    ).stdout
    root = Path(tempfile.mkdtemp(prefix=f"swarm-{ref[:12]}-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root / "tree", filter="data")
    package = root / "tree" / "swarm"
    for name, folder in SUBPACKAGES.items():
        os.replace(root / "tree" / folder, package / name)
    return root / "tree"


def environment_for(tree: Path) -> dict[str, str]:
    """The environment of a process that imports swarm from `tree` (scripts/ stays importable too)."""
    scripts = str(REPOSITORY / "scripts")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), scripts])}
