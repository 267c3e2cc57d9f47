"""Top-k predictions for a folder of images (of videos for a video model), as a CSV (timm ``inference.py``
conventions).

python predict.py ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt input=path/to/images
python predict.py ckpt_path=<export folder | model.pt2> input=<ImageFolder tree> topk=3 device=cuda
python predict.py ckpt_path=<...>.ckpt input=<folder> seq_len=256   # each image at its own size (NaFlex, packed)
python predict.py ckpt_path=<run>/checkpoints/last.ckpt input=<folder>   # a NaFlex run: its seq_len, max_tokens, ...
python predict.py ckpt_path=<run>/checkpoints/last.ckpt input=<folder> seq_len=null   # a NaFlex run at fixed size
python predict.py ckpt_path=<video run>/checkpoints/last.ckpt input=<folder of videos>   # a video model's clips
"""

import hydra
from omegaconf import DictConfig

import vitrel.config  # noqa: F401  (registers the config schemas conf/ names, before Hydra composes)


@hydra.main(version_base="1.3", config_path="conf", config_name="predict")
def main(cfg: DictConfig) -> dict:
    from vitrel.train.cli import predict_task
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()  # third-party notices that say nothing to a user
    # a damaged, foreign or missing model file, an input that is no folder of images (or videos), a GPU this machine
    # does not have, a setting it cannot honour (topk=0, seq_len for a video model...): the reason alone
    return predict_task("predict.py")(cfg)


if __name__ == "__main__":
    main()
