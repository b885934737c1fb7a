"""The paper presets (experiment=...) build their benchmark from files in the real on-disk layout and take a
training step on CPU (with a shrunken backbone: the data pipeline, transforms and recipe are the preset's own)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.io import savemat

from clbench.config import DataConfig, validate
from clbench.data import build_benchmark
from clbench.data.split_lists import lists_path, read_split_lists
from clbench.errors import DataError
from clbench.loop.optim import build_optimizer
from clbench.loop.runtime import Runtime, build_runtime
from clbench.loop.step import train_step
from clbench.methods import Method
from conftest import compose_config
from test_data import write_cifar100
from test_folders import write_five_datasets, write_image_folder

SHRINK = (
    "backbone.pretrained=false",
    "+backbone.kwargs.depth=1",
    "+backbone.kwargs.embed_dim=32",
    "+backbone.kwargs.num_heads=2",
    "trainer.batch_size=8",
    "logger.mode=disabled",
)


def first_step(method: Method, rt: Runtime) -> torch.Tensor:
    """One training step of the first task with the preset's own first training phase (the phases before it started
    in order, without data: MIN's fit passes), optimizer and transforms; its loss."""
    cfg, task = rt.cfg, rt.benchmark.tasks[0]
    method.before_task(task)
    for phase in method.phases(task, cfg.trainer.epochs):
        method.before_phase(task, phase)
        if not (phase.observe or phase.memory):
            break
    optimizer = build_optimizer(method, task, phase, cfg.trainer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    x, y = rt.benchmark.train[0].batch(None, 0, cfg.trainer.batch_size)
    return train_step(method, task, rt, x, y, optimizer=optimizer, params=params)[0]


NATURAL = [list(range(10 * i, 10 * i + 10)) for i in range(10)]  # the official codes' class order
PROMPT_DEPTH = ("backbone.kwargs.depth=5",)  # DualPrompt's and CODA-Prompt's official blocks (up to 4) all exist


def official_split(seed: int, tasks: int) -> list[list[int]]:
    """RandSplitCIFAR100 (RAIVNLab/supsup, data/partitioncifar.py): np.random.seed(seed); perm = permutation(100)."""
    np.random.seed(seed)
    perm = np.random.permutation(100)
    size = 100 // tasks
    return [perm[size * i : size * (i + 1)].tolist() for i in range(tasks)]


@pytest.mark.parametrize(
    ("preset", "classes", "test_size"),
    [
        ("l2p_cifar100_paper", NATURAL, 224),
        ("dualprompt_cifar100_paper", NATURAL, 224),
        ("hide_cifar100_10tasks", NATURAL, 224),
        ("coda_prompt_cifar100_paper", NATURAL, 224),
        ("supsup_splitcifar100_paper", official_split(0, 20), 32),
        ("apd_cifar100_split_paper", NATURAL, 32),
    ],
)
def test_a_paper_preset_reads_the_real_layout_and_takes_a_step(
    tmp_path: Path, preset: str, classes: list[list[int]], test_size: int
) -> None:
    write_cifar100(tmp_path)
    cfg = validate(
        compose_config(
            f"experiment={preset}", f"data.root={tmp_path}", "data.verify_checksums=false", *SHRINK, *PROMPT_DEPTH
        )
    )
    method, rt = build_runtime(cfg)
    assert [list(t.classes) for t in rt.benchmark.tasks] == classes
    loss = first_step(method, rt)
    assert torch.isfinite(loss)
    assert rt.test_tf(rt.benchmark.test[0].x[:2]).shape == (2, 3, test_size, test_size)


def test_the_apd_preset_trains_every_layer_of_its_vit_from_scratch_as_the_code_trains_its_cnn(tmp_path: Path) -> None:
    """Not a random-feature model: the first step moves the patch and position embeddings, the cls token and every
    LayerNorm (others=shared) besides the decomposed Linears' sigma."""
    write_cifar100(tmp_path)
    cfg = validate(
        compose_config(
            "experiment=apd_cifar100_split_paper", f"data.root={tmp_path}", "data.verify_checksums=false", *SHRINK
        )
    )
    method, rt = build_runtime(cfg)
    names = {id(p): n for n, p in method.backbone.named_parameters()}
    before = {names[id(p)]: p.detach().clone() for p in [*method.others, method.layers["blocks.0.mlp.fc1"].sigma]}
    assert {"patch_embed.proj.weight", "pos_embed", "cls_token", "norm.weight", "blocks.0.norm1.weight"} <= set(before)
    first_step(method, rt)
    params = dict(method.backbone.named_parameters())
    assert [n for n, p in before.items() if torch.equal(params[n], p)] == []
    assert method.extra_results()["apd"]["others"] == "shared"


def write_gtsrb(root: Path, classes: int = 3, per_class: int = 2) -> None:
    """GTSRB's official layout, as torchvision reads it: Training/<class>/*.ppm, Final_Test/Images/*.ppm and the
    test labels in GT-final_test.csv (';'-separated). Sizes vary, as in GTSRB; the pixel value encodes the class."""
    base = root / "gtsrb"
    test = base / "GTSRB" / "Final_Test" / "Images"
    test.mkdir(parents=True)
    rows = ["Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId"]
    for c in range(classes):
        train = base / "GTSRB" / "Training" / f"{c:05d}"
        train.mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (20 + 7 * i, 25), (40 * c,) * 3).save(train / f"{i:05d}_00000.ppm")
        Image.new("RGB", (31, 17), (40 * c,) * 3).save(test / f"{c:05d}.ppm")
        rows.append(f"{c:05d}.ppm;31;17;0;0;30;16;{c}")
    (base / "GT-final_test.csv").write_text("\n".join(rows) + "\n")


