"""Score a checkpoint on a data set at any image size (resolution transfer).

python eval.py ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt
python eval.py ckpt_path=<...>.ckpt data.img_size=48        # 12x12 grid instead of 7x7
python eval.py ckpt_path=<export dir or .safetensors> data=cifar10 data.root=/data/cifar
"""

import hydra
from omegaconf import DictConfig

import vitrel.config  # noqa: F401  (registers the config schemas conf/ names, before Hydra composes)


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig):
    from vitrel.train.evaluate import evaluate
    from vitrel.train.user_errors import one_line_errors
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()  # third-party notices that say nothing to a user
    with one_line_errors("eval.py"):  # a bad checkpoint or data folder: its message, no traceback
        return evaluate(cfg)


if __name__ == "__main__":
    from vitrel.train.cli import with_override_hints

    with_override_hints(main, "eval.py", "eval")  # optim.lr=...: Hydra's refusal, then the new key
