"""Train and test a vitrel model: ``python train.py [group=option ...] [key=value ...]``.

Examples (docs/training.md has the full guide)::

    python train.py                                   # ViT-tiny, rel2d_factored, embedded Fashion-MNIST, CPU
    python train.py pos=rope2d_mixed trainer.max_epochs=10
    python train.py -m pos=rel2d_full,rel2d_factored,rope2d_mixed,shaw2d_factored
    python train.py experiment=cifar10_vit data.root=/data/cifar
    python train.py hydra.run.dir=outputs/train/runs/<folder> ckpt_path=last    # resume
"""

import hydra
from omegaconf import DictConfig

import vitrel.config  # noqa: F401  (registers the config schemas conf/ names, before Hydra composes)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig):
    from vitrel.train.run import train
    from vitrel.train.user_errors import one_line_errors
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()  # third-party notices that say nothing to a user
    with one_line_errors("train.py"):  # a bad checkpoint or data folder: its message, no traceback
        return train(cfg)


if __name__ == "__main__":
    from vitrel.train.cli import with_override_hints

    with_override_hints(main, "train.py")  # pos.<typo>=, optim.lr=: Hydra's refusal, then what to set instead