def test_gtsrb_is_read_through_torchvision_in_its_official_layout(tmp_path: Path) -> None:
    write_gtsrb(tmp_path)
    bench = build_benchmark(
        DataConfig(name="g", source="gtsrb", tasks=3, root=str(tmp_path), store_size=16, class_order_seed=None)
    )
    assert [t.class_names for t in bench.tasks] == [("gtsrb_0",), ("gtsrb_1",), ("gtsrb_2",)]  # GTSRB names none
    for task, train, test in zip(bench.tasks, bench.train, bench.test, strict=True):
        assert train.x.shape == (2, 3, 16, 16) and test.x.shape == (1, 3, 16, 16)
        assert (train.x == 40 * task.id).all() and (test.x == 40 * task.id).all()  # labels match the images
    with pytest.raises(DataError, match=r"gtsrb/GTSRB/Training/<class>/\*\.ppm"):
        build_benchmark(DataConfig(name="g", source="gtsrb", tasks=3, root=str(tmp_path / "none"), store_size=16))


def test_the_hat_mixture_preset_reads_its_eight_datasets_in_the_official_order(tmp_path: Path) -> None:
    from sklearn.utils import shuffle

    write_five_datasets(tmp_path)  # cifar10, MNIST, FashionMNIST, svhn, notmnist
    write_cifar100(tmp_path)
    write_image_folder(tmp_path / "facescrub", ["ann", "bob", "cid"], 5, split=False)
    write_gtsrb(tmp_path, per_class=5)
    names = ["cifar10", "cifar100", "mnist", "svhn", "fashion_mnist", "gtsrb", "facescrub", "notmnist"]  # mixture.py
    order = [names[i] for i in shuffle(np.arange(8), random_state=0)]  # the official code's order for seed 0
    cfg = validate(
        compose_config("experiment=hat_mixture_paper", f"data.root={tmp_path}", "data.verify_checksums=false", *SHRINK)
    )
    assert cfg.data.datasets == order
    method, rt = build_runtime(cfg)
    classes = {"cifar10": 10, "cifar100": 100, "mnist": 10, "svhn": 10, "fashion_mnist": 10, "gtsrb": 3}
    classes |= {"facescrub": 3, "notmnist": 10}
    assert [t.num_classes for t in rt.benchmark.tasks] == [classes[n] for n in order]
    assert all(len(v) > 0 for v in rt.benchmark.validation)  # 15% held out for the plateau schedule
    loss = first_step(method, rt)
    assert torch.isfinite(loss)


