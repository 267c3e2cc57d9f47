"""conf/data/video_folder.yaml's augmentation options are set on the command line as docs/video.md says,
``data.augment_kwargs.hflip=0`` (before: Hydra's "Key 'hflip' is not in struct", the config listing none), and
listing them changes nothing: they are VideoDataModule's defaults."""

from __future__ import annotations

from hydra.utils import instantiate

from tests.train_helpers import compose
from vitrel.data.video import VideoFolderDataModule


def test_video_folder_flip_and_crop_are_set_by_name(tmp_path):
    over = ["data=video_folder", f"data.root={tmp_path}", "data.augment_kwargs.hflip=0"]
    over += ["data.augment_kwargs.scale=[0.5,1.0]"]
    dm = instantiate(compose(tmp_path, over).data)
    assert dm.augment_kwargs["hflip"] == 0 and tuple(dm.augment_kwargs["scale"]) == (0.5, 1.0)
    assert dm.train_transform().augment.transforms[1].p == 0.0  # (the flip the clips get)
    listed = instantiate(compose(tmp_path, ["data=video_folder", f"data.root={tmp_path}"]).data).augment_kwargs
    defaults = VideoFolderDataModule.default_augment_kwargs
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in listed.items()} == defaults
