"""Protocol P (PILOT / RevisitingCIL): the seed-1993 class order, PILOT's task split, the split archives in their real
layout (ImageFolder semantics, file list and archive checks, every missing path named), and PILOT's transforms against
torchvision's on PIL images."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TV

from clbench import prerequisites
from clbench.comparable import LATER_KEYS
from clbench.config import DataConfig, config_dir, validate
from clbench.data import DeviceTransform, build_benchmark
from clbench.data import archives as archive_checks
from clbench.data.benchmark import class_order, pilot_increments
from clbench.data.catalog import PILOT_ARCHIVES
from clbench.data.image_folder import load_image
from clbench.data.transforms import pil_resize, pil_weights, torchvision_crop_boxes
from clbench.errors import ConfigError, DataError
from clbench.loop import train
from clbench.loop.resume import check_identity, identity
from conftest import compose_config

# PTM spec §7.3: np.random.seed(1993); np.random.permutation(N), its first 20 entries and the first 16 hex digits of
# the SHA-256 of the comma-joined order (equal to the orders the MOS logs print).
ORDER_1993 = {
    100: ([68, 56, 78, 8, 23, 84, 90, 65, 74, 76, 40, 89, 3, 92, 55, 9, 26, 80, 43, 38], "997a048a5344d216"),
    200: (
        [168, 136, 51, 9, 183, 101, 171, 99, 42, 159, 191, 70, 16, 188, 27, 10, 175, 26, 68, 187],
        "1d364b99a5915405",
    ),
    300: (
        [169, 221, 146, 296, 92, 229, 49, 70, 126, 77, 243, 57, 120, 223, 27, 217, 154, 8, 101, 182],
        "18613efa7667417c",
    ),
}
# The data configs of the pack (names fixed for the method presets that use them) and each benchmark's classes.
PACK = {
    "cifar224_b0inc5": 100,
    "cifar224_b0inc10": 100,
    "imagenet_r_p_b0inc5": 200,
    "imagenet_r_p_b0inc10": 200,
    "imagenet_r_p_b0inc20": 200,
    "imagenet_r_p_b0inc40": 200,
    "imagenet_a_p_b0inc10": 200,
    "imagenet_a_p_b0inc20": 200,
    "cub_p_b0inc10": 200,
    "cub_p_b0inc20": 200,
    "objectnet_p_b0inc10": 200,
    "objectnet_p_b0inc20": 200,
    "omnibench_p_b0inc20": 300,
    "omnibench_p_b0inc30": 300,
    "vtab_p_b0inc10": 50,
}
P_BACKBONE = "backbone=vit_base_patch16_224_augreg_in21k"
CLASSES = ["n09", "n03", "n07", "n01", "n05", "n00", "n02", "n08"]  # written in this order; sorted, they are ids


@pytest.mark.parametrize("n", sorted(ORDER_1993))
def test_the_class_order_is_numpys_legacy_seed_1993_permutation(n: int) -> None:
    prefix, digest = ORDER_1993[n]
    order = class_order(n, 1993)
    assert order[:20].tolist() == prefix
    assert hashlib.sha256(",".join(map(str, order)).encode()).hexdigest()[:16] == digest
    assert class_order(n, None).tolist() == list(range(n))  # VTAB: shuffle false


@pytest.mark.parametrize(
    ("n", "init", "inc", "sizes"),
    [  # PILOT's DataManager: [init] + [inc] while sum + inc < n, then the remainder as a last task
        (100, 10, 10, [10] * 10),
        (101, 11, 10, [11] + [10] * 9),
        (300, 20, 20, [20] * 15),
        (100, 5, 5, [5] * 20),
        (10, 4, 3, [4, 3, 3]),  # 4 + 3 + 3 = 10 is not below 10: the second 3 is the remainder
        (11, 4, 3, [4, 3, 3, 1]),
        (10, 10, 3, [10]),
    ],
)
def test_pilots_task_split(n: int, init: int, inc: int, sizes: list[int]) -> None:
    assert pilot_increments(n, init, inc) == sizes


def test_the_task_split_cuts_the_class_order_and_data_tasks_must_match_it() -> None:
    cfg = DataConfig(name="d", source="digits", tasks=3, init_classes=4, increment=3)
    bench = build_benchmark(cfg)
    np.random.seed(1993)
    order = np.random.permutation(10).tolist()
    assert [list(t.classes) for t in bench.tasks] == [order[:4], order[4:7], order[7:]]
    assert [t.offset for t in bench.tasks] == [0, 4, 7]
    with pytest.raises(ConfigError, match=r"`data.tasks`: 4.*3: the tasks that init_classes=4, increment=3"):
        build_benchmark(dataclasses.replace(cfg, tasks=4))
    with pytest.raises(ConfigError, match="init_classes"):
        DataConfig(name="d", source="digits", tasks=3, init_classes=4)


def test_the_pack_ships_exactly_the_named_configs() -> None:
    shipped = {p.stem for p in (config_dir() / "data").glob("*.yaml") if "_b0inc" in p.stem}
    assert shipped == set(PACK)


@pytest.mark.parametrize("name", sorted(PACK))
def test_each_pack_config_is_pilots_protocol(name: str) -> None:
    data = validate(compose_config(f"data={name}", P_BACKBONE)).data
    inc = int(name.rsplit("inc", 1)[1])
    assert (data.protocol, data.transforms, data.init_classes, data.increment) == ("P", "pilot", inc, inc)
    assert data.tasks == len(pilot_increments(PACK[name], inc, inc)) == PACK[name] // inc
    assert data.class_order_seed == (None if name.startswith("vtab") else 1993)
    assert data.source == "cifar100" if name.startswith("cifar224") else data.folder_split == "own"


def write_archive(root: Path, folder: str, classes: list[str], train: int = 2, test: int = 1) -> list[str]:
    """``<root>/<folder>/{train,test}/<class>/*.png``, as a split archive extracts: images of mixed sizes, each
    class's pixels its position in ``CLASSES``; the relative paths written."""
    written = []
    for name in classes:
        for half, count in (("train", train), ("test", test)):
            for i in range(count):
                path = root / folder / half / name / f"{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                size = (500, 375) if i % 2 else (40, 24)
                Image.new("RGB", size, color=(10 * CLASSES.index(name),) * 3).save(path)
                written.append(f"{half}/{name}/{i}.png")
    return written


def pack_config(root: Path, *overrides: str, name: str = "imagenet_r_p_b0inc20") -> DataConfig:
    small = ("data.init_classes=2", "data.increment=2", "data.tasks=4", "data.store=device")
    return validate(compose_config(f"data={name}", f"data.root={root}", P_BACKBONE, *small, *overrides)).data


def test_a_split_archive_in_its_real_layout_reads_as_torchvisions_imagefolder(tmp_path: Path) -> None:
    written = write_archive(tmp_path, "imagenet-r", CLASSES)
    bench = build_benchmark(pack_config(tmp_path))
    ids = sorted(CLASSES)  # ImageFolder: class index = position among the sorted folder names
    np.random.seed(1993)
    order = np.random.permutation(8).tolist()
    assert [list(t.classes) for t in bench.tasks] == [order[2 * i : 2 * i + 2] for i in range(4)]
    assert [list(t.class_names) for t in bench.tasks] == [[ids[c] for c in order[2 * i : 2 * i + 2]] for i in range(4)]
    for split in (*bench.train, *bench.test):  # each image's label: its class's place in the order (PILOT's remap)
        for x, y in zip(split.x, split.y, strict=True):
            assert order.index(ids.index(CLASSES[round(x.float().mean().item() / 10)])) == y.item()
    assert bench.train[0].x.shape[1:] == (3, 256, 256)  # stored as the 256 px centre square
    assert bench.splits == [
        {
            "folder": "imagenet-r",
            "split": "train/ and test/",
            "classes": 8,
            "train_images": 16,
            "test_images": 8,
            "files_sha256": hashlib.sha256("\n".join(sorted(written)).encode()).hexdigest(),
        }
    ]


def test_the_two_halves_must_hold_the_same_non_empty_class_folders(tmp_path: Path) -> None:
    write_archive(tmp_path, "imagenet-r", CLASSES)
    (tmp_path / "imagenet-r" / "test" / "n10").mkdir()
    with pytest.raises(DataError, match=r"do not hold the same class folders \(8 and 9; only in .*test: n10\)"):
        build_benchmark(pack_config(tmp_path))
    (tmp_path / "imagenet-r" / "train" / "n10").mkdir()
    with pytest.raises(DataError, match=r"1 class folder\(s\) of .*train hold no image \(n10\)"):
        build_benchmark(pack_config(tmp_path))


def test_each_realisation_refuses_the_others_layout(tmp_path: Path) -> None:
    write_archive(tmp_path / "p", "imagenet-r", CLASSES)
    cfg = validate(compose_config("data=imagenet_r_10tasks", f"data.root={tmp_path / 'p'}", "data.store=device"))
    with pytest.raises(DataError, match=r"data\.folder_split=seeded"):
        build_benchmark(cfg.data)
    for c in CLASSES:  # the official archive's layout: <wnid>/*, no split
        (tmp_path / "d" / "imagenet-r" / c).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "d" / "imagenet-r" / c / "0.png")
    with pytest.raises(DataError, match=r"no train/ and test/ sub-folders, and data\.folder_split=own"):
        build_benchmark(pack_config(tmp_path / "d"))


def test_a_missing_benchmark_names_every_path_the_archive_and_its_source_with_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("clbench.backbones.timm_vit.cached_download", lambda source: None)  # in no cache, offline
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    (tmp_path / "imagenet-a" / "train").mkdir(parents=True)  # half of it is there
    cfg = validate(
        compose_config("data=imagenet_a_p_b0inc20", f"data.root={tmp_path}", P_BACKBONE, "backbone.pretrained=true")
    )
    with pytest.raises(DataError) as err:
        prerequisites.check_prerequisites(cfg.data, cfg.backbone)
    message = str(err.value)
    root = tmp_path.resolve()
    assert message.startswith("2 prerequisites are missing")
    assert f"missing: {root}/imagenet-a/test." in message and f"{root}/imagenet-a/train," not in message
    assert f"expected as {root}/imagenet-a/{{train,test}}/<class>/*" in message
    assert "ina.zip (MD5 7f4aaf0b1532b7a0bd670822c152d3c5)" in message
    assert "https://drive.google.com/file/d/19l52ua_vvTtttgVRziCZJjal0TPE9f2p" in message
    assert "vit_base_patch16_224.augreg_in21k" in message
    none = tmp_path.resolve() / "none"
    lines = prerequisites.missing_datasets(dataclasses.replace(cfg.data, root=str(none)))
    assert f"missing: {none}/imagenet-a/train, {none}/imagenet-a/test." in lines[0]


def test_the_archives_md5_is_checked_where_it_lies_and_a_match_is_stamped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_archive(tmp_path, "imagenet-r", CLASSES)
    zip_path = tmp_path / "imagenet-r.zip"
    zip_path.write_bytes(b"not the maintainers' archive")
    with pytest.raises(DataError, match=r"imagenet-r\.zip is not the one its maintainers published"):
        build_benchmark(pack_config(tmp_path))
    build_benchmark(pack_config(tmp_path, "data.verify_checksums=false"))
    published = hashlib.md5(zip_path.read_bytes(), usedforsecurity=False).hexdigest()
    monkeypatch.setitem(PILOT_ARCHIVES, "imagenet-r", dataclasses.replace(PILOT_ARCHIVES["imagenet-r"], md5=published))
    build_benchmark(pack_config(tmp_path))
    assert (tmp_path / "clbench-cache" / archive_checks.STAMP).is_file()

    def rehashed(path: Path) -> str:
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(archive_checks, "md5", rehashed)
    build_benchmark(pack_config(tmp_path))  # stamped: not hashed again
    zip_path.write_bytes(b"changed in place")
    with pytest.raises(AssertionError, match="hashed again"):
        build_benchmark(pack_config(tmp_path))


# ------------------------------------------------------------------------------------------------ PILOT's transforms
def pilot() -> DataConfig:
    return pack_config(Path("."), name="cifar224_b0inc10")


def pil_pipeline(image: Image.Image) -> torch.Tensor:
    """PILOT's test transform (utils/data.py build_transform) as torchvision runs it."""
    return T.Compose([T.Resize(256, interpolation=InterpolationMode.BICUBIC), T.CenterCrop(224), T.ToTensor()])(image)


def test_the_test_path_is_torchvisions_on_pil_images_to_one_8_bit_level() -> None:
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)  # a CIFAR image
    tf = DeviceTransform(pilot(), 224, (0.0,) * 3, (1.0,) * 3, train=False)
    x = torch.from_numpy(image).permute(2, 0, 1)[None]
    out = tf(x)[0]
    assert out.shape == (3, 224, 224) and torch.equal(out, tf(x)[0])  # deterministic
    assert torch.equal(out * 255, (out * 255).round()) and out.min() >= 0 and out.max() <= 1
    levels = (out - pil_pipeline(Image.fromarray(image))).abs() * 255
    assert levels.max() <= 1 + 1e-4 and (levels > 0.5).float().mean() < 1e-3  # PIL's fixed-point rounding


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (333, 256), (257, 601)])
def test_an_image_file_stored_for_pilot_gives_torchvisions_test_crop_exactly(tmp_path: Path, size: tuple) -> None:
    """torchvision resizes a 500x375 image to 341x256 and crops 224 from 58 px in; clbench stores Resize(256) +
    CenterCrop(256) (crop from 42 px in) and crops 224 from 16 px in: the same whole pixels, so even a pattern of 8 px
    along the long side comes out as torchvision's, to PIL's rounding."""
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    stripes = np.stack([(xx // 4 % 2) * 255, (yy // 4 % 2) * 255, (xx + yy) * 255 // (w + h)], -1).astype(np.uint8)
    Image.fromarray(stripes).save(tmp_path / "a.png")
    stored = torch.from_numpy(load_image(tmp_path / "a.png", 256, short_side=True))[None]
    out = DeviceTransform(pilot(), 224, (0.0,) * 3, (1.0,) * 3, train=False)(stored)[0]
    levels = (out - pil_pipeline(Image.fromarray(stripes))).abs() * 255
    assert out.shape == (3, 224, 224) and levels.max() <= 1 + 1e-4


def test_crops_are_drawn_as_torchvisions_random_resized_crop_draws_them() -> None:
    """Ten tries of scale (0.05, 1) and ratio (3/4, 4/3) in whole pixels, else the centre crop: the box statistics of
    20,000 draws agree with torchvision's get_params within four standard errors."""
    n = 20_000
    for h, w in ((32, 32), (256, 256), (300, 200)):
        torch.manual_seed(0)
        top, left, ch, cw = (v.numpy() for v in torchvision_crop_boxes(n, h, w, (0.05, 1.0), torch.device("cpu")))
        ref = np.array(
            [T.RandomResizedCrop.get_params(Image.new("L", (w, h)), [0.05, 1.0], [3 / 4, 4 / 3]) for _ in range(n)]
        )
        assert ((ch >= 1) & (cw >= 1) & (top + ch <= h) & (left + cw <= w)).all()
        for ours, theirs in (
            (ch * cw / (h * w), ref[:, 2] * ref[:, 3] / (h * w)),
            (np.log(cw / ch), np.log(ref[:, 3] / ref[:, 2])),
            ((top + ch / 2) / h, (ref[:, 0] + ref[:, 2] / 2) / h),
        ):
            assert abs(ours.mean() - theirs.mean()) < 4 * math.sqrt(ours.var() / n + theirs.var() / n)
        whole, whole_ref = ((ch == h) & (cw == w)).mean(), ((ref[:, 2] == h) & (ref[:, 3] == w)).mean()
        assert abs(whole - whole_ref) < 4 * math.sqrt(2 * whole / n) + 1e-3  # the share of whole-image boxes


@pytest.mark.parametrize("box", [(3, 5, 20, 17), (10, 2, 7, 9), (0, 0, 32, 32), (1, 3, 27, 29)])
def test_a_crop_is_torchvisions_resized_crop_of_a_pil_image_to_one_8_bit_level(box: tuple[int, ...]) -> None:
    image = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    x = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255
    top, left, h, w = (torch.tensor([float(v)]) for v in box)
    ours = pil_resize(x, pil_weights(top, h, 32, 224, "bilinear"), pil_weights(left, w, 32, 224, "bilinear"))[0]
    theirs = TV.to_tensor(TV.resized_crop(Image.fromarray(image), *box, [224, 224], InterpolationMode.BILINEAR))
    levels = (ours - theirs).abs() * 255
    assert levels.max() <= 1 + 1e-4 and (levels > 0.5).float().mean() < 0.01


def test_the_train_path_gives_random_8_bit_crops_at_224() -> None:
    tf = DeviceTransform(pilot(), 224, (0.0,) * 3, (1.0,) * 3, train=True)
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    out = tf(images)
    assert out.shape == (6, 3, 224, 224) and out.min() >= 0 and out.max() <= 1
    assert torch.equal(out * 255, (out * 255).round()) and not torch.equal(out, tf(images))
    torch.manual_seed(3)
    whole = tf(images)
    torch.manual_seed(3)
    assert torch.equal(tf(images, slice(2, 5)), whole[2:5])  # a rank's share is the same rows of the whole batch


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("data.resized_crop_scale=[0.08,1.0]",), "data.resized_crop_scale"),
        (("data.store_size=224",), "data.store_size"),
        (("backbone.normalize=true",), "backbone.normalize"),
        (("backbone.img_size=192",), "backbone.img_size"),
        (("data.transforms=clbench",), "data.transforms"),
        (("data.folder_split=auto",), "data.folder_split"),
        (("data.init_classes=null", "data.increment=null"), "data.increment"),
    ],
)
def test_a_run_labelled_pilot_or_p_is_pilots(overrides: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError, match=f"`{key}`"):
        validate(compose_config("data=imagenet_r_p_b0inc20", P_BACKBONE, *overrides))


def test_a_run_on_the_pack_records_its_protocol_split_weights_both_metric_families_and_its_cost(tmp_path: Path) -> None:
    """SimpleCIL on a 4-class ImageNet-R archive in its real layout (2 tasks of 2), over a shrunk ViT-B/16 loaded from
    a local augreg_in21k checkpoint (its 21,843-class head dropped); results.json holds what identifies the run."""
    written = write_archive(tmp_path / "data", "imagenet-r", CLASSES[:4])
    shrink = {"depth": 1, "embed_dim": 32, "num_heads": 2, "patch_size": 32}
    source = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=21843, **shrink)
    weights = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(weights))
    overrides = [f"data.root={tmp_path / 'data'}", "data.init_classes=2", "data.increment=2", "data.tasks=2"]
    overrides += [P_BACKBONE, f"backbone.weights={weights}", *(f"+backbone.kwargs.{k}={v}" for k, v in shrink.items())]
    overrides += ["data.store=device", "method=simplecil", "logger.mode=disabled"]
    cfg = validate(compose_config("data=imagenet_r_p_b0inc20", *overrides))
    train(cfg, tmp_path / "run")
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (res["benchmark"], res["protocol"], res["status"]) == ("imagenet_r_p_b0inc20", "P", "finished")
    assert res["data_splits"][0]["files_sha256"] == hashlib.sha256("\n".join(sorted(written)).encode()).hexdigest()
    backbone = res["backbone_config"]
    assert (backbone["tag"], backbone["timm_tag"], backbone["normalize"]) == ("augreg_in21k", "augreg_in21k", False)
    assert backbone["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (backbone["input_mean"], backbone["input_std"]) == ([0.0] * 3, [1.0] * 3)
    assert [t["test_images"] for t in res["tasks"]] == [2, 2]
    for scenario in ("til", "cil"):  # equal tasks: the two families agree
        m = res["metrics"][scenario]
        assert m["final_acc_micro"] == pytest.approx(m["final_acc"])
        assert m["avg_incremental_acc_micro"] == pytest.approx(m["avg_incremental_acc"])
    per_task = 32 * 2 * 32  # SimpleCIL: 2 prototypes of 32 fp32 features a task
    assert res["test_time_cost"] == [
        {"after_task": t, "forwards_per_test_image": {"til": 1, "cil": 1}, "stored_bits_per_task": [per_task] * (t + 1),
         "shared_bits": 0, "memory_bits": 0}
        for t in (0, 1)
    ]  # fmt: skip


def test_a_checkpoint_written_before_the_protocol_keys_resumes_and_one_of_another_protocol_does_not(
    tmp_path: Path,
) -> None:
    cfg = validate(compose_config("data=digits_5tasks"))
    saved = identity(cfg)
    older = {**saved, "data": {k: v for k, v in saved["data"].items() if f"data.{k}" not in LATER_KEYS}}
    assert check_identity(cfg, tmp_path, {"identity": older}) == []
    other = {**saved, "data": {**saved["data"], "protocol": "P"}}
    with pytest.raises(ConfigError, match=r"data\.protocol: checkpoint 'P', now 'clbench'"):
        check_identity(cfg, tmp_path, {"identity": other})
    for method, key in (("tuna", "decay_old_heads"), ("hide", "proto_groups")):  # a method's key added since
        cfg = validate(compose_config(f"method={method}"))
        saved = identity(cfg)
        older = {**saved, "method_config": {k: v for k, v in saved["method_config"].items() if k != key}}
        assert check_identity(cfg, tmp_path, {"identity": older}) == []
