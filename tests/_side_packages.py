"""timm and torchtune beside the CPU build of torch: folders of their own, for their tests' subprocesses.

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
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
TIMM = "timm==1.0.31"
TORCHTUNE = [
    "torchtune==0.6.1", "torchao==0.11.0", "torchdata==0.11.0", "omegaconf==2.4.0",
    "antlr4-python3-runtime==4.9.3", "datasets==5.2.0", "pyarrow==26.0.1", "dill==0.4.1",
    "multiprocess==0.70.19", "xxhash==4.1.0", "pandas==3.1.1", "sentencepiece==0.2.3", "tiktoken==0.14.0",
    "blobfile==3.3.0", "kagglehub==1.0.3",
]  # fmt: skip


def torchvision_for(torch_version: str) -> str:
    """Return the torchvision release made for ``torch_version`` (2.13 -> 0.28.0: minor + 15)."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return f"torchvision==0.{minor + 15}.0" if major == 2 else "torchvision"


def timm_folder() -> Path:
    """Return a folder holding timm and torchvision for this torch, installing them the first time.

    Raises:
        RuntimeError: if pip cannot install them (the timm tests then fail, they are not skipped).
    """
    return side_folder("", [TIMM, torchvision_for(torch.__version__)], ("timm", "torchvision"))


def torchtune_folder() -> Path:
    """Return a folder holding torchtune and what it imports that the test environment lacks.

    torchtune 0.6.1 imports names that torchao moved after 0.11 (``torchao.dtypes.nf4tensor``,
    ``TensorCoreTiledLayout``), so this folder holds torchao 0.11.0, first on ``sys.path`` of the
    torchtune cases only (its C++ kernels do not load beside torch 2.13 and are not needed: the
    cases use torchtune's LoRA modules, ``get_adapter_params`` and its optimizer-in-backward
    helpers), and the packages torchtune imports at the top (datasets and its own dependencies, the
    tokenizers' libraries, torchdata, omegaconf). The torchtune cases also put the timm folder on
    the path for torchvision, which torchtune imports too.

    Raises:
        RuntimeError: if pip cannot install them (the torchtune tests then fail, they are not skipped).
    """
    return side_folder("torchtune", TORCHTUNE, ("torchtune", "torchao", "datasets"))


def side_folder(name: str, requirements: list[str], expected: tuple[str, ...]) -> Path:
    """Install ``requirements`` with ``pip --no-deps --target .side-packages/<torch version>[-name]`` once."""
    version = torch.__version__.split("+")[0]
    folder = ROOT / ".side-packages" / (f"{version}-{name}" if name else version)
    if all((folder / package).is_dir() for package in expected):
        return folder
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(folder)]
    command += requirements
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"could not install beside torch: {' '.join(command)}\n{done.stderr[-3000:]}")
    return folder


def run_cases(script: str, folders: list[Path], out: Path) -> Any:
    """Run ``tests/<script> <folders...> <out>`` in a subprocess and return what it saved in ``out``.

    Raises:
        AssertionError: with the end of its output, if the script fails.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / script), *map(str, folders), str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=False)


def define_torchvision_operators() -> None:
    """Define the operators whose fake kernels torchvision's Python part registers at import."""
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(library)


_KEEP: list[torch.library.Library] = []
