"""A position scheme registered outside the package (a user's own ``register_pos`` module): a launcher that imports it
and calls ``vitrel.train.cli.predict_main`` (as ``train_main`` / ``eval_main``) predicts with a checkpoint of it."""

from __future__ import annotations

import csv
import subprocess
import sys
import textwrap

import numpy as np
import torch
from PIL import Image

from tests import preloaded
from tests.train_helpers import script_env

SCHEME = textwrap.dedent(
    """
    import torch
    from torch import nn

    from vitrel.layout.geometry import pad_prefix, rel_offsets
    from vitrel.pos import PositionScheme, register_pos


    @register_pos("user_gauss2d")
    class UserGauss2d(PositionScheme):
        family = "learned bias"
        has_bias = True

        def __init__(self, *, init_width: float = 0.1, **kw) -> None:
            super().__init__(**kw)
            self.width = nn.Parameter(torch.full((self.num_heads,), float(init_width)))

        def bias(self, grid, num_prefix_tokens=0):
            dh, dw = rel_offsets(self.check_grid(grid), self.width.device)
            d2 = (dh**2 + dw**2).to(self.width.dtype)
            return pad_prefix(-self.width[:, None, None] * d2, num_prefix_tokens)
    """
)
LAUNCHER = "import my_schemes\nfrom vitrel.train.cli import predict_main\n\npredict_main()\n"


def _make(folder: str, ckpt: str) -> None:
    """The user's checkpoint of a model with their scheme, made in another process (tests/preloaded.py) that imports
    their module from ``folder``: the test process's registry stays without the scheme."""
    sys.path.insert(0, folder)
    import my_schemes  # noqa: F401  (registers user_gauss2d)

    import vitrel

    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos={"name": "user_gauss2d", "init_width": 0.5}, num_classes=3)
    torch.save({"vitrel_cfg": m.vitrel_cfg, "state_dict": {"model." + k: v for k, v in m.state_dict().items()}}, ckpt)


def test_predict_main_after_a_user_module_predicts_with_its_scheme(tmp_path):
    (tmp_path / "my_schemes.py").write_text(SCHEME)
    (tmp_path / "my_predict.py").write_text(LAUNCHER)
    env = script_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    ckpt = tmp_path / "user.ckpt"
    preloaded.run(_make, str(tmp_path), str(ckpt))
    assert torch.load(ckpt, weights_only=True)["vitrel_cfg"]["pos"]["name"] == "user_gauss2d"
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(images / f"{i}.png")
    out = tmp_path / "pred.csv"
    args = [f"ckpt_path={ckpt}", f"input={images}", "topk=2", f"results_file={out}", "progress_bar=false"]
    args += [f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "my_predict.py"), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    assert len(rows) == 3, rows  # a header and a row per image
