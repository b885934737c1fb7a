"""What each dataset clbench reads is, where to get it, how it must lie under ``data.root`` and how large it is: the
facts the "missing data" message and the docs' data table are made from (one place, not typed twice).

``layout`` starts with the dataset's folder under ``data.root``. ``needs`` lists the paths, relative to
``data.root``, whose presence says the dataset is there (the readers check checksums and contents when they load
it). A folder ``<name>/{train,test}/<class>/*`` of images stands in for any built-in layout
(:func:`clbench.data.sources.reads_folder`). :data:`PILOT_ARCHIVES` holds the split archives of Protocol P
(``data.protocol=P``): the same folder names as some entries of :data:`DATASETS` (``imagenet-r``), another layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DatasetFiles:
    """One dataset's files: ``title`` for people, ``url`` to get it, ``layout`` under ``data.root``, ``size`` of the
    download, whether ``data.download=true`` fetches it, and the paths that must exist for it to be read."""

    title: str
    url: str
    layout: str
    size: str
    downloads: bool
    needs: tuple[str, ...]
    archive: str | None = None  # the file to download and extract into data.root, where the maintainers give one
    md5: str | None = None  # ... and its MD5 as they publish it (checked where the archive lies in data.root)

    def present(self, root: Path) -> bool:
        return all((root / path).exists() for path in self.needs)


_CIFAR10_FILES = tuple(f"cifar-10-batches-py/{n}" for n in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"))
_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

DATASETS: dict[str, DatasetFiles] = {
    "cifar10": DatasetFiles(
        "CIFAR-10",
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta} (the official archive extracted)",
        "170 MB",
        True,
        (*_CIFAR10_FILES, "cifar-10-batches-py/batches.meta"),
    ),
    "cifar100": DatasetFiles(
        "CIFAR-100",
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        "cifar-100-python/{train, test, meta} (the official archive extracted)",
        "169 MB",
        True,
        tuple(f"cifar-100-python/{n}" for n in ("train", "test", "meta")),
    ),
    "mnist": DatasetFiles(
        "MNIST",
        "https://yann.lecun.com/exdb/mnist/",
        "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte (the four archives uncompressed)",
        "12 MB",
        True,
        tuple(f"MNIST/raw/{n}" for n in _MNIST_FILES),
    ),
    "fashion_mnist": DatasetFiles(
        "Fashion-MNIST",
        "https://github.com/zalandoresearch/fashion-mnist",
        "FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte (the four archives uncompressed)",
        "30 MB",
        True,
        tuple(f"FashionMNIST/raw/{n}" for n in _MNIST_FILES),
    ),
    "svhn": DatasetFiles(
        "SVHN, cropped digits",
        "http://ufldl.stanford.edu/housenumbers/",
        "svhn/{train,test}_32x32.mat",
        "246 MB",
        True,
        ("svhn/train_32x32.mat", "svhn/test_32x32.mat"),
    ),
    "gtsrb": DatasetFiles(
        "GTSRB, German traffic signs",
        "https://benchmark.ini.rub.de/gtsrb_dataset.html",
        "gtsrb/{GTSRB/Training/<class>/*.ppm, GTSRB/Final_Test/Images/*.ppm, GT-final_test.csv}",
        "350 MB",
        True,
        ("gtsrb/GTSRB/Training", "gtsrb/GTSRB/Final_Test/Images", "gtsrb/GT-final_test.csv"),
    ),
    "flowers102": DatasetFiles(
        "Oxford Flowers-102",
        "https://www.robots.ox.ac.uk/~vgg/data/flowers/102/",
        "flowers-102/{jpg/image_*.jpg, imagelabels.mat, setid.mat}",
        "330 MB",
        True,
        ("flowers-102/jpg", "flowers-102/imagelabels.mat", "flowers-102/setid.mat"),
    ),
    "stanford_cars": DatasetFiles(
        "Stanford Cars",
        "https://ai.stanford.edu/~jkrause/cars/car_dataset.html (the original links are down; mirrors exist)",
        "stanford_cars/{cars_train/*.jpg, cars_test/*.jpg, devkit/cars_meta.mat, devkit/cars_train_annos.mat, "
        "cars_test_annos_withlabels.mat}",
        "1.9 GB",
        False,
        (
            "stanford_cars/cars_train",
            "stanford_cars/cars_test",
            "stanford_cars/devkit/cars_meta.mat",
            "stanford_cars/devkit/cars_train_annos.mat",
            "stanford_cars/cars_test_annos_withlabels.mat",
        ),
    ),
    "cub200": DatasetFiles(
        "CUB-200-2011",
        "https://data.caltech.edu/records/65de6-vp158",
        "CUB_200_2011/{images.txt, image_class_labels.txt, train_test_split.txt, classes.txt, images/<class>/*.jpg} "
        "(CUB_200_2011.tgz extracted)",
        "1.1 GB",
        False,
        tuple(
            f"CUB_200_2011/{n}"
            for n in ("images.txt", "image_class_labels.txt", "train_test_split.txt", "classes.txt", "images")
        ),
    ),
    "imagenet-r": DatasetFiles(
        "ImageNet-R, renditions of 200 ImageNet classes",
        "https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar",
        "imagenet-r/<wnid>/*.jpg (the official archive extracted; split 80/20 per class by data.split_seed, or by "
        "data.split_lists)",
        "2.2 GB",
        False,
        ("imagenet-r",),
    ),
    "imagenet": DatasetFiles(
        "ImageNet-1k, ILSVRC 2012",
        "https://image-net.org/download.php",
        "imagenet/{train,val}/<wnid>/*.JPEG (the validation images sorted into class folders)",
        "147 GB",
        False,
        ("imagenet/train", "imagenet/val"),
    ),
    "notmnist": DatasetFiles(
        "notMNIST, its small set",
        "http://yaroslavvb.blogspot.com/2011/09/notmnist-dataset.html",
        "notmnist/<A..J>/*.png (notMNIST_small extracted; split 80/20 per class by data.split_seed)",
        "8 MB",
        False,
        ("notmnist",),
    ),
    "facescrub": DatasetFiles(
        "FaceScrub, the 100 people HAT uses",
        "http://vintage.winklerbros.net/facescrub.html (no longer distributed; bring your own copy)",
        "facescrub/<person>/* (split 80/20 per person by data.split_seed)",
        "about 100 MB at 32 px",
        False,
        ("facescrub",),
    ),
    "fgvc_aircraft": DatasetFiles(
        "FGVC-Aircraft",
        "https://www.robots.ox.ac.uk/~vgg/data/fgvc-aircraft/",
        "fgvc_aircraft/{train,test}/<class>/* (an image folder)",
        "2.6 GB",
        False,
        ("fgvc_aircraft",),
    ),
    "wikiart": DatasetFiles(
        "WikiArt, Piggyback's 195-class split",
        "https://github.com/arunmallya/piggyback (its 'Datasets' link)",
        "wikiart/{train,test}/<class>/* (an image folder, as Piggyback distributes it)",
        "2.6 GB",
        False,
        ("wikiart",),
    ),
    "sketches": DatasetFiles(
        "Sketches, TU-Berlin's 250 classes",
        "https://github.com/arunmallya/piggyback (its 'Datasets' link)",
        "sketches/{train,test}/<class>/* (an image folder, as Piggyback distributes it)",
        "550 MB",
        False,
        ("sketches",),
    ),
}


_REVISITING_CIL = "https://github.com/zhoudw-zdw/RevisitingCIL#dataset"


def _pilot(title: str, folder: str, size: str, *, drive: str | None, archive: str, md5: str) -> DatasetFiles:
    """A split archive of Protocol P: the maintainers' train/test folders, as PILOT's ImageFolder reads them."""
    url = f"https://drive.google.com/file/d/{drive} ({_REVISITING_CIL} lists a OneDrive mirror)" if drive else None
    return DatasetFiles(
        title,
        url or f"{_REVISITING_CIL} (its OneDrive link, or its file list over the original dataset)",
        f"{folder}/{{train,test}}/<class>/* ({archive} extracted, its folder named {folder})",
        size,
        False,
        (f"{folder}/train", f"{folder}/test"),
        archive,
        md5,
    )


# Protocol P's split archives: RevisitingCIL's README (links) and its issue #5 (MD5 sums); PILOT reads the same
# folders (utils/data.py). Image counts: MIN (NeurIPS 2025) Table 6 where it gives them.
PILOT_ARCHIVES: dict[str, DatasetFiles] = {
    "imagenet-r": _pilot(
        "ImageNet-R, the PILOT/RevisitingCIL split (200 classes)",
        "imagenet-r",
        "24,000 + 6,000 images",
        drive="1SG4TbiL8_DooekztyCVK8mPmfhMo8fkR",
        archive="imagenet-r.zip",
        md5="730aa3fb9c7d2ec0b6381c6b23040681",
    ),
    "imagenet-a": _pilot(
        "ImageNet-A, the PILOT/RevisitingCIL split (200 classes)",
        "imagenet-a",
        "5,960 + 1,515 images",
        drive="19l52ua_vvTtttgVRziCZJjal0TPE9f2p",
        archive="ina.zip",
        md5="7f4aaf0b1532b7a0bd670822c152d3c5",
    ),
    "cub": _pilot(
        "CUB-200-2011, the PILOT/RevisitingCIL split (200 classes; not the official 5,994 / 5,794)",
        "cub",
        "9,430 + 2,358 images",
        drive="1XbUpnWpJPnItt5zQ6sHJnsjPncnNLvWb",
        archive="cub.zip",
        md5="85e342a2d5f941e740193602057df7a5",
    ),
    "objectnet": _pilot(
        "ObjectNet, the PILOT/RevisitingCIL split (200 classes)",
        "objectnet",
        "size not published",
        drive=None,
        archive="objnet.tgz",
        md5="63ff7443a47bd682016a8ec59b8cc1bc",
    ),
    "omnibenchmark": _pilot(
        "OmniBenchmark, the PILOT/RevisitingCIL split (300 classes)",
        "omnibenchmark",
        "89,697 + 5,985 images",
        drive="1AbCP3zBMtv_TDXJypOCnOgX8hJmvJm3u",
        archive="omnibenchmark.zip",
        md5="f1c30808a707f9197c6c811ea52e5cbb",
    ),
    "vtab": _pilot(
        "VTAB, the PILOT/RevisitingCIL 50-class subset (5 tasks of 10)",
        "vtab",
        "size not published",
        drive="1xUiwlnx4k0oDhYi26KL5KwrCAya-mvJ_",
        archive="vtab.zip",
        md5="a9c37bde6105a2516c900b0c33a437c1",
    ),
}


def dataset_files(name: str, protocol: str = "clbench") -> DatasetFiles:
    """The catalogue's entry for ``name`` (a Protocol-P split archive under ``protocol="P"``); a folder it does not
    know is an image folder ``<name>/``."""
    if protocol == "P" and name in PILOT_ARCHIVES:
        return PILOT_ARCHIVES[name]
    return DATASETS.get(name) or DatasetFiles(
        name,
        "your own images",
        f"{name}/{{train,test}}/<class>/* (or {name}/<class>/*, split per class by data.split_seed)",
        "unknown",
        False,
        (name,),
    )
