"""Benchmarks: real on-disk CIFAR layouts, class order, task splits and the device transforms."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.transforms.functional import resize

from clbench.config import DataConfig, validate
from clbench.data import DeviceTransform, build_benchmark, sources
from clbench.data.benchmark import class_order
from clbench.errors import ConfigError, DataError
from conftest import compose_config


def _pickle(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(obj, f, protocol=2)


def _images(labels: np.ndarray) -> np.ndarray:
    """Flattened CIFAR rows (N, 3072) whose first pixel encodes the original label."""
    data = np.zeros((len(labels), 3 * 32 * 32), dtype=np.uint8)
    data[:, 0] = labels
    return data


def write_cifar100(root: Path, per_class: int = 3) -> None:
    """The official cifar-100-python layout: train, test and meta pickles."""
    folder = root / "cifar-100-python"
    for split, n in (("train", per_class), ("test", 1)):
        labels = np.repeat(np.arange(100), n)
        _pickle(
            folder / split,
            {
                "data": _images(labels),
                "fine_labels": labels.tolist(),
                "coarse_labels": (labels // 5).tolist(),
            },
        )
    _pickle(folder / "meta", {"fine_label_names": [f"c{i}" for i in range(100)], "coarse_label_names": []})


def write_cifar10(root: Path) -> None:
    folder = root / "cifar-10-batches-py"
    for i in range(1, 6):
        labels = np.arange(10)
        _pickle(folder / f"data_batch_{i}", {"data": _images(labels), "labels": labels.tolist()})
    _pickle(folder / "test_batch", {"data": _images(np.arange(10)), "labels": list(range(10))})
    _pickle(folder / "batches.meta", {"label_names": [f"n{i}" for i in range(10)]})


def cifar_config(root: Path, **kw) -> DataConfig:
    return DataConfig(name="cifar100_10tasks", source="cifar100", tasks=10, root=str(root), **kw)


def test_cifar100_reader_builds_ordered_tasks(tmp_path: Path) -> None:
    write_cifar100(tmp_path)
    bench = build_benchmark(cifar_config(tmp_path, verify_checksums=False))
    assert len(bench.tasks) == 10 and bench.num_classes == 100
    order = class_order(100, 1993)
    assert list(bench.tasks[0].classes) == order[:10].tolist()
    for task, split in zip(bench.tasks, bench.train, strict=True):
        assert split.x.dtype == torch.uint8 and split.x.shape[1:] == (3, 32, 32)
        assert len(split) == 30
        assert split.y.min() == task.offset and split.y.max() == task.offset + 9
        # the first pixel holds the original label: it must match the class at the remapped position
        original = split.x[:, 0, 0, 0].long()
        assert torch.equal(original, torch.tensor(task.classes)[split.y - task.offset])
    assert bench.tasks[0].class_names[0] == f"c{order[0]}"


def test_cifar10_reader(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    cfg = DataConfig(name="cifar10_5tasks", source="cifar10", tasks=5, root=str(tmp_path), verify_checksums=False)
    bench = build_benchmark(cfg)
    assert [len(s) for s in bench.train] == [10] * 5 and [len(s) for s in bench.test] == [2] * 5


def test_checksums_reject_a_copy_made_by_hand(tmp_path: Path) -> None:
    write_cifar100(tmp_path)
    with pytest.raises(DataError, match="fail their checksums") as err:
        build_benchmark(cifar_config(tmp_path))
    assert "verify_checksums=false" in str(err.value)
    assert f"The cifar100 files in {tmp_path / 'cifar-100-python'} are missing or fail their checksums." in str(
        err.value
    )


def test_missing_files_offline_name_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        build_benchmark(cifar_config(tmp_path / "nowhere"))
    message = str(err.value)
    assert str(tmp_path / "nowhere" / "cifar-100-python") in message
    assert "data.download=true" in message and "cifar-100-python.tar.gz" in message


def test_download_uses_the_checksummed_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_download(url: str, root: str, filename: str, md5: str | None) -> None:
        calls.append((url, filename, md5))
        write_cifar100(Path(root))

    monkeypatch.setattr(sources, "download_and_extract_archive", fake_download)
    bench = build_benchmark(cifar_config(tmp_path, download=True, verify_checksums=False))
    assert bench.num_classes == 100
    assert calls == [("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "cifar-100-python.tar.gz", None)]


def test_failed_download_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args, **kwargs) -> None:
        raise OSError("Network is unreachable")

    monkeypatch.setattr(sources, "download_and_extract_archive", no_network)
    with pytest.raises(DataError, match=r"Could not download cifar100.*Network is unreachable"):
        build_benchmark(cifar_config(tmp_path, download=True))


def test_class_order_depends_only_on_its_own_seed() -> None:
    cfg = DataConfig(name="d", source="digits", tasks=5)
    torch.manual_seed(0)
    a = build_benchmark(cfg)
    torch.manual_seed(123)  # the training seed must not matter
    b = build_benchmark(cfg)
    assert [t.classes for t in a.tasks] == [t.classes for t in b.tasks]
    other = build_benchmark(DataConfig(name="d", source="digits", tasks=5, class_order_seed=7))
    assert [t.classes for t in other.tasks] != [t.classes for t in a.tasks]
    natural = build_benchmark(DataConfig(name="d", source="digits", tasks=5, class_order_seed=None))
    assert [t.classes for t in natural.tasks] == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]


def test_digits_tasks_are_disjoint_and_num_tasks_truncates() -> None:
    bench = build_benchmark(DataConfig(name="d", source="digits", tasks=5, num_tasks=3))
    assert len(bench.tasks) == 3 and bench.num_classes == 6
    assert sum(len(s) for s in bench.train) + sum(len(s) for s in bench.test) == pytest.approx(1797 * 6 / 10, rel=0.02)
    seen: set[int] = set()
    for task in bench.tasks:
        assert not seen & set(task.classes)
        seen |= set(task.classes)
    assert bench.train[0].x.shape[1:] == (1, 8, 8)


def test_every_built_in_reader_is_a_source_the_config_accepts() -> None:
    from clbench.config import SOURCES

    assert set(SOURCES) == {*sources.BUILT_IN, "image_folder"}


def test_too_many_tasks_for_the_classes_is_rejected() -> None:
    with pytest.raises(Exception, match=r"data\.tasks"):
        build_benchmark(DataConfig(name="d", source="digits", tasks=11))


@pytest.mark.parametrize("crop", ["pad", "resized", "none"])
def test_transforms_produce_normalised_rgb_at_the_backbone_size(crop: str) -> None:
    cfg = DataConfig(name="d", source="digits", tasks=5, train_crop=crop, hflip=True)
    images = torch.randint(0, 256, (6, 1, 8, 8), dtype=torch.uint8)
    for train in (True, False):
        out = DeviceTransform(cfg, 32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), train=train)(images)
        assert out.shape == (6, 3, 32, 32) and out.dtype == torch.float32
        assert out.min() >= -1.0 - 1e-5 and out.max() <= 1.0 + 1e-5


def test_eval_transform_is_deterministic_and_train_transform_is_random() -> None:
    cfg = DataConfig(name="d", source="digits", tasks=5, train_crop="pad", crop_padding=2, hflip=True)
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    test_tf = DeviceTransform(cfg, 32, (0.0,) * 3, (1.0,) * 3, train=False)
    assert torch.equal(test_tf(images), images.float() / 255)
    train_tf = DeviceTransform(cfg, 32, (0.0,) * 3, (1.0,) * 3, train=True)
    assert not torch.equal(train_tf(images), train_tf(images))


def test_the_imagenet_test_transform_resizes_then_cuts_the_border_away() -> None:
    """Resize(256) + CenterCrop(224) of a 32 px image: the crop starts 16 px in, at 256 px; bilinear resizing maps that
    row's centre to source row (16 + 0.5) / 8 - 0.5 = 1.5625, between source rows 1 and 2. With a white frame of 2 px
    on black the first row is white for 1 - 0.5625 = 0.4375; with a 3 px frame it is white."""
    cfg = DataConfig(name="d", source="digits", tasks=5, test_resize=256)
    tf = DeviceTransform(cfg, 224, (0.0,) * 3, (1.0,) * 3, train=False)
    for frame, first_row in ((2, 0.4375), (3, 1.0)):
        image = torch.full((1, 3, 32, 32), 255, dtype=torch.uint8)
        image[..., frame:-frame, frame:-frame] = 0
        out = tf(image)
        assert out.shape == (1, 3, 224, 224)
        assert out[0, :, 0, 112].tolist() == pytest.approx([first_row] * 3) and out[..., 112, 112].abs().max() == 0


def test_deits_per_image_augmentations_draw_per_image_and_give_each_rank_its_share() -> None:
    """RandAugment and random erasing are drawn per image (identical inputs come out different), are reproducible
    from the seeds, and a rank's share equals the same rows of the whole batch (so ranks match one process)."""
    import random

    cfg = DataConfig(name="d", source="digits", tasks=5, train_crop="none", hflip=False, randaugment_ops=2)
    cfg.random_erasing = 1.0
    tf = DeviceTransform(cfg, 32, (0.5,) * 3, (0.5,) * 3, train=True)
    images = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8).repeat(8, 1, 1, 1)

    def seeded(part: slice = slice(None)) -> torch.Tensor:
        torch.manual_seed(0)
        random.seed(0)
        return tf(images, part)

    whole = seeded()
    assert len({row.numpy().tobytes() for row in whole}) == 8  # eight identical images, eight different results
    assert torch.equal(seeded(), whole) and torch.equal(seeded(slice(3, 6)), whole[3:6])
    plain = DeviceTransform(DataConfig(name="d", source="digits", tasks=5, train_crop="none", hflip=False), 32,
                            (0.5,) * 3, (0.5,) * 3, train=True)  # fmt: skip
    assert torch.equal(plain(images), images.float() / 127.5 - 1)  # both off: nothing changes