def jpg(path: Path, value: int, size: tuple[int, int] = (30, 22)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value,) * 3).save(path, quality=100)


def write_cub200(root: Path, classes: int = 3, per_class: int = 4) -> None:
    """CUB_200_2011's official layout: id lists, the train/test split file and images/<class>/*.jpg."""
    base, images, labels, split, names = root / "CUB_200_2011", [], [], [], []
    for c in range(classes):
        names.append(f"{c + 1} {c + 1:03d}.bird_{c}")
        for i in range(per_class):
            n = len(images) + 1
            images.append(f"{n} {c + 1:03d}.bird_{c}/img_{n}.jpg")
            labels.append(f"{n} {c + 1}")
            split.append(f"{n} {int(i > 0)}")  # the first image of each class is a test image
            jpg(base / "images" / f"{c + 1:03d}.bird_{c}" / f"img_{n}.jpg", 60 * c)
    for name, lines in (("images", images), ("image_class_labels", labels), ("train_test_split", split)):
        (base / f"{name}.txt").write_text("\n".join(lines) + "\n")
    (base / "classes.txt").write_text("\n".join(names) + "\n")


def write_stanford_cars(root: Path, classes: int = 3, per_class: int = 3) -> None:
    """Stanford Cars as torchvision reads it: cars_train/, cars_test/, devkit/{cars_meta,cars_train_annos}.mat and
    cars_test_annos_withlabels.mat (struct arrays with fname and a 1-based class)."""
    base = root / "stanford_cars"
    (base / "devkit").mkdir(parents=True)
    savemat(
        str(base / "devkit" / "cars_meta.mat"),
        {"class_names": np.array([f"car {c}" for c in range(classes)], dtype=object)},
    )
    for split, annos, n in (
        ("train", base / "devkit" / "cars_train_annos.mat", per_class),
        ("test", base / "cars_test_annos_withlabels.mat", 1),
    ):
        records = np.zeros(classes * n, dtype=[("fname", "O"), ("class", "O")])
        for k, (c, i) in enumerate((c, i) for c in range(classes) for i in range(n)):
            records[k] = (f"{c}_{i}.jpg", c + 1)
            jpg(base / f"cars_{split}" / f"{c}_{i}.jpg", 60 * c)
        savemat(str(annos), {"annotations": records})


def write_flowers102(root: Path, classes: int = 102) -> None:
    """Flowers-102 as torchvision reads it: jpg/image_XXXXX.jpg, imagelabels.mat (1-based) and setid.mat (1-based
    ids of train, val and test). All 102 classes: torchvision names them itself."""
    base = root / "flowers-102"
    labels = np.repeat(np.arange(1, classes + 1), 3)
    for n, label in enumerate(labels, 1):
        jpg(base / "jpg" / f"image_{n:05d}.jpg", 2 * (label - 1), (12, 10))
    savemat(str(base / "imagelabels.mat"), {"labels": labels})
    ids = np.arange(1, len(labels) + 1).reshape(classes, 3)
    savemat(str(base / "setid.mat"), {"trnid": ids[:, 0], "valid": ids[:, 1], "tstid": ids[:, 2]})


@pytest.mark.parametrize("preset", ["packnet_finegrained_paper", "piggyback_finegrained_paper"])
def test_the_finegrained_presets_read_each_dataset_in_its_own_layout(tmp_path: Path, preset: str) -> None:
    write_cub200(tmp_path)
    write_stanford_cars(tmp_path)
    write_flowers102(tmp_path)
    for name in ("wikiart", "sketches"):
        write_image_folder(tmp_path / name, ["a", "b"], 3, split=True)
    cfg = validate(
        compose_config(
            f"experiment={preset}",
            f"data.root={tmp_path}",
            "data.verify_checksums=false",
            "data.store_size=32",
            *SHRINK,
        )
    )
    method, rt = build_runtime(cfg)
    bench = rt.benchmark
    assert [t.num_classes for t in bench.tasks] == [3, 3, 102, 2, 2]
    assert [len(s) for s in bench.train[:3]] == [9, 9, 204] and [len(s) for s in bench.test[:3]] == [3, 3, 102]
    for task, split, step in zip(bench.tasks[:3], bench.train[:3], (60, 60, 2), strict=True):  # labels fit the images
        grey = split.x[:, 0, 16, 16].float()
        assert torch.allclose(grey, step * (split.y - task.offset).float(), atol=3), task
    assert (
        bench.tasks[1].class_names[0] == "stanford_cars/car 0" and bench.tasks[0].class_names[0] == "cub200/001.bird_0"
    )
    loss = first_step(method, rt)
    assert torch.isfinite(loss) and rt.test_tf(bench.test[0].x[:2]).shape == (2, 3, 224, 224)


