"""timm beside the CPU build of torch: a folder of its own, used by the subprocesses of the timm tests only.

timm imports torchvision, and the only torchvision wheel for a given torch on the package index
(0.28.0 for torch 2.13) is a CUDA build: installed into the test environment it fails to import
beside the CPU torch (``operator torchvision::nms does not exist``) and breaks transformers' imports.
So :func:`timm_folder` installs timm and that torchvision with ``pip install --no-deps --target
.side-packages/<torch version>`` (once; later runs reuse the folder, which git ignores), and the
timm cases run in a subprocess (``tests/_timm_cases.py``) that puts the folder first on
``sys.path`` and defines, with ``torch.library``, the two operators torchvision registers fake
kernels for (``torchvision::nms``, ``torchvision::qnms``): its Python part then imports, and
timm's optimizers, which never call those operators, are the real ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TIMM = "timm==1.0.31"


def torchvision_for(torch_version: str) -> str:
    """Return the torchvision release made for ``torch_version`` (2.13 -> 0.28.0: minor + 15)."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return f"torchvision==0.{minor + 15}.0" if major == 2 else "torchvision"


def timm_folder() -> Path:
    """Return a folder holding timm and torchvision for this torch, installing them the first time.

    Raises:
        RuntimeError: if pip cannot install them (the timm tests then fail, they are not skipped).
    """
    folder = ROOT / ".side-packages" / torch.__version__.split("+")[0]
    if (folder / "timm").is_dir() and (folder / "torchvision").is_dir():
        return folder
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(folder),
        TIMM, torchvision_for(torch.__version__),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"could not install timm beside torch: {' '.join(command)}\n{done.stderr[-3000:]}")
    return folder


def define_torchvision_operators() -> None:
    """Define the operators whose fake kernels torchvision's Python part registers at import."""
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(library)


_KEEP: list[torch.library.Library] = []