def test_brightness_scales_each_training_image_as_colorjitter_and_gives_each_rank_its_share() -> None:
    """torchvision's ColorJitter(brightness=b) multiplies an image by one factor from U[1 - b, 1 + b] and clips: on a
    grey 100/255 image every pixel of an output is the input times one factor in that range; images get their own
    factors; the test path and b = 0 leave pixels alone; a rank's share is the same rows of the whole batch."""
    b = 63 / 255
    cfg = DataConfig(name="d", source="digits", tasks=5, train_crop="none", hflip=False, brightness=b)
    tf = DeviceTransform(cfg, 8, (0.0,) * 3, (1.0,) * 3, train=True)
    images = torch.full((64, 3, 8, 8), 100, dtype=torch.uint8)
    torch.manual_seed(0)
    out = tf(images)
    factors = out[:, 0, 0, 0] / (100 / 255)
    assert torch.allclose(out, factors.view(-1, 1, 1, 1) * (100 / 255))  # one factor an image, every pixel
    assert factors.min() >= 1 - b - 1e-6 and factors.max() <= 1 + b + 1e-6 and factors.std() > b / 3
    assert factors.max() - factors.min() > b  # spread over the range, not one draw
    torch.manual_seed(0)
    assert torch.equal(tf(images, slice(10, 20)), out[10:20])
    white = tf(torch.full((4, 3, 8, 8), 255, dtype=torch.uint8))
    assert white.max() <= 1.0  # clipped
    test_tf = DeviceTransform(cfg, 8, (0.0,) * 3, (1.0,) * 3, train=False)
    assert torch.equal(test_tf(images), images.float() / 255)