def test_an_image_folder_with_train_and_test_takes_precedence_over_an_official_layout(tmp_path: Path) -> None:
    write_cub200(tmp_path)
    write_image_folder(tmp_path / "cub200", ["x", "y"], 2, split=True)  # e.g. Piggyback's cropped copy
    bench = build_benchmark(
        DataConfig(name="s", source="sequence", datasets=["cub200"], tasks=1, root=str(tmp_path), store_size=16)
    )
    assert bench.tasks[0].class_names == ("cub200/x", "cub200/y")


def write_imagenet(root: Path, classes: int = 1000) -> None:
    """ImageNet as the official SupSup code reads it: imagenet/{train,val}/<wnid>/*.JPEG (one image each here); the
    pixel value encodes the class index modulo 250."""
    for c in range(classes):
        for split in ("train", "val"):
            jpg(root / "imagenet" / split / f"n{c:08d}" / f"{split}_{c}.JPEG", (c % 250), (10, 8))


def test_the_splitimagenet_preset_streams_the_official_split(tmp_path: Path) -> None:
    write_imagenet(tmp_path)
    cfg = validate(
        compose_config(
            "experiment=supsup_splitimagenet_paper",
            f"data.root={tmp_path}",
            "data.store=stream",  # what auto picks at ImageNet's size, exercised on 2,000 tiny JPEGs
            "data.store_size=16",
            *SHRINK,
        )
    )
    assert (cfg.trainer.batch_size, cfg.trainer.epochs, cfg.trainer.warmup_epochs) == (8, 100, 5)  # batch: SHRINK
    method, rt = build_runtime(cfg)
    np.random.seed(1)  # data/splitimagenet.py: np.random.seed(1); class_split_order = np.random.permutation(1000)
    official = np.random.permutation(1000)
    tasks = [official[10 * i : 10 * i + 10].tolist() for i in range(100)]
    assert [list(t.classes) for t in rt.benchmark.tasks] == tasks
    assert [len(s) for s in rt.benchmark.test] == [10] * 100  # the val folder is the test set
    x, y = rt.benchmark.test[3].batch(None, 0, 10)
    assert np.allclose(x[:, 0, 8, 8].numpy(), official[y.numpy()] % 250, atol=3)
    loss = first_step(method, rt)
    assert torch.isfinite(loss) and rt.test_tf(x[:2]).shape == (2, 3, 224, 224)


def test_the_meat_preset_takes_a_deit_step_on_its_six_dataset_sequence(tmp_path: Path) -> None:
    for name in ("cub200", "stanford_cars", "fgvc_aircraft", "wikiart", "sketches"):
        write_image_folder(tmp_path / name, ["a", "b", "c"], 3, split=True)
    write_cifar100(tmp_path)
    cfg = validate(
        compose_config(
            "experiment=meat_deit_small_paper",
            f"data.root={tmp_path}",
            "data.verify_checksums=false",
            "data.store_size=32",
            *SHRINK,
        )
    )
    assert (cfg.trainer.mixup, cfg.trainer.cutmix, cfg.data.randaugment_ops, cfg.data.random_erasing) == (
        0.8,
        1.0,
        2,
        0.25,
    )
    method, rt = build_runtime(cfg)
    assert [t.num_classes for t in rt.benchmark.tasks] == [3, 3, 3, 3, 3, 100]
    loss = first_step(method, rt)  # RandAugment, random erasing and mixup/cutmix on the batch, soft targets
    assert torch.isfinite(loss) and rt.test_tf(rt.benchmark.test[0].x[:2]).shape == (2, 3, 224, 224)


