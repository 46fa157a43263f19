"""Make the source checkout visible to ``importlib.metadata`` without pip (a GPU host without network).

SGLang finds plugins through entry points, i.e. through an installed distribution's metadata. On a
host without network there is no index and no build backend, so this writes a minimal ``.dist-info``
(name, version, the entry points of ``pyproject.toml``) into a folder on ``PYTHONPATH``; the checkout
itself must be on ``PYTHONPATH`` too.

    python3 launch/register_entry_points.py /tmp/site
"""

import sys
from pathlib import Path

import tomllib

root = Path(__file__).resolve().parents[1]
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
target = Path(sys.argv[1]) / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
target.mkdir(parents=True, exist_ok=True)
(target / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
)
(target / "entry_points.txt").write_text(
    "".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items()) + "\n"
        for group, eps in project["entry-points"].items()
    )
)
print(target)