def test_a_test_resize_below_the_input_size_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"`data.test_resize`: 16"):
        validate(compose_config("data.test_resize=16"))


def test_pad_crop_shifts_by_whole_pixels() -> None:
    cfg = DataConfig(name="d", source="digits", tasks=5, train_crop="pad", crop_padding=3, hflip=False)
    image = torch.zeros(1, 3, 16, 16, dtype=torch.uint8)
    image[..., 8, 8] = 255
    out = DeviceTransform(cfg, 16, (0.0,) * 3, (1.0,) * 3, train=True)(image.expand(64, -1, -1, -1))
    peaks = out[:, 0].flatten(1).argmax(1)
    rows, cols = peaks // 16, peaks % 16
    assert ((rows - 8).abs() <= 3).all() and ((cols - 8).abs() <= 3).all()
    assert torch.allclose(out[:, 0].amax((1, 2)), torch.ones(64))  # whole-pixel shifts keep the peak intact


def test_synthetic_cifar100_has_cifar100s_shapes_and_counts() -> None:
    cfg = validate(compose_config("data=synthetic_cifar100", "data.synthetic_train_per_class=5")).data
    bench = build_benchmark(cfg)
    assert len(bench.tasks) == 10 and all(t.num_classes == 10 for t in bench.tasks)
    assert bench.train[0].x.shape == (50, 3, 32, 32) and sum(len(s) for s in bench.test) == 100 * 100