def test_the_l2p_five_datasets_preset_takes_a_step_on_its_files(tmp_path: Path) -> None:
    write_five_datasets(tmp_path)
    cfg = validate(
        compose_config(
            "experiment=l2p_five_datasets_paper", f"data.root={tmp_path}", "data.verify_checksums=false", *SHRINK
        )
    )
    method, rt = build_runtime(cfg)
    assert [t.num_classes for t in rt.benchmark.tasks] == [10] * 5
    assert torch.isfinite(first_step(method, rt))


@pytest.mark.parametrize(
    "preset",
    [
        "dualprompt_imagenet_r_paper",
        "hide_imagenet_r_10tasks",
        "hide_lora_imagenet_r_10tasks",
    ],
)
def test_the_imagenet_r_prompt_presets_read_the_wnid_folders_in_sorted_order_and_take_a_step(
    tmp_path: Path, preset: str
) -> None:
    """ImageNet-R as <root>/imagenet-r/<wnid>/*: 200 classes in 10 tasks in sorted WordNet-id order (both official
    codes' order), the seeded 80/20 split, Resize(256) + CenterCrop(224) at test."""
    wnids = [f"n{1440000 + 37 * i:08d}" for i in range(200)]
    write_image_folder(tmp_path / "imagenet-r", wnids[::-1], 5, split=False)  # reversed: the order is the names'
    overrides = (f"experiment={preset}", f"data.root={tmp_path}", *SHRINK, *PROMPT_DEPTH, "data.store=device")
    method, rt = build_runtime(validate(compose_config(*overrides)))
    assert [name for task in rt.benchmark.tasks for name in task.class_names] == wnids
    assert torch.isfinite(first_step(method, rt))
    assert rt.test_tf(rt.benchmark.test[0].x[:2]).shape == (2, 3, 224, 224)


@pytest.mark.slow
def test_the_coda_prompt_imagenet_r_preset_reads_codas_own_split_in_its_label_order_and_takes_a_step(
    tmp_path: Path,
) -> None:
    """Every image that CODA-Prompt's lists name, as 1-pixel PNGs at <root>/imagenet-r/<wnid>/<file>: the preset reads
    exactly its 24,000 / 6,000 images in 10 tasks of 20, its classes in the lists' label order, unshuffled."""
    lists = read_split_lists("coda_imagenet_r")
    pixel = tmp_path / "pixel.png"
    Image.new("RGB", (1, 1)).save(pixel)
    for path in lists.train + lists.test:
        (tmp_path / "imagenet-r" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "imagenet-r" / path).write_bytes(pixel.read_bytes())
    overrides = ("experiment=coda_prompt_imagenet_r_paper", f"data.root={tmp_path}", *SHRINK, *PROMPT_DEPTH)
    method, rt = build_runtime(validate(compose_config(*overrides, "data.store=device", "data.store_size=32")))
    assert [name for task in rt.benchmark.tasks for name in task.class_names] == lists.classes
    assert (sum(len(s.y) for s in rt.benchmark.train), sum(len(s.y) for s in rt.benchmark.test)) == (24000, 6000)
    assert (
        rt.benchmark.splits[0]["lists_sha256"] == hashlib.sha256(lists_path("coda_imagenet_r").read_bytes()).hexdigest()
    )
    assert torch.isfinite(first_step(method, rt))


def test_every_paper_preset_is_found_by_its_method_name() -> None:
    """The header names a method by its config's file (coda_prompt, not the class's codaprompt): each preset file
    conf/experiment/<method>_*paper*.yaml is announced to the runs of that method."""
    from clbench.config import config_dir
    from clbench.loop.runtime import paper_presets

    files = sorted(p.stem for p in (config_dir() / "experiment").glob("*paper*.yaml"))
    found = []
    for method in sorted(p.stem for p in (config_dir() / "method").glob("*.yaml")):
        found += paper_presets(validate(compose_config(f"method={method}")))
    assert sorted(found) == files
