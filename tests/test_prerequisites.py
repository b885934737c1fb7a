"""Every missing dataset and weights file named in one message, before any work starts; nothing missed, nothing
named that is there (the catalogue's layouts checked against files the real readers load)."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants

from clbench import prerequisites
from clbench.config import BackboneConfig, DataConfig, validate
from clbench.data.catalog import DATASETS
from clbench.data.sources import BUILT_IN, SOURCE_FOLDERS
from clbench.errors import DataError
from clbench.loop import train
from clbench.prerequisites import check_prerequisites, missing_datasets, missing_weights
from conftest import compose_config
from test_data import write_cifar100
from test_folders import write_five_datasets, write_image_folder
from test_presets import write_cub200, write_flowers102, write_gtsrb, write_stanford_cars

WRITERS = {  # each writes the dataset's official layout, the one its reader is tested on
    "cifar100": write_cifar100,
    "cifar10": write_five_datasets,
    "mnist": write_five_datasets,
    "fashion_mnist": write_five_datasets,
    "svhn": write_five_datasets,
    "gtsrb": write_gtsrb,
    "cub200": write_cub200,
    "stanford_cars": write_stanford_cars,
    "flowers102": write_flowers102,
}


def sequence(root: Path, *datasets: str, download: bool = False) -> DataConfig:
    return DataConfig(
        name="s", source="sequence", tasks=len(datasets), datasets=list(datasets), root=str(root), store_size=32,
        download=download,
    )  # fmt: skip


def test_every_built_in_source_with_files_is_catalogued_where_its_reader_looks() -> None:
    with_files = set(BUILT_IN) - set(prerequisites.MADE_WITHOUT_FILES)
    assert with_files <= set(DATASETS)
    for name in with_files:  # the on-disk cache fingerprints SOURCE_FOLDERS: the catalogue must point at them too
        assert all(path.startswith(SOURCE_FOLDERS[name]) for path in DATASETS[name].needs), name
    for files in DATASETS.values():  # the message prints root/layout: each layout starts with the dataset's folder
        assert files.layout.startswith(files.needs[0].split("/")[0] + "/"), files.title


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_dataset_written_in_its_official_layout_is_not_missing(tmp_path: Path, name: str) -> None:
    assert len(missing_datasets(sequence(tmp_path, name))) == 1
    WRITERS[name](tmp_path)
    assert missing_datasets(sequence(tmp_path, name)) == []


def test_all_missing_datasets_are_named_at_once_with_path_layout_size_and_source(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "wikiart", ["a", "b"], 2, split=True)  # present: not named
    lines = missing_datasets(sequence(tmp_path, "cub200", "wikiart", "cifar100", "my_folder"))
    assert [line.split(":")[0] for line in lines] == ["cub200", "cifar100", "my_folder"]
    cub, cifar, folder = lines
    assert f"{tmp_path.resolve()}/CUB_200_2011/{{images.txt" in cub and "1.1 GB" in cub
    assert "https://data.caltech.edu" in cub and "data.download cannot" in cub
    assert "cifar-100-python/{train, test, meta}" in cifar and "data.download=true" in cifar
    assert f"{tmp_path.resolve()}/my_folder/{{train,test}}/<class>/*" in folder


def test_what_data_download_fetches_is_not_missing_and_what_it_cannot_still_is(tmp_path: Path) -> None:
    lines = missing_datasets(sequence(tmp_path, "cifar100", "svhn", "cub200", download=True))
    assert [line.split(":")[0] for line in lines] == ["cub200"]


def test_an_image_folder_standing_in_for_an_official_layout_counts(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "cub200", ["a", "b"], 2, split=True)  # cub200/{train,test}/<class>/*
    assert missing_datasets(sequence(tmp_path, "cub200")) == []


def test_missing_weights_are_named_without_asking_an_offline_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_probe(url: str, timeout: float = 0) -> bool:
        raise AssertionError("HF_HUB_OFFLINE=1: the network must not be asked")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(prerequisites, "hub_reachable", no_probe)
    hub = BackboneConfig(name="b", model="deit_small_patch16_224", tag="fb_in1k", pretrained=True)
    (line,) = missing_weights(hub)
    assert "deit_small_patch16_224.fb_in1k" in line and "HF_HUB_OFFLINE=1" in line and "backbone.weights=PATH" in line
    local = BackboneConfig(name="b", model="vit_tiny_patch16_224", weights="/nowhere/vit.safetensors")
    assert "backbone.weights=/nowhere/vit.safetensors: no such file" in missing_weights(local)[0]
    assert missing_weights(BackboneConfig(name="b", model="vit_micro", tag="glyphs", pretrained=True)) == []
    assert missing_weights(BackboneConfig(name="b", model="vit_tiny_patch16_224")) == []  # random init


def test_an_unreachable_hub_is_probed_once_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    probes = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(prerequisites, "hub_reachable", lambda url, timeout=0: probes.append(url) or False)
    hub = BackboneConfig(name="b", model="vit_base_patch16_224", tag="augreg2_in21k_ft_in1k", pretrained=True)
    assert "cannot be reached" in missing_weights(hub)[0]
    assert probes == [constants.ENDPOINT]
    assert not prerequisites.hub_reachable("https://clbench.invalid")  # a name that never resolves (RFC 2606)


def test_a_paper_preset_names_its_six_datasets_and_its_weights_in_one_message(tmp_path: Path) -> None:
    cfg = validate(compose_config("experiment=meat_deit_small_paper", f"data.root={tmp_path}"))
    with pytest.raises(DataError) as err:
        check_prerequisites(cfg.data, cfg.backbone)
    message = str(err.value)
    assert message.startswith("7 prerequisites are missing")
    for name in [*cfg.data.datasets, "deit_small_patch16_224.fb_in1k"]:
        assert name in message


def test_a_run_with_missing_data_stops_before_touching_its_folder(tmp_path: Path) -> None:
    cfg = validate(compose_config("data=cifar100_10tasks", f"data.root={tmp_path}", "logger.mode=disabled"))
    with pytest.raises(DataError, match="a prerequisite is missing; nothing was started"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