@pytest.mark.parametrize("size", [None, 32])
def test_permuted_tasks_hold_every_class_under_their_own_fixed_pixel_permutation(size: int | None) -> None:
    """data=permuted_digits: task t is every digit with its pixels shuffled by RandomState(seed + t).permutation(H W),
    labels t * 10 + digit; the same images, a different permutation per task. With permutation_size the images are
    resized first, so the permutation moves the pixels of the model's input, not whole 4x4 patches."""
    side = "null" if size is None else size
    cfg = validate(compose_config("data=permuted_digits", "data.num_tasks=3", f"data.permutation_size={side}")).data
    plain = build_benchmark(validate(compose_config("data=digits_5tasks", "data.class_order_seed=null")).data)
    images = torch.cat([s.x for s in plain.test])
    if size is not None:  # torchvision's antialiased bilinear resize of the uint8 images, rounded
        images = resize(images.float(), [size, size], antialias=True).round().clamp(0, 255).to(torch.uint8)
    labels = torch.cat([s.y for s in plain.test])
    order = labels.argsort(stable=True)
    permuted = build_benchmark(cfg)
    assert [t.offset for t in permuted.tasks] == [0, 10, 20] and [len(t.classes) for t in permuted.tasks] == [10] * 3
    for t, split in enumerate(permuted.test):
        perm = np.random.RandomState(t).permutation(images.shape[-1] * images.shape[-2])
        expected = images[order].flatten(2)[:, :, perm].reshape(images.shape)
        got = split.x[(split.y - 10 * t).argsort(stable=True)]
        assert torch.equal(got, expected) and set((split.y - 10 * t).tolist()) == set(range(10))
    assert not torch.equal(permuted.test[0].x, permuted.test[1].x)
    with pytest.raises(ConfigError, match=r"data\.tasks_by"):
        validate(compose_config("data=permuted_digits", "data.store=stream"))


def test_permuted_tasks_refuse_seeds_past_the_range_and_copies_past_the_memory() -> None:
    """Task t's permutation is RandomState(permutation_seed + t), whose seed must be below 2**32; every task holds its
    own copy of the 1797 digits (8x8, resized to 32x32, one byte a pixel): 100000 tasks would take 171.4 GiB."""
    with pytest.raises(
        ConfigError, match=r"`data\.permutation_seed`: 4294967295\. Allowed: an integer in \[0, 4294967291\]"
    ):
        validate(compose_config("data=permuted_digits", "data.permutation_seed=4294967295"))
    validate(compose_config("data=permuted_digits", f"data.permutation_seed={2**32 - 5}"))  # seeds up to 2**32 - 1
    cfg = validate(compose_config("data=permuted_digits", "data.tasks=100000")).data
    with pytest.raises(
        ConfigError, match=r"`data\.tasks`: 100000\. Allowed: at most \d+ tasks here.*171\.4 GiB for 100000"
    ):
        build_benchmark(cfg)
